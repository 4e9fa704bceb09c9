import argparse
import ast
import contextlib
import json
import random
import re
import runpy
import socket
import sys

import pytest
import torch
from conftest import (
    ALONE,
    ROOT,
    Run,
    check_timeline,
    copy_example,
    find_free_port,
    load_example,
    outside_imports,
    run_example,
)
from example_modules import example_modules

hybrid = load_example("ddp_rpc_hybrid")  # main.py: the tutorial's 2020 revision
extras = load_example("ddp_rpc_hybrid", "extras")  # what main.py and remote_module.py add
SCRIPTS = ["main.py", "remote_module.py"]  # the tutorial's 2020 and 2021 revisions


# --------- Pure logic, in-process --------------------

@pytest.mark.parametrize("trainer_rank, num_trainers, gpu_count, expected, why", [
    (0, 2, 0, ("gloo", "cpu"), "this machine has no GPU"),
    (1, 2, 0, ("gloo", "cpu"), "this machine has no GPU"),
    # one GPU, two trainers: NCCL cannot share it, and the tutorial's .cuda(1) would fail
    (0, 2, 1, ("gloo", "cpu"), "1 GPU cannot give each of the 2 trainers its own (NCCL needs "
                               "one a trainer)"),
    (2, 3, 2, ("gloo", "cpu"), "2 GPUs cannot give each of the 3 trainers its own (NCCL needs "
                               "one a trainer)"),
    (0, 2, 2, ("nccl", "cuda:0"), "each of the 2 trainers has a GPU of its own"),
    (1, 2, 2, ("nccl", "cuda:1"), "each of the 2 trainers has a GPU of its own"),
    (0, 1, 1, ("nccl", "cuda:0"), "each of the 1 trainers has a GPU of its own"),
    (2, 3, 8, ("nccl", "cuda:2"), "each of the 3 trainers has a GPU of its own"),
])
def test_backend_and_device_follow_the_tutorial(trainer_rank, num_trainers, gpu_count, expected,
                                                why):
    backend, device, reason = extras.choose_backend_and_device(trainer_rank, num_trainers,
                                                               gpu_count)
    assert (backend, str(device), reason) == (*expected, why)


def test_a_trainer_says_first_which_backend_and_device_and_why(monkeypatch, capsys):
    """Its first line, with one GPU faked for two trainers: Gloo on the CPU, and why."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert extras.trainer_backend(1, 2) == "gloo"
    assert capsys.readouterr().out == ("trainer1: Gloo on the CPU, as 1 GPU cannot give each of "
                                       "the 2 trainers its own (NCCL needs one a trainer)\n")


@pytest.mark.parametrize("world_size, names", [
    (3, ["trainer0", "master", "ps"]),
    (4, ["trainer0", "trainer1", "master", "ps"]),
    (6, ["trainer0", "trainer1", "trainer2", "trainer3", "master", "ps"]),
])
def test_ranks_are_trainers_then_master_then_ps(world_size, names):
    assert [extras.worker_name(rank, world_size) for rank in range(world_size)] == names


def test_batches_are_bags_whose_indices_all_belong_to_the_target_class():
    # Without num_embeddings, as bench/baselines.py draws them: the table of main.py's size.
    assert extras.TABLE_ROWS == hybrid.NUM_EMBEDDINGS
    batches = list(extras.get_next_batch(random.Random(0), 50, torch.device("cpu")))
    assert len(batches) == 50
    for indices, offsets, target in batches:
        assert indices.dtype == offsets.dtype == target.dtype == torch.int64
        assert 20 <= len(indices) <= 50
        assert offsets[0] == 0 and len(target) == len(offsets)
        bag_sizes = torch.diff(offsets, append=torch.tensor([len(indices)]))
        assert bag_sizes.min() >= 1 and bag_sizes.max() <= 10
        assert indices.min() >= 0 and indices.max() < hybrid.NUM_EMBEDDINGS
        assert torch.equal(indices % extras.NUM_CLASSES, target.repeat_interleave(bag_sizes))
    every_index = torch.cat([indices for indices, _, _ in batches])
    every_target = torch.cat([target for _, _, target in batches])
    assert every_index.unique().numel() == hybrid.NUM_EMBEDDINGS  # the whole table is used
    assert every_target.unique().numel() == extras.NUM_CLASSES


def test_batches_depend_on_the_seed_only():
    def draw(seed):
        return [torch.cat(batch) for batch in
                extras.get_next_batch(random.Random(seed), 5, torch.device("cpu"))]

    same, again, other = draw(7), draw(7), draw(8)
    assert all(torch.equal(a, b) for a, b in zip(same, again, strict=True))
    assert not all(a.shape == b.shape and torch.equal(a, b)
                   for a, b in zip(same, other, strict=True))


def test_main_py_keeps_the_names_that_bench_reads():
    """bench/baselines.py sizes the table through main.py, and draws the batches through
    extras.py (main.py's get_next_batch is inside _run_trainer, as in the tutorial)."""
    assert (hybrid.NUM_EMBEDDINGS, hybrid.EMBEDDING_DIM) == (extras.TABLE_ROWS, 16)
    assert extras.NUM_CLASSES == 8


def test_bag_indices_draws_as_get_next_batch_does():
    """main.py's get_next_batch draws from the random module, seeded, what extras.py's draws
    from a random.Random of the same seed, in the same order."""
    state = random.getstate()
    try:
        random.seed(3)
        num_indices = random.randint(20, 50)
        offsets, start = [], 0
        while start < num_indices:
            offsets.append(start)
            start += random.randint(1, 10)
        target = torch.LongTensor([random.randrange(8) for _ in offsets])
        indices = extras.bag_indices(random, target, offsets, num_indices, hybrid.NUM_EMBEDDINGS)
    finally:
        random.setstate(state)
    [(expected_indices, expected_offsets, expected_target)] = extras.get_next_batch(
        random.Random(3), 1, torch.device("cpu"))
    assert torch.equal(indices, expected_indices)
    assert torch.equal(torch.LongTensor(offsets), expected_offsets)
    assert torch.equal(target, expected_target)


@pytest.fixture
def one_thread():
    """Tensors this small gain nothing from intra-op threads, which stall when the cores are
    busy (a 0.2 s test took 10 s on a loaded 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_targets_can_be_learned_by_the_model_s_two_halves(one_thread):
    """The same model and optimizer settings as the trainers, locally, without RPC or DDP: the
    loss falls to well under half of where it starts."""
    torch.manual_seed(0)
    table = torch.nn.EmbeddingBag(hybrid.NUM_EMBEDDINGS, hybrid.EMBEDDING_DIM, mode="sum")
    dense = torch.nn.Linear(hybrid.EMBEDDING_DIM, extras.NUM_CLASSES)
    opt = torch.optim.SGD([*table.parameters(), *dense.parameters()], lr=0.05)  # the trainers'

    losses = []
    for indices, offsets, target in extras.get_next_batch(random.Random(0), 200,
                                                         torch.device("cpu")):
        loss = torch.nn.functional.cross_entropy(dense(table(indices, offsets)), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    early, late = sum(losses[:20]) / 20, sum(losses[-50:]) / 50
    assert late < 0.4 * early, (early, late)


def test_the_folder_imports_nothing_from_outside_it():
    """The brief's static check: a folder copied alone needs only torch and its friends."""
    assert outside_imports(ROOT / "ddp_rpc_hybrid") == []


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_program_declares_its_world_size_with_a_literal_default(script):
    """rpcrun reads the default world size from the script it runs, with ast: an
    add_argument("--world_size", ..., default=4) call (the tutorial's four ranks)."""
    calls = [node for node in ast.walk(ast.parse((ROOT / "ddp_rpc_hybrid" / script).read_text()))
             if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"
             and node.args and getattr(node.args[0], "value", None) == "--world_size"]
    [call] = calls
    assert {k.arg: k.value.value for k in call.keywords if k.arg == "default"} == {"default": 4}


# --------- Command line, in-process --------------------

CHECK_ARGS = extras.check_args  # the real one, which main_args() wraps


class Checked(Exception):
    """Raised in place of the launch: the program's __main__ has parsed and checked its flags."""


def main_args(monkeypatch, argv, script="main.py"):
    """The args that `python SCRIPT ARGV` parses and checks: its __main__ run in this process up
    to extras.check_args, where it stops before any rank starts. Bad input ends there with
    SystemExit, as the command does."""
    checked = []

    def check_and_stop(parser, args):
        CHECK_ARGS(parser, args)
        checked.append(args)
        raise Checked

    monkeypatch.setattr(extras, "check_args", check_and_stop)
    monkeypatch.setattr(sys, "argv", [script, *map(str, argv)])
    with example_modules("ddp_rpc_hybrid"), contextlib.suppress(Checked):
        runpy.run_path(str(ROOT / "ddp_rpc_hybrid" / script), run_name="__main__")
    return checked[0]


def bad_input_message(capsys, monkeypatch, argv, script="main.py"):
    """The one line, status 2, with which the command refuses argv."""
    with pytest.raises(SystemExit) as exited:
        main_args(monkeypatch, argv, script)
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


# A process of its own (seconds of torch's import): the in-process tests check each
# message; this one, that the real command stops before any rank starts.
@pytest.mark.slow
def test_the_command_refuses_bad_input_in_one_line_before_any_rank_starts(runs):
    """The real command: one line, status 2, no rank started (nothing left, nothing printed)."""
    run = runs.start("ddp_rpc_hybrid", "--world_size", 2, "--master_port", find_free_port())
    run.wait(timeout=60)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr == ("main.py: error: argument --world_size: must be at least 3 (a trainer, "
                          "the master and ps), got 2\n")
    assert not run.children() and not run.leftovers(grace=0)


@pytest.mark.parametrize("argv, expected", [
    (["--world_size", "2"], "argument --world_size: must be at least 3 (a trainer, the master "
                            "and ps), got 2"),
    (["--world_size", "four"], "invalid int value: 'four'"),
    (["--rank", "4"], "--rank 4 is outside a world of 4 (ranks 0 to 3)"),
    (["--world_size", "3", "--rank", "3"], "outside a world of 3"),
    (["--rank", "-1"], "must be at least 0"),
    (["--epochs", "0"], "must be at least 1"),
    (["--batches_per_epoch", "-2"], "must be at least 1"),
    (["--seed", "-1"], "must be at least 0"),
    (["--seed", "x"], "invalid integer (>= 0) value: 'x'"),
    (["--master_port", "0"], "from 1 to 65535"),
    (["--master_port", "65536"], "from 1 to 65535"),
    (["--master_port", "65535"], "RPC meets on the next port, and 65536 is not a port"),
    (["--master_addr", "no-such-host.invalid"], "--master_addr no-such-host.invalid: no such "
                                                "host"),
    (["--epoch", "3"], "unrecognized arguments: --epoch 3"),  # no abbreviated flags
    (["--rpc_timeout", "5"], "unrecognized arguments"),  # the harness's flags are gone
])
@pytest.mark.parametrize("script", SCRIPTS)
def test_bad_input_is_one_line_and_status_2(capsys, monkeypatch, argv, expected, script):
    argv = [*argv, "--master_port", find_free_port()] if "--master_port" not in argv else argv
    assert expected in bad_input_message(capsys, monkeypatch, argv, script)


def free_port_and_the_next():
    """A free port whose next port is free too (RPC's)."""
    while True:
        port = find_free_port()
        with contextlib.suppress(OSError):
            socket.create_server(("localhost", port + 1)).close()
            return port


@pytest.mark.parametrize("taken", [0, 1])
def test_a_taken_port_is_refused_where_rank_0_runs(capsys, monkeypatch, taken):
    """Rank 0 (trainer0) listens on --master_port (the process group) and the next port (RPC):
    its command refuses either one taken; another rank's command does not listen on them."""
    port = free_port_and_the_next()
    with socket.create_server(("localhost", port + taken)):
        err = bad_input_message(capsys, monkeypatch, ["--master_port", port])
        assert f"cannot listen on localhost:{port + taken}" in err
        assert "choose another --master_port" in err
        assert main_args(monkeypatch, ["--master_port", port, "--rank", 3]).rank == 3


def test_output_paths_are_checked_before_anything_starts(capsys, monkeypatch, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    port = ["--master_port", find_free_port()]
    err = bad_input_message(capsys, monkeypatch, [*port, "--summary_json", tmp_path / "no" / "s"])
    assert "--summary_json" in err and "no such folder" in err
    err = bad_input_message(capsys, monkeypatch, [*port, "--summary_json", tmp_path])
    assert "that is a folder, not a file" in err
    err = bad_input_message(capsys, monkeypatch, [*port, "--profile", a_file / "traces"])
    assert f"--profile {a_file / 'traces'}: cannot write there" in err
    # the master writes the summary: the other ranks' commands leave --summary_json alone
    args = main_args(monkeypatch, ["--rank", 3, "--summary_json", tmp_path / "no" / "s"])
    assert args.rank == 3


def test_torchrun_with_too_few_processes_is_one_line(capsys, monkeypatch):
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", str(find_free_port()))):
        monkeypatch.setenv(name, value)
    assert "torchrun started 2 processes: the world size must be at least 3" in (
        bad_input_message(capsys, monkeypatch, []))


def test_torchrun_environment_and_hyphenated_flags(monkeypatch):
    """Under torchrun its RANK and WORLD_SIZE stand for the flags; its agent's store holds
    MASTER_PORT, so the run meets on the next two ports, without the agent's store."""
    for name, value in (("RANK", "3"), ("WORLD_SIZE", "5"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", "29999"), ("TORCHELASTIC_USE_AGENT_STORE", "True")):
        monkeypatch.setenv(name, value)
    args = main_args(monkeypatch, ["--batches-per-epoch", "4", "--world-size", "9",
                                   "--summary-json", "s.json"], "remote_module.py")
    assert (args.rank, args.world_size, args.master_addr, args.master_port) == (
        3, 5, "127.0.0.1", 30000)
    assert (args.batches_per_epoch, args.summary_json, args.remote_module) == (4, "s.json", True)
    assert "TORCHELASTIC_USE_AGENT_STORE" not in extras.os.environ
    assert args.torchrun and extras.worker_name(3, args.world_size) == "master"


def test_help_shows_every_default(capsys, monkeypatch):
    with pytest.raises(SystemExit) as exited:
        main_args(monkeypatch, ["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert exited.value.code == 0
    for flag in ("--world_size", "--rank", "--master_addr", "--master_port", "--epochs",
                 "--batches_per_epoch", "--seed", "--summary_json", "--profile"):
        assert flag in out
    for default in (4, 100, 10, 29500, "localhost"):
        assert f"(default: {default})" in out


def test_a_summary_that_cannot_be_written_comes_after_the_summary_line(capsys, tmp_path):
    """The figures first, then one line naming the file and why, status 1."""
    args = argparse.Namespace(world_size=3, epochs=1, batches_per_epoch=2, remote_module=False,
                              started=0.0, summary_json=str(tmp_path / "gone" / "s.json"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(extras, "FIGURES", {
            "trainer0": {"losses": [2.0, 1.0], "backend": "gloo", "train_seconds": 1.0,
                         "dense_weights": "d", "rss": 1},
            "master": {"table_change": 0.5, "rss": 1}, "ps": {"rss": 1}})
        with pytest.raises(SystemExit) as exited:
            extras.write_summary(args)
    lines = capsys.readouterr().out.splitlines()
    assert exited.value.code == 1
    assert lines[-2].startswith("Summary: loss trainer0 2.0000 -> 1.0000; ")
    assert lines[-1].startswith(f"--summary_json {args.summary_json}: not written (")


# --------- Whole runs --------------------

def epoch_losses(output, trainer):
    """Each epoch's mean loss, from the trainer's line that follows the tutorial's."""
    return [float(loss) for loss in re.findall(rf"^{trainer}: epoch \d+ loss (\S+)$", output,
                                               re.M)]


def tutorial_lines(output):
    return re.findall(r"^Training done for epoch (\d+)$", output, re.M)


def first_line_of(trainer, num_trainers):
    """What a trainer says first on the machine at hand: its backend, device and why."""
    backend, device, why = extras.choose_backend_and_device(trainer, num_trainers,
                                                            torch.cuda.device_count())
    on = "the CPU" if device.type == "cpu" else str(device)
    return f"trainer{trainer}: {extras.BACKEND_NAMES[backend]} on {on}, as {why}"


def finish(run, timeout):
    """Wait for a run; fail the test if it times out or leaves processes."""
    try:
        run.wait(timeout)
        alive = run.leftovers()
    finally:
        run.kill_session()
    assert not alive, f"processes left running after {' '.join(run.cmd)}: {alive}"
    return run


# The tutorial's two revisions: 2020 (main.py) and 2021 (remote_module.py).
REVISIONS = {"emb_rref": "main.py", "remote_module": "remote_module.py"}
PROFILED = "emb_rref"  # the run of the two that is the brief's smoke run, and profiled


@pytest.fixture(scope="module")
def spawn_all_runs(tmp_path_factory):
    """spawn_all_runs(revision): its spawn-all run (two trainers, the master, ps), made when a
    test first asks for it; (the run, its summary). main.py's is the brief's smoke run: the
    folder copied alone, its plain command run from the copy with a Python where this
    project's package cannot be imported, profiled."""
    tmp, done = tmp_path_factory.mktemp("ddp"), {}

    def spawn_all(name):
        if name not in done:
            try:
                done[name] = run_once(name)
            except (pytest.fail.Exception, AssertionError) as failed:  # then each test fails
                done[name] = failed
        if isinstance(done[name], BaseException):
            raise done[name]
        return done[name]

    def run_once(name):
        summary = tmp / f"{name}.json"
        flags = ["--epochs", 10, "--master_port", find_free_port(), "--summary_json", summary]
        if name == PROFILED:
            copy = copy_example("ddp_rpc_hybrid", tmp / "copy")
            run = finish(Run([*ALONE, "main.py", *flags, "--profile", tmp / "trace"], tmp,
                             cwd=copy), timeout=150)
        else:
            run = run_example("ddp_rpc_hybrid", *flags, timeout=150, log_dir=tmp,
                              script=REVISIONS[name])
        return run, json.loads(summary.read_text()) if summary.exists() else None
    return spawn_all


def test_the_profiled_timeline_shows_the_ps_embedding_bag(spawn_all_runs):
    """--profile: a trace per rank (the trainers, the master, the ps), and the ps's
    EmbeddingBag looking up the bags of the trainers' steps."""
    run, _ = spawn_all_runs(PROFILED)
    check_timeline([run], run.log_dir / "trace", ["trainer0", "trainer1", "master", "ps"], "ps",
                   {"aten::embedding_bag", "aten::_embedding_bag"})


# The 2021 revision's run is in the whole suite only.
@pytest.fixture(params=[PROFILED, pytest.param("remote_module", marks=pytest.mark.slow)])
def two_trainers(spawn_all_runs, request):
    return spawn_all_runs(request.param)


def test_spawn_all_trains_both_trainers(two_trainers):
    run, summary = two_trainers
    assert run.returncode == 0, run.output
    assert summary["remote_module"] == any(part.endswith("remote_module.py") for part in run.cmd)
    lines = run.stdout.splitlines()
    for trainer in (0, 1):
        assert first_line_of(trainer, 2) in lines[:2], run.stdout  # the trainers' first lines
        assert len(epoch_losses(run.stdout, f"trainer{trainer}")) == 10
    assert sorted(tutorial_lines(run.stdout), key=int) == [str(e) for e in range(10) for _ in "01"]
    # the master's last line; after it, only another rank's --profile line
    [summary_line] = [n for n, line in enumerate(lines) if line.startswith("Summary: loss ")]
    assert all(": profiled, wrote " in line for line in lines[summary_line + 1:]), run.stdout
    # NCCL only when every trainer has a GPU of its own (tests/test_gpu.py runs that).
    assert summary["trainers"] == 2
    assert summary["backend"] == ("nccl" if torch.cuda.device_count() >= 2 else "gloo")
    assert summary["iterations_per_trainer"] == {"trainer0": 100, "trainer1": 100}
    assert summary["wall_seconds"] > 0
    assert set(summary["peak_memory_mb"]) == {"trainer0", "trainer1", "master", "ps"}


def test_spawn_all_learned(two_trainers):
    run, summary = two_trainers
    for trainer in ("trainer0", "trainer1"):
        losses = epoch_losses(run.stdout, trainer)
        assert losses[-1] < 0.5 * losses[0] and losses[-1] < 1.0, losses  # chance is 2.08
        assert summary["first_loss"][trainer] == pytest.approx(losses[0], abs=1e-4)
        assert summary["last_loss"][trainer] == pytest.approx(losses[-1], abs=1e-4)


def test_spawn_all_trained_both_halves(two_trainers):
    """DDP kept the two replicas of the dense layer identical, and the table on ps moved."""
    run, summary = two_trainers
    assert "Dense layer weights identical on trainer0, trainer1: yes" in run.stdout, run.output
    assert "Embedding table on ps changed: yes" in run.stdout, run.output
    assert summary["dense_weights_identical"] is True
    assert summary["embedding_table_changed"] is True
    assert summary["embedding_table_max_change"] > 0.01
