"""pipeline_parallel: the two ResNet-50 shards compose to one model whatever the number of
micro-batches; main.py's master trains and learns for each --num_split it times, and
pipelining.py's stages for each schedule; both run from the folder copied alone, on plain torch;
bad input is refused with one line, status 2, before anything starts."""

import json
import re
import runpy
import sys

import pytest
import torch
from conftest import (
    ALONE,
    ROOT,
    Runs,
    check_timeline,
    copy_example,
    find_free_port,
    load_example,
    outside_imports,
)
from example_modules import example_modules

pipeline = load_example("pipeline_parallel")
pipeline_data = load_example("pipeline_parallel", "data")
extras = load_example("pipeline_parallel", "extras")
pipelining = load_example("pipeline_parallel", "pipelining")

FOLDER = ROOT / "pipeline_parallel"


def test_the_folder_imports_nothing_from_outside_it():
    assert outside_imports(FOLDER) == []


# --------- Pure logic, in-process --------------------

@pytest.mark.parametrize("device, gpu_count, expected", [
    ("cuda:0", 0, "cpu"), ("cuda:1", 0, "cpu"), ("cuda:0", 1, "cuda:0"), ("cuda:1", 1, "cuda:0"),
    ("cuda:0", 2, "cuda:0"), ("cuda:1", 2, "cuda:1"), ("cuda:1", 8, "cuda:1"),
])
def test_each_shard_goes_to_the_tutorials_gpu_or_one_its_worker_has(device, gpu_count,
                                                                     expected):
    assert str(extras.choose_device(device, gpu_count)) == expected


def test_the_images_are_repeatable_and_each_class_has_its_own():
    (images, labels), = pipeline_data.class_images(1, 200, 64, seed=3)
    (again, _), = pipeline_data.class_images(1, 200, 64, seed=3)
    assert images.shape == (200, 3, 64, 64) and labels.shape == (200,)
    assert torch.equal(images, again)
    means = torch.stack([images[labels == c].mean(0) for c in range(10)]).flatten(1)
    distances = torch.cdist(means, means) + torch.eye(10) * 1e9
    assert distances.min() > 0.1 * images.flatten(1).norm(dim=1).mean()  # classes stand apart


@pytest.fixture
def pipeline_world(rpc_world):
    """The test process's RPC world, with pipeline_parallel's modules for RPC's pickles."""
    with example_modules("pipeline_parallel"):
        yield rpc_world


def test_micro_batches_give_the_model_of_the_whole_batch(pipeline_world, capsys):
    """With batch norm in eval mode (running statistics, not the micro-batch's), cutting a batch
    of 5 into 1, 2 or 5 micro-batches (of at most 5, 3 or 1 images: run_master passes the size
    that makes --num_split of them) gives the same outputs, in the batch's order."""
    torch.manual_seed(0)
    model = pipeline.DistResNet50(5, [pipeline_world, pipeline_world])
    shards = [model.p1_rref.local_value(), model.p2_rref.local_value()]
    assert f"ResNetShard1 on {pipeline_world}, {shards[0].device}" in capsys.readouterr().out
    for shard in shards:
        shard.eval()
    images = torch.randn(5, 3, 64, 64)
    with torch.no_grad():
        whole = model(images)
        assert whole.shape == (5, pipeline.num_classes)
        for split_size in (3, 1):
            model.split_size = split_size
            assert torch.allclose(model(images), whole, atol=1e-5)
    # every parameter of both shards, for DistributedOptimizer
    assert [rref.to_here() for rref in model.parameter_rrefs()] == [
        p for shard in shards for p in shard.parameters()]


def test_the_two_stages_are_main_py_s_two_shards(pipeline_world):
    """torchvision's ResNet-50 as ResNetShard1's and ResNetShard2's layers; a stage whose other
    shard is gone (None) runs its own alone, and the two in turn are the whole model."""
    rpc_model = pipeline.DistResNet50(1, [pipeline_world, pipeline_world])
    rpc_shards = [rpc_model.p1_rref.local_value(), rpc_model.p2_rref.local_value()]
    torch.manual_seed(0)
    model = pipelining.ResNet50().eval()
    images = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        whole = model(images)
        first, second = pipelining.ResNet50().eval(), pipelining.ResNet50().eval()
        first.load_state_dict(model.state_dict())
        second.load_state_dict(model.state_dict())
        first.shard2, second.shard1 = None, None
        between = first(images)
        assert between.shape == (2, 512, 8, 8)  # ResNetShard1's output at 64 x 64
        assert torch.allclose(second(between), whole)
    assert whole.shape == (2, pipeline.num_classes)
    for shard, rpc_shard in zip((model.shard1, model.shard2), rpc_shards, strict=True):
        assert [p.shape for p in shard.parameters()] == [p.shape for p in rpc_shard.parameters()]


@pytest.mark.parametrize("stage_rank, gpu_count, expected", [
    (0, 0, ("gloo", "cpu")), (1, 1, ("gloo", "cpu")),  # one GPU for two stages: NCCL refuses
    (0, 2, ("nccl", "cuda:0")), (1, 2, ("nccl", "cuda:1")), (1, 8, ("nccl", "cuda:1")),
])
def test_each_stage_has_a_gpu_of_its_own_or_none_does(stage_rank, gpu_count, expected):
    backend, device = pipelining.choose_backend_and_device(stage_rank, 2, gpu_count)
    assert (backend, str(device)) == expected


# torch minor -> whether its GPipe takes one micro-batch with two stages (measured on each, in
# an environment of its own: README.md)
GPIPE_TAKES_ONE = {"2.4.1": True, "2.5.1": True, "2.6.0": True, "2.7.1": False,
                   "2.8.0": False, "2.9.1": False, "2.10.0": False, "2.11.0": True, "2.12.1": True,
                   "2.13.0": True, "2.14.1": True, "2.15.0": True, "2.16.0.dev0": True}


@pytest.mark.parametrize("version", GPIPE_TAKES_ONE)
def test_the_fewest_micro_batches_of_each_schedule_follow_the_torch_version(version):
    assert pipelining.fewest_microbatches("1F1B", 2, version) == 2  # every torch
    assert pipelining.fewest_microbatches("GPipe", 2, version) == (
        1 if GPIPE_TAKES_ONE[version] else 2)


# --------- The command lines, in-process: each stops before it starts a rank --------------------

class Started(Exception):
    """The command got past its checks: it started ranks (mp.spawn) or one (mp.Process)."""


def run_command(monkeypatch, script, argv, env=None, gpu_count=0):
    """The script's `__main__` with this command line, in this process, with mp.spawn and
    mp.Process replaced: (status, or Started's (how, args)). torchrun's variables unset unless
    `env` sets them."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpu_count)

    def spawn(function, args, nprocs, join):
        raise Started("spawn", args[-1])

    class Process:
        def __init__(self, target, args):
            raise Started("process", args[-1])

    monkeypatch.setattr(torch.multiprocessing, "spawn", spawn)
    monkeypatch.setattr(torch.multiprocessing, "Process", Process)
    monkeypatch.setattr(sys, "argv", [script, *map(str, argv)])
    with example_modules("pipeline_parallel"):
        try:
            runpy.run_path(str(FOLDER / script), run_name="__main__")
        except SystemExit as exited:
            return exited.code
        except Started as started:
            return started.args
    raise AssertionError("the command neither exited nor started a rank")


def refused(monkeypatch, capsys, script, argv, **kwargs):
    """The one line of a command refused with status 2."""
    status = run_command(monkeypatch, script, ["--master_port", find_free_port(), *argv],
                         **kwargs)
    err = capsys.readouterr().err
    assert status == 2, (status, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("argv, expected", [
    (["--world_size", "4"], "runs 3 ranks (the master, worker1 and worker2), not --world_size 4"),
    (["--world_size", "two"], "invalid int value"),
    (["--rank", "3"], "--rank 3 is outside a world of 3"),
    (["--rank", "-1"], "--rank -1 is outside"),
    (["--master_port", "70000"], "not a port number from 1 to 65535"),
    (["--master_port", "http"], "not a port number"),
    (["--master_addr", "no-such-host.invalid"], "no such host"),
    (["--num_split", "0"], "must be at least 1"),
    (["--num_split", "1", "two"], "invalid integer"),
    (["--num_split", "64"], "more micro-batches than the 32 images"),
    (["--image_size", "32"], "must be at least 64"),
    (["--batch_size", "0"], "must be at least 1"),
    (["--lr", "-1"], "greater than 0"),
    (["--lr", "nan"], "greater than 0"),
    (["--seed", "-2"], "must be at least 0"),
    (["--num_batch", "2"], "unrecognized arguments"),  # no abbreviations
    (["--rpc_timeout", "5"], "unrecognized arguments"),  # the harness's flags are gone
    (["--summary_json", "/no/such/folder/s.json"], "--summary_json /no/such/folder/s.json: no"),
    (["--profile", "/proc/no"], "--profile /proc/no: cannot make that folder"),
])
def test_main_refuses_bad_input_in_one_line(monkeypatch, capsys, argv, expected):
    assert expected in refused(monkeypatch, capsys, "main.py", argv)


def test_a_port_in_use_is_refused_by_the_command_that_hosts_rank_0(monkeypatch, capsys):
    import socket

    with socket.create_server(("localhost", 0)) as taken:
        port = taken.getsockname()[1]
        for argv in ([], ["--rank", "0"]):
            status = run_command(monkeypatch, "main.py", ["--master_port", port, *argv])
            assert status == 2
            assert f"cannot listen on localhost:{port}" in capsys.readouterr().err
        # rank 1 does not listen: it starts, and waits for rank 0 as torch does
        how, args = run_command(monkeypatch, "main.py", ["--master_port", port, "--rank", 1])
        assert (how, args.rank) == ("process", 1)


def test_main_starts_every_rank_or_the_one_that_rank_or_torchrun_names(monkeypatch, tmp_path):
    port = str(find_free_port())
    how, args = run_command(monkeypatch, "main.py", ["--master_port", port, "--num-split", 2])
    assert (how, args.rank, args.world_size, args.num_split) == ("spawn", None, 3, [2])
    assert (args.master_addr, args.master_port, args.seed) == ("localhost", port, 1)
    how, args = run_command(monkeypatch, "main.py", ["--rank", 2, "--master_port", port])
    assert (how, args.rank) == ("process", 2)
    torchrun = {"RANK": "1", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    how, args = run_command(monkeypatch, "main.py", [], env=torchrun)
    assert (how, args.rank, args.world_size) == ("process", 1, 3)
    assert (args.master_addr, args.master_port) == ("127.0.0.1", port)


def test_torchruns_world_must_be_the_examples(monkeypatch, capsys):
    message = refused(monkeypatch, capsys, "main.py", [],
                      env={"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "29500"})
    assert "runs 3 ranks (the master, worker1 and worker2), torchrun started 2" in message


@pytest.mark.parametrize("argv, expected", [
    (["--world_size", "3"], "runs 2 ranks"),
    (["--num_split", "3"], "--num_split 3 does not divide the 32 images"),
    (["--num_split", "2", "64"], "--num_split 64 is more micro-batches than the 32 images"),
    (["--num_split", "0"], "must be at least 1"),
    (["--schedule", "1F1B", "--num_split", "1"],
     "error: --num_split 1: 1F1B takes at least 2 micro-batches (one per stage): use "
     "--num_split 2 or more\n"),
    (["--schedule", "Interleaved1F1B"], "invalid choice"),
    (["--rpc_transport", "tcp"], "unrecognized arguments"),  # no RPC here
])
def test_pipelining_refuses_bad_input_in_one_line(monkeypatch, capsys, argv, expected):
    monkeypatch.setattr(torch, "__version__", "2.15.0")
    assert expected in refused(monkeypatch, capsys, "pipelining.py", argv)


@pytest.mark.parametrize("version, gpu_count", [("2.7.1+cu126", 2), ("2.8.0", 0),
                                                ("2.10.0", 0)])  # 2.7: 1F1B with NCCL only
def test_pipelining_skips_or_refuses_one_micro_batch_where_gpipe_needs_one_per_stage(
        monkeypatch, capsys, version, gpu_count):
    """torch 2.7 to 2.10 refuse one micro-batch with two stages in every schedule: the
    README's command skips --num_split 1, saying so in one line; with nothing left to run, the
    command is refused in one line, naming what works."""
    monkeypatch.setattr(torch, "__version__", version)
    port = find_free_port()
    how, args = run_command(monkeypatch, "pipelining.py", [
        "--schedule", "GPipe", "1F1B", "--num_split", 1, 2, 4, "--master_port", port],
        gpu_count=gpu_count)
    assert how == "spawn" and args.runs == [("GPipe", 2), ("GPipe", 4), ("1F1B", 2), ("1F1B", 4)]
    assert capsys.readouterr().out.splitlines() == [
        f"--num_split 1 skipped for GPipe and 1F1B: on torch {version}, GPipe and 1F1B take at "
        "least 2 micro-batches (one per stage); GPipe runs it on torch 2.4 to 2.6 or 2.11 or "
        "later"]
    message = refused(monkeypatch, capsys, "pipelining.py", ["--num_split", 1],
                      gpu_count=gpu_count)
    assert message.endswith(
        f"error: --num_split 1: on torch {version}, GPipe and 1F1B take at least 2 "
        "micro-batches (one per stage): use --num_split 2 or more, or GPipe on torch 2.4 to 2.6 "
        "or 2.11 or later\n")


def test_pipelining_runs_one_micro_batch_with_gpipe_where_torch_takes_it(monkeypatch, capsys):
    monkeypatch.setattr(torch, "__version__", "2.15.0")
    how, args = run_command(monkeypatch, "pipelining.py", ["--master_port", find_free_port()])
    assert how == "spawn" and args.schedule == ["GPipe", "1F1B"]
    assert args.runs == [("GPipe", 1), ("GPipe", 2), ("GPipe", 4), ("GPipe", 8), ("1F1B", 2),
                         ("1F1B", 4), ("1F1B", 8)]
    assert capsys.readouterr().out == (
        "--num_split 1 skipped for 1F1B: 1F1B takes at least 2 micro-batches (one per stage)\n")


def test_pipelining_runs_gpipe_alone_where_1f1b_hangs_over_gloo(monkeypatch, capsys):
    monkeypatch.setattr(torch, "__version__", "2.6.0")
    how, args = run_command(monkeypatch, "pipelining.py", ["--master_port", find_free_port()])
    assert args.schedule == ["GPipe"] and args.runs[0] == ("GPipe", 1)
    message = refused(monkeypatch, capsys, "pipelining.py", ["--schedule", "1F1B"])
    assert "1F1B over Gloo needs torch 2.8 or later, not 2.6.0" in message
    how, args = run_command(monkeypatch, "pipelining.py", ["--master_port", find_free_port()],
                            gpu_count=2)  # NCCL runs it
    assert args.schedule == ["GPipe", "1F1B"]


@pytest.mark.parametrize("version, gpu_count, is_refused", [
    ("2.9.1", 0, True), ("2.9.1", 1, True), ("2.9.1", 2, False), ("2.8.0", 0, False),
    ("2.10.0", 0, False)])
def test_pipelining_refuses_torch_2_9_over_gloo_in_one_line(monkeypatch, capsys, version,
                                                            gpu_count, is_refused):
    """torch 2.9's schedules abort the process over Gloo at their first step (make versions
    found it): there, the command says so before any rank starts, status 2. NCCL runs."""
    monkeypatch.setattr(torch, "__version__", version)
    argv = ["--num_split", 2]
    if not is_refused:
        how, _ = run_command(monkeypatch, "pipelining.py",
                             ["--master_port", find_free_port(), *argv], gpu_count=gpu_count)
        assert how == "spawn"
        return
    message = refused(monkeypatch, capsys, "pipelining.py", argv, gpu_count=gpu_count)
    assert f"cannot run over Gloo on torch {version}" in message and "2.10" in message


# --------- Whole runs, from the folder copied alone, on plain torch --------------------

def read_summary(path):
    return json.loads(path.read_text()) if path.exists() else None


@pytest.fixture(scope="module")
def copied(tmp_path_factory):
    """The folder, copied alone: its runs use a Python that cannot import rpc_harness."""
    return copy_example("pipeline_parallel", tmp_path_factory.mktemp("alone") / "copy")


def start_alone(runs, copied, script, *flags):
    """The plain command, from the copied folder. One thread a rank, as rpcrun gives each of 2
    or 3 ranks on 2 cores: torch's default (every core, each rank) slowed a step tenfold."""
    return runs.start_command([*ALONE, script, *map(str, flags)], cwd=copied,
                              env={"OMP_NUM_THREADS": "1"})


# The README's short run that learns: 16 images of 64 x 64 a batch, 12 batches, at the learning
# rate that falls steadily at that size (2.3 -> 1.0-1.5; at the tutorial's 0.05 it rose again).
SHORT = ("--num_split", 2, "--batch_size", 16, "--lr", 0.02, "--num_batches", 12)


@pytest.fixture(scope="module")
def spawn_all(copied, tmp_path_factory):
    """main.py, every rank from one command, 2 micro-batches a batch, profiled."""
    folder = tmp_path_factory.mktemp("pipeline")
    runs = Runs(folder / "logs")
    run = start_alone(runs, copied, "main.py", *SHORT, "--master_port", find_free_port(),
                      "--summary_json", folder / "summary.json", "--profile", folder / "trace")
    try:
        run.wait(timeout=300)
        assert not run.leftovers()
    finally:
        run.kill_session()
    run.trace = folder / "trace"
    return run, read_summary(folder / "summary.json")


def test_spawn_all_runs_the_tutorials_loop(spawn_all):
    run, summary = spawn_all
    assert run.returncode == 0, run.output
    assert re.findall(r"^Processing batch (\d+)$", run.stdout, re.M) == [str(i) for i in
                                                                      range(12)]
    assert re.search(r"^number of splits = 2, execution time = \d+\.\d+$", run.stdout, re.M)
    assert set(summary["splits"]) == {"2"} and summary["splits"]["2"]["seconds_per_batch"] > 0
    assert set(summary["peak_memory_mb"]) == {"master", "worker1", "worker2"}
    assert summary["wall_seconds"] > 0
    assert re.search(r"^Summary: num_split 2: \d+\.\d+ s a batch, loss .*; \d+\.\d s in all$",
                     run.stdout, re.M)
    on_gpu = torch.cuda.is_available()  # test_gpu.py checks where the shards go on a GPU
    assert f"ResNetShard1 on worker1, {'cuda:0' if on_gpu else 'cpu'}" in run.stdout
    assert "Warning" not in run.stderr, run.stderr  # the RPC stack's known warnings left out


def test_spawn_all_learned(spawn_all):
    run, _ = spawn_all
    losses = [float(loss) for loss in re.findall(r"^num_split 2, batch \d+: loss (\S+),",
                                                  run.stdout, re.M)]
    assert len(losses) == 12
    assert sum(losses[-3:]) / 3 < 0.8 * losses[0], losses  # 2.3 is guessing 1 of 10


def test_the_profiled_timeline_shows_both_shards_forward(spawn_all):
    """--profile: a trace per rank, and each shard's convolutions inside the master's steps."""
    run, _ = spawn_all
    for shard in ("worker1", "worker2"):
        check_timeline([run], run.trace, ["master", "worker1", "worker2"], shard,
                       {"aten::conv2d", "aten::convolution"})


# The README's short run of pipelining.py that learns, for one schedule: 1F1B, or GPipe where
# this torch cannot run 1F1B (make versions runs both, on every torch)
SCHEDULE = "1F1B" if pipelining.one_f_one_b_works(torch.cuda.device_count()) else "GPipe"
PIPELINING_SHORT = ("--num_split", 2, "--batch_size", 16, "--lr", 0.02, "--num_batches", 10,
                    "--schedule", SCHEDULE)


@pytest.fixture(scope="module")
def pipelining_run(copied, tmp_path_factory):
    """pipelining.py, both stages from one command, from the copied folder: 2 micro-batches,
    profiled."""
    folder = tmp_path_factory.mktemp("pipelining")
    runs = Runs(folder / "logs")
    run = start_alone(runs, copied, "pipelining.py", *PIPELINING_SHORT, "--master_port",
                      find_free_port(), "--summary_json", folder / "summary.json",
                      "--profile", folder / "trace")
    try:
        run.wait(timeout=300)
        assert not run.leftovers()
    finally:
        run.kill_session()
    run.trace = folder / "trace"
    return run, read_summary(folder / "summary.json")


def test_pipelining_learned(pipelining_run):
    run, summary = pipelining_run
    assert run.returncode == 0, run.output
    assert list(summary["schedules"]) == [SCHEDULE]
    losses = [float(loss) for loss in re.findall(
        rf"^{SCHEDULE}, n_microbatches 2, batch \d+: loss (\S+),", run.stdout, re.M)]
    assert len(losses) == 10
    assert sum(losses[-3:]) / 3 < 0.8 * losses[0], losses  # 2.3 is guessing 1 of 10
    figures = summary["schedules"][SCHEDULE]["2"]
    assert figures["first_loss"] == pytest.approx(losses[0], abs=1e-4)
    assert figures["seconds_per_batch"] > 0
    assert set(summary["peak_memory_mb"]) == {"stage0", "stage1"}
    assert all(memory["rss"] > 100 for memory in summary["peak_memory_mb"].values())
    on_gpu = torch.cuda.device_count() >= 2
    assert f"stage 1 of 2 on {'cuda:1' if on_gpu else 'cpu'}" in run.stdout
    assert re.search(rf"^Summary: {SCHEDULE} 2: \d+\.\d+ s a batch, loss .*; \d+\.\d s in all$",
                     run.stdout, re.M), run.stdout


def test_pipelining_profiled_timeline_shows_both_stages_compute(pipelining_run):
    run, _ = pipelining_run
    for stage in ("stage0", "stage1"):
        check_timeline([run], run.trace, ["stage0", "stage1"], stage,
                       {"aten::conv2d", "aten::convolution"})
