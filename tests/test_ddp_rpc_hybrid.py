import json
import random
import re

import pytest
import torch
from conftest import (
    TCP,
    check_timeline,
    find_free_port,
    load_example,
    run_example,
)

hybrid = load_example("ddp_rpc_hybrid")  # main.py: the tutorial's 2020 revision
extras = load_example("ddp_rpc_hybrid", "extras")  # what main.py and remote_module.py add


# --------- Pure logic, in-process --------------------

@pytest.mark.parametrize("trainer_rank, num_trainers, gpu_count, expected", [
    (0, 2, 0, ("gloo", "cpu")),
    (1, 2, 0, ("gloo", "cpu")),
    (1, 2, 1, ("gloo", "cpu")),  # one trainer without a GPU: nobody uses NCCL
    (0, 2, 2, ("nccl", "cuda:0")),
    (1, 2, 2, ("nccl", "cuda:1")),
    (0, 1, 1, ("nccl", "cuda:0")),
    (2, 3, 8, ("nccl", "cuda:2")),
])
def test_backend_and_device_follow_the_tutorial(trainer_rank, num_trainers, gpu_count, expected):
    backend, device = extras.choose_backend_and_device(trainer_rank, num_trainers, gpu_count)
    assert (backend, str(device)) == expected


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
    from a random.Random of the same seed (remote_module.py's batches), in the same order."""
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


# --------- Command line, in-process --------------------

def bad_input_message(capsys, argv):
    with pytest.raises(SystemExit) as exited:
        extras.parse_args(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    return err


@pytest.mark.parametrize("argv, expected", [
    (["--world_size", "2"], "must be at least 3"),
    (["--world_size", "four"], "invalid integer"),
    (["--rank", "4"], "outside a world of 4"),
    (["--world_size", "3", "--rank", "3"], "outside a world of 3"),
    (["--rank", "-1"], "must be at least 0"),
    (["--epochs", "0"], "must be at least 1"),
    (["--batches_per_epoch", "-2"], "must be at least 1"),
    (["--seed", "-1"], "must be at least 0"),
    (["--init_timeout", "0"], "greater than 0"),
    (["--master_port", "0"], "from 1 to 65535"),
    (["--master_port", "65536"], "from 1 to 65535"),
])
def test_bad_input_is_one_line_and_status_2(capsys, argv, expected):
    assert expected in bad_input_message(capsys, argv)


def test_torchrun_with_too_few_processes_is_one_line(capsys, monkeypatch):
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", str(find_free_port()))):
        monkeypatch.setenv(name, value)
    assert "torchrun started 2 processes: the world size must be at least 3" in (
        bad_input_message(capsys, []))


def test_hyphenated_flags_and_torchrun_environment(monkeypatch):
    for name, value in (("RANK", "3"), ("WORLD_SIZE", "5"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", "29999")):
        monkeypatch.setenv(name, value)
    args = extras.parse_args(["--batches-per-epoch", "4", "--world-size", "9"])
    assert (args.rank, args.world_size, args.master_port, args.batches_per_epoch) == (3, 5,
                                                                                      29999, 4)
    assert args.torchrun and extras.worker_name(3, args.world_size) == "master"


def test_help_shows_every_default(capsys):
    with pytest.raises(SystemExit) as exited:
        extras.parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert exited.value.code == 0
    for flag in ("--world_size", "--master_port", "--epochs", "--batches_per_epoch", "--seed",
                 "--summary_json", "--init_timeout", "--rpc_timeout"):
        assert flag in out
    assert "(default: 4)" in out and "(default: 100)" in out and "(default: 29500)" in out


# --------- Whole runs --------------------

def epoch_losses(output, trainer):
    """Each epoch's mean loss, from the trainer's line that follows the tutorial's."""
    return [float(loss) for loss in re.findall(rf"^{trainer}: epoch \d+ loss (\S+)$", output,
                                               re.M)]


def tutorial_lines(output):
    return re.findall(r"^Training done for epoch (\d+)$", output, re.M)


# The tutorial's two revisions: 2020 (main.py) and 2021 (remote_module.py).
REVISIONS = {"emb_rref": "main.py", "remote_module": "remote_module.py"}
PROFILED = "emb_rref"  # the run of the two that also writes --profile's traces


@pytest.fixture(scope="module")
def spawn_all_runs(tmp_path_factory):
    """spawn_all_runs(revision): its spawn-all run (two trainers, the master, ps), made when a
    test first asks for it; (the run, its summary)."""
    tmp, done = tmp_path_factory.mktemp("ddp"), {}

    def spawn_all(name):
        if name not in done:
            summary = tmp / f"{name}.json"
            run = run_example("ddp_rpc_hybrid", "--epochs", 10, *TCP, "--master_port",
                              find_free_port(), "--summary_json", summary,
                              *(("--profile", tmp / "trace") if name == PROFILED else ()),
                              timeout=150, log_dir=tmp, script=REVISIONS[name])
            done[name] = run, json.loads(summary.read_text()) if summary.exists() else None
        return done[name]
    return spawn_all


def test_the_profiled_timeline_shows_the_ps_embedding_bag(spawn_all_runs):
    """--profile: a track per rank (the trainers, the master, the ps), and the ps's EmbeddingBag
    looking up the bags of the trainers' steps."""
    run, _ = spawn_all_runs(PROFILED)
    check_timeline([run], run.log_dir / "trace", ["trainer0", "trainer1", "master", "ps"], "ps",
                   {"aten::embedding_bag", "aten::_embedding_bag"})


# The 2021 revision's run is in the whole suite only: the quick one runs each tutorial's main.py
# end to end, within its time.
@pytest.fixture(params=[PROFILED, pytest.param("remote_module", marks=pytest.mark.slow)])
def two_trainers(spawn_all_runs, request):
    return spawn_all_runs(request.param)


def test_spawn_all_trains_both_trainers(two_trainers):
    run, summary = two_trainers
    assert run.returncode == 0, run.output
    assert summary["remote_module"] == run.cmd[1].endswith("remote_module.py")
    for trainer in ("trainer0", "trainer1"):
        assert len(epoch_losses(run.stdout, trainer)) == 10
    assert sorted(tutorial_lines(run.stdout), key=int) == [str(e) for e in range(10) for _ in "01"]
    # NCCL only when every trainer has a GPU of its own (the gpu tests run that).
    assert summary["trainers"] == 2
    assert summary["backend"] == ("nccl" if torch.cuda.device_count() >= 2 else "gloo")
    assert summary["iterations_per_trainer"] == {"trainer0": 100, "trainer1": 100}
    assert summary["wall_seconds"] > 0


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
    # seen failing once in five quick suites (2026-11-25, not reproduced since): the output says why
    assert "Dense layer weights identical on trainer0, trainer1: yes" in run.stdout, run.output
    assert "Embedding table on ps changed: yes" in run.stdout, run.output
    assert summary["dense_weights_identical"] is True
    assert summary["embedding_table_changed"] is True
    assert summary["embedding_table_max_change"] > 0.01


@pytest.mark.slow
def test_ranks_as_separate_commands_highest_rank_first(tmp_path, runs):
    """main.py, a rank a command, the last rank first (remote_module.py's way, which is the
    same: tests/test_launch_modes.py, which make test-oldest runs, and make faults)."""
    common = ["--world_size", 3, "--master_port", find_free_port(), "--epochs", 3, *TCP]
    ps = runs.start("ddp_rpc_hybrid", *common, "--rank", 2)
    master = runs.start("ddp_rpc_hybrid", *common, "--rank", 1)
    trainer = runs.start("ddp_rpc_hybrid", *common, "--rank", 0, "--summary_json",
                         tmp_path / "summary.json")
    for run in (trainer, master, ps):
        run.wait(timeout=120)
        assert run.returncode == 0, run.output
        assert not run.leftovers()
    assert len(epoch_losses(trainer.stdout, "trainer0")) == 3
    assert "Embedding table on ps changed: yes" in trainer.stdout  # rank 0 sums the run up
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 3 and summary["iterations_per_trainer"] == {"trainer0": 30}
    assert summary["dense_weights_identical"] and summary["embedding_table_changed"]
