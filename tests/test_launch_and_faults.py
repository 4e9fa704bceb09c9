"""Launch modes and failure behaviour, the same checks for every example: torchrun, several
hosts (network namespaces), a rank killed mid-run, a rank that never comes, bad input, and local
runs listening on loopback only. Everything that starts processes is marked slow."""

import io
import ipaddress
import json
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import (
    ROOT,
    _processes,
    example_command,
    find_free_port,
    load_example,
    profile_all_threads,
)

# How long the other ranks may take to exit after one is killed. Measured: about 1-2 s when
# the machine is idle (a dead peer's connections close at once and the heartbeat runs every
# second); the bound leaves room for a loaded 2-core CI machine. README.md documents it.
EXIT_BOUND_SECONDS = 20


@dataclass
class Example:
    name: str
    world_size: int  # the smallest world that has every role
    quick: list  # flags for a short complete run
    endless: list  # flags for a run that lasts until it is killed
    roles: dict  # rank -> worker name, one rank per role
    working: str  # a line that shows the run is under way
    bad_inputs: list = field(default_factory=list)  # (flags, expected text), example-specific


EXAMPLES = {
    "param_server": Example(
        name="param_server", world_size=2,
        quick=["--dataset", "synthetic", "--max_batches", 5],
        endless=["--dataset", "synthetic", "--epochs", 1000],
        roles={0: "parameter_server", 1: "trainer_1"},
        working=r"^Rank 1 training batch",
        bad_inputs=[(["--num_gpus", "3"], "must be 0, 1 or 2"),
                    (["--data_dir", "/nonexistent"], "no such folder")]),
    "rl_cartpole": Example(
        name="rl_cartpole", world_size=2,
        quick=["--max_episodes", 5],
        endless=["--max_episodes", 100000, "--log_interval", 1],
        roles={0: "agent", 1: "observer1"},
        working=r"^Episode 1\t",
        bad_inputs=[(["--gamma", "1.5"], "from 0 to 1"),
                    (["--max_episodes", "0"], "must be at least 1")]),
    "rnn_model_parallel": Example(
        name="rnn_model_parallel", world_size=2,
        quick=["--epochs", 1, "--max_batches", 20],
        endless=["--epochs", 100000],
        roles={0: "ps", 1: "trainer"},
        working=r"^Training epoch 0",
        bad_inputs=[(["--corpus", "/nonexistent/corpus.txt"], "cannot read it"),
                    (["--dropout", "1.5"], "--dropout")]),
    "ddp_rpc_hybrid": Example(
        name="ddp_rpc_hybrid", world_size=3,
        quick=["--epochs", 2],
        endless=["--epochs", 100000],
        roles={0: "trainer0", 1: "master", 2: "ps"},
        working=r"^Training done for epoch",
        bad_inputs=[(["--world_size", "2"], "must be at least 3"),
                    (["--epochs", "0"], "must be at least 1")]),
    "pipeline_parallel": Example(
        name="pipeline_parallel", world_size=3,
        quick=["--num_split", 2, "--num_batches", 2, "--batch_size", 4],
        endless=["--num_split", 2, "--num_batches", 100000, "--batch_size", 4],
        roles={0: "master", 1: "worker1"},
        working=r"^Processing batch 1$",
        bad_inputs=[(["--world_size", "4"], "runs 3 ranks"),
                    (["--num_split", "5"], "more micro-batches than the 4 images")]),
    "rpc_profiling": Example(
        name="rpc_profiling", world_size=2,
        quick=["--profile", Path(tempfile.gettempdir()) / "rpc_profiling_tests"],
        endless=[],  # the recipe's run is short: no kill test waits for it
        roles={0: "worker0", 1: "worker1"},
        working=r"successfully initialized RPC",
        bad_inputs=[(["--profile", "/dev/null"], "a file is there")]),
}


# --------- Bad input, in-process: every example, every case --------------------

GENERIC_BAD_INPUTS = [
    (["--world_size", "1"], "must be at least"),
    (["--world_size", "x"], "invalid integer"),
    (["--rank", "-1"], "must be at least 0"),
    (["--rank", "64"], "outside a world of"),
    (["--seed", "-3"], "must be at least 0"),
    (["--master_port", "0"], "from 1 to 65535"),
    (["--master_port", "99999"], "from 1 to 65535"),
    (["--master_port", "http"], "invalid port"),
    (["--init_timeout", "-5"], "greater than 0"),
    (["--rpc_timeout", "nan"], "greater than 0"),
    (["--world", "3"], "unrecognized arguments: --world 3"),  # no abbreviations
    (["--master_addr", "a..b"], "--master_addr a..b: no such host"),
    (["--profile", str(Path(__file__))], "a file is there; give a folder"),
]
BAD_INPUT_CASES = [(name, flags, text) for name in EXAMPLES
                   for flags, text in GENERIC_BAD_INPUTS + EXAMPLES[name].bad_inputs]


def _child_processes():
    return _processes(lambda stat: stat[1] == os.getpid())


@pytest.mark.parametrize("example, flags, expected", BAD_INPUT_CASES,
                         ids=[f"{n}:{' '.join(f)}" for n, f, _ in BAD_INPUT_CASES])
def test_bad_input_exits_2_with_one_line_and_starts_nothing(capsys, example, flags, expected):
    module = load_example(example)
    before = _child_processes()
    with pytest.raises(SystemExit) as exited:
        module.main([*map(str, EXAMPLES[example].quick), *flags])
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert expected in err
    assert not multiprocessing.active_children() and _child_processes() == before


@pytest.mark.parametrize("example", EXAMPLES)
def test_busy_port_is_one_line_naming_it(capsys, example):
    import socket

    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit) as exited:
            load_example(example).main([*map(str, EXAMPLES[example].quick),
                                        "--master_port", str(port)])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and len(err.strip().splitlines()) == 1
    assert f":{port}" in err and "--master_port" in err


@pytest.mark.slow
def test_bad_input_on_the_real_command_line(runs):
    started = {example: runs.start(example, *config.quick, "--world_size", "1")
               for example, config in EXAMPLES.items()}  # at once: each spends its time importing
    for example, run in started.items():
        run.wait(timeout=60)
        assert run.returncode == 2 and run.stdout == "", example
        assert len(run.stderr.strip().splitlines()) == 1 and "must be at least" in run.stderr
        assert not run.leftovers(grace=0)


def test_every_example_that_loops_marks_its_steps_for_profile():
    """--profile's window counts the steps of the ranks that loop: every example but the
    recipe's own (rpc_profiling profiles itself) calls profile_step() in its loops."""
    for example in EXAMPLES:
        sources = " ".join(path.read_text() for path in (ROOT / example).glob("*.py")
                           if path.name != "launch.py")
        assert ("launch.profile_step()" in sources) == (example != "rpc_profiling"), example
        assert ("steps=lambda" in sources) == (example != "rpc_profiling"), example


def test_the_merge_command_makes_the_timeline_of_a_folder_of_traces(tmp_path):
    """`python profiling.py FOLDER`, which a rank 0 that cannot read the others' traces names:
    one timeline of the traces in the folder, a track per rank in rank order."""
    for rank, name in ((1, "trainer_1"), (0, "parameter_server")):
        (tmp_path / f"{name}.json").write_text(json.dumps({
            "rank": rank, "rankName": name, "baseTimeNanoseconds": 10**9, "traceEvents": [
                {"ph": "M", "name": "process_labels", "pid": 7 + rank, "args": {"labels": "CPU"}},
                {"ph": "X", "name": "aten::mm", "pid": 7 + rank, "tid": 1, "ts": 5, "dur": 1}]}))
    (tmp_path / "other.json").write_text("{}")  # not a trace of ours: left out
    done = subprocess.run([sys.executable, ROOT / "param_server" / "profiling.py", tmp_path],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "wrote the timeline of 2 ranks" in done.stdout
    events = json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
    tracks = sorted((e["pid"], e["args"]["name"]) for e in events if e["name"] == "process_name")
    assert [name for _, name in tracks] == ["parameter_server", "trainer_1"]


# --------- Loopback only --------------------

def _listening_sockets():
    """{socket inode: 'address:port'} for every listening TCP socket in this network namespace."""
    listening = {}
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        if not Path(table).exists():
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":  # TCP_LISTEN
                continue
            hex_addr, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_addr)
            # /proc shows addresses as 32-bit words in host (little-endian) order.
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))
            listening[fields[9]] = (ipaddress.ip_address(raw), int(hex_port, 16))
    return listening


def _sockets_of(pid):
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def assert_listening_on_loopback_only(run, world_size):
    """Every listening socket of a run's processes is on a loopback address."""
    listening = _listening_sockets()
    pids = _processes(lambda stat: stat[2] == run.proc.pid)
    ours = {listening[inode] for pid in pids for inode in _sockets_of(pid) if inode in listening}
    assert len(ours) >= world_size  # the rendezvous, plus each rank's own listeners
    assert all(address.is_loopback for address, _ in ours), sorted(map(str, ours))


# --------- torchrun --------------------

# launch.py is the same everywhere; these two examples add what differs under torchrun and
# across hosts: a heavy rank's threads (param_server) and a process group beside RPC (ddp).
LAUNCH_EXAMPLES = ("param_server", "ddp_rpc_hybrid")


@pytest.mark.slow
@pytest.mark.parametrize("example", LAUNCH_EXAMPLES)
def test_torchrun_runs_every_rank(example, runs, tmp_path):
    config = EXAMPLES[example]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                str(config.world_size), "--master_port", str(find_free_port())]
    script = example_command(example, *config.quick, "--summary_json", tmp_path / "summary.json")
    run = runs.start_command([*torchrun, *script[1:]]).wait(timeout=120)
    assert run.returncode == 0, run.output
    assert (tmp_path / "summary.json").exists()
    assert not run.leftovers()


# --------- A rank killed mid-run --------------------

# Modes of an example that have roles of their own, killed like the examples above.
VARIANTS = {
    "param_server --batch": Example(
        name="param_server", world_size=3,
        quick=["--batch", "--dataset", "synthetic", "--max_batches", 5],
        endless=["--batch", "--dataset", "synthetic", "--epochs", 1000],
        roles={0: "ps", 1: "trainer1"},
        working=r"^Rank 1 training batch"),
    "ddp_rpc_hybrid --remote_module": Example(
        name="ddp_rpc_hybrid", world_size=3,
        quick=["--remote_module", "--epochs", 2],
        endless=["--remote_module", "--epochs", 100000],
        roles={0: "trainer0", 1: "master", 2: "ps"},
        working=r"^Training done for epoch"),
}

# The ranks killed, one run each: a rank of every kind of waiting there is, as the others notice
# a lost peer in their own code: trainers in RPC calls (param_server), waiting for a model that
# needs the dead trainer's gradients (--batch), the agent waiting for an episode (rl_cartpole),
# the parameter server in its heartbeat (rnn_model_parallel), trainers in an allreduce and the
# master waiting for their loops (ddp_rpc_hybrid), ps holding the RemoteModule of the 2021
# revision (--remote_module), the master waiting for micro-batches (pipeline_parallel). Under
# spawn-all the launcher stops every rank alike, whichever died: two examples, the second with
# the process group of the trainers. The others' roles were all killed in turn before this list
# was cut to keep the slow tests short.
KILLED = {**EXAMPLES, **VARIANTS}
KILL_CASES = [("param_server", 1, "per-rank"), ("param_server --batch", 1, "per-rank"),
              ("rl_cartpole", 1, "per-rank"), ("rnn_model_parallel", 1, "per-rank"),
              ("ddp_rpc_hybrid", 0, "per-rank"), ("ddp_rpc_hybrid", 1, "per-rank"),
              ("ddp_rpc_hybrid --remote_module", 2, "per-rank"),
              ("pipeline_parallel", 1, "per-rank"),
              ("rl_cartpole", 1, "spawn-all"), ("ddp_rpc_hybrid", 2, "spawn-all")]


@pytest.mark.slow
@pytest.mark.parametrize("example, victim, mode", KILL_CASES,
                         ids=[f"{n}-{KILLED[n].roles[r]}-{m}" for n, r, m in KILL_CASES])
def test_killed_rank_stops_every_other_rank(example, victim, mode, runs):
    """SIGKILL one rank mid-run: every other process exits non-zero within the bound, naming
    the lost peer, and nothing is left running. Spawn-all runs also check loopback only."""
    config = KILLED[example]
    example = config.name
    common = [*config.endless, "--world_size", config.world_size,
              "--master_port", find_free_port()]
    if mode == "spawn-all":
        launcher = runs.start(example, *common)
        launcher.wait_for_output(config.working, timeout=90)
        # While a local run is under way, nothing of it may be reachable from the network.
        assert_listening_on_loopback_only(launcher, config.world_size)
        ranks = launcher.children()
        assert len(ranks) == config.world_size
        survivors = [launcher]
        victim_pid = ranks[victim]
    else:
        processes = [runs.start(example, *common, "--rank", rank)
                     for rank in range(config.world_size)]
        _wait_any(processes, config.working)
        survivors = [p for rank, p in enumerate(processes) if rank != victim]
        victim_pid = processes[victim].proc.pid

    killed_at = time.monotonic()
    os.kill(victim_pid, signal.SIGKILL)
    for survivor in survivors:
        survivor.wait(timeout=EXIT_BOUND_SECONDS + 30)
        took = time.monotonic() - killed_at
        assert survivor.returncode != 0, survivor.output
        assert took < EXIT_BOUND_SECONDS, f"exited {took:.1f} s after the kill"
        assert not survivor.leftovers()
        # the lost peer in one line: none of torch's C++ warnings or traces about it
        assert not re.search(r"^\[W|frame #|Traceback", survivor.stderr, re.M), survivor.stderr
    victim_name = config.roles[victim]
    if mode == "spawn-all":
        assert f"{victim_name} (rank {victim}) was killed by SIGKILL" in survivors[0].stderr, \
            survivors[0].stderr[-2000:]
    else:
        for survivor in survivors:
            assert re.search(rf"lost contact with [^(]*\b{victim_name}\b", survivor.stderr), \
                survivor.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["per-rank", "spawn-all"])
def test_a_rank_killed_while_profiling_loses_only_its_own_trace(mode, runs, tmp_path):
    """--profile with the windows open for the whole run: SIGKILL trainer_2, and the parameter
    server and trainer_1, which end as above (lost peer, or stopped by the launcher), first
    write what their profilers hold, whole (where this torch lets another thread stop the
    profiler)."""
    traces = tmp_path / "traces"
    common = ["--dataset", "synthetic", "--epochs", 1000, "--world_size", 3, "--log_interval", 5,
              "--profile", traces, "--profile_steps", 100000, "--master_port", find_free_port()]
    windows_open = r"^Rank 2 training batch 5 "  # the trainers' windows open after 2 steps
    if mode == "spawn-all":
        launcher = runs.start("param_server", *common)
        launcher.wait_for_output(windows_open, timeout=90)
        survivors, victim_pid = [launcher], launcher.children()[2]
    else:
        processes = [runs.start("param_server", *common, "--rank", rank) for rank in range(3)]
        _wait_any(processes, windows_open)
        survivors, victim_pid = processes[:2], processes[2].proc.pid
    os.kill(victim_pid, signal.SIGKILL)
    for survivor in survivors:
        survivor.wait(timeout=EXIT_BOUND_SECONDS + 30)
        assert survivor.returncode != 0 and not survivor.leftovers()
    if not profile_all_threads():
        assert not list(traces.glob("*.json"))
        pytest.skip("a rank that stops early writes its trace from a thread of its own (bounded "
                    "in time); this torch's profiler can be stopped only by the thread that "
                    "started it")
    for name in ("parameter_server", "trainer_1"):
        path = traces / f"{name}.json"
        assert path.exists(), "".join(survivor.output for survivor in survivors)
        assert json.loads(path.read_text())["rankName"] == name
    assert sorted(path.name for path in traces.iterdir()) == ["parameter_server.json",
                                                              "trainer_1.json"]  # no parts


@pytest.mark.slow
def test_killed_launcher_takes_its_ranks_with_it(runs):
    """SIGKILL the command that started every rank: the ranks end too, instead of running on
    unseen. One example: launch.py is the same in all (test_every_folder_has_the_same_launch_py)."""
    config = EXAMPLES["rnn_model_parallel"]
    launcher = runs.start(config.name, *config.endless, "--world_size", config.world_size,
                          "--master_port", find_free_port())
    launcher.wait_for_output(config.working, timeout=90)
    assert len(launcher.children()) == config.world_size
    os.kill(launcher.proc.pid, signal.SIGKILL)
    launcher.proc.wait(timeout=10)
    assert not launcher.leftovers(grace=EXIT_BOUND_SECONDS)


def _wait_any(processes, pattern, timeout=90):
    deadline = time.monotonic() + timeout
    while not any(re.search(pattern, p.output, re.M) for p in processes):
        assert time.monotonic() < deadline, "the run never got under way"
        time.sleep(0.05)


# --------- A rank that never comes --------------------

@pytest.mark.slow
def test_missing_rank_ends_the_others_after_init_timeout(runs):
    """Rank 0 (which hosts the rendezvous) alone, and the last rank alone, for an example that
    only joins RPC and for one whose trainers first meet in a process group: four runs at once,
    on ports of their own (they spend their time importing, then waiting)."""
    alone = [(example, runs.start(example, *EXAMPLES[example].quick, "--world_size",
                                  EXAMPLES[example].world_size, "--master_port", find_free_port(),
                                  "--rank", rank, "--init_timeout", 2))
             for example in LAUNCH_EXAMPLES for rank in (0, EXAMPLES[example].world_size - 1)]
    for (example, run), missing in zip(alone, ("trainer_1 (rank 1)", "parameter_server (rank 0)",
                                               "master (rank 1), ps (rank 2)",
                                               "trainer0 (rank 0)"), strict=True):
        run.wait(timeout=90)
        assert run.returncode == 1, (example, run.output)
        assert run.stderr.count("\n") == 1 and missing in run.stderr, (example, run.stderr)
        assert "within 2 s (--init_timeout)" in run.stderr, (example, run.stderr)
        assert not run.leftovers()


# --------- One terminal per rank: waiting, interrupting, flags that differ --------------------

WAITING = r"^\S+ \(rank \d+ of \d+\): waiting for the other ranks at localhost:\d+, up to 60 s$"


@pytest.mark.slow
def test_a_waiting_rank_ends_at_once_on_ctrl_c_or_sigterm(runs):
    """A rank alone, waiting for the others (rank 0, which hosts the rendezvous, and a rank that
    waits to reach it), ends within 2 s of SIGINT (Ctrl-C) or SIGTERM with one line."""
    cases = [("param_server", 0, signal.SIGINT, "parameter_server"),
             ("rl_cartpole", 1, signal.SIGINT, "observer1"),
             ("ddp_rpc_hybrid", 2, signal.SIGTERM, "ps")]
    started = [runs.start(example, *EXAMPLES[example].quick, "--rank", rank,
                          "--world_size", EXAMPLES[example].world_size,
                          "--master_port", find_free_port())
               for example, rank, _, _ in cases]
    for run, (_, _, number, name) in zip(started, cases, strict=True):
        run.wait_for_output(WAITING, timeout=90)
        time.sleep(0.5)  # well into the wait, not at its first step
        sent = time.monotonic()
        run.proc.send_signal(number)
        run.wait(timeout=30)
        assert time.monotonic() - sent < 2, run.output
        assert run.returncode == 128 + number
        suffix = "" if number == signal.SIGINT else " (SIGTERM)"
        assert run.stderr == f"{name}: interrupted{suffix}\n", run.stderr
        assert not run.leftovers(grace=0)


@pytest.mark.slow
def test_ctrl_c_mid_run(runs):
    """Ctrl-C mid-run: to one rank in its terminal (ddp_rpc_hybrid's master, which waits in
    torch's C++ code for the trainers' whole loops), and to every process of a spawn-all run,
    as a terminal sends it."""
    config = EXAMPLES["ddp_rpc_hybrid"]
    common = [*config.endless, "--world_size", config.world_size,
              "--master_port", find_free_port()]
    ranks = [runs.start(config.name, *common, "--rank", rank) for rank in range(3)]
    spawn_all = runs.start("rl_cartpole", *EXAMPLES["rl_cartpole"].endless,
                           "--master_port", find_free_port())
    _wait_any(ranks, config.working)
    spawn_all.wait_for_output(EXAMPLES["rl_cartpole"].working, timeout=90)
    sent = time.monotonic()
    ranks[1].proc.send_signal(signal.SIGINT)
    os.killpg(spawn_all.proc.pid, signal.SIGINT)
    for run in (ranks[1], spawn_all):
        run.wait(timeout=30)
        assert time.monotonic() - sent < 2 and run.returncode == 130, run.output
    assert ranks[1].stderr == "master: interrupted\n", ranks[1].stderr
    assert spawn_all.stderr == "interrupted; stopped every rank\n", spawn_all.stderr
    for survivor in (ranks[0], ranks[2]):
        survivor.wait(timeout=EXIT_BOUND_SECONDS + 30)
        assert survivor.returncode == 1 and "lost contact with" in survivor.stderr
    for run in runs:
        assert not run.leftovers()


# Ranks started with flags that differ: (example, each rank's own flags, the flag named).
DIFFERENT_FLAGS = [
    ("ddp_rpc_hybrid", [["--world_size", 3, "--epochs", 3], ["--world_size", 3],
                        ["--world_size", 3]],
     "--epochs is 3 on rank 0 (trainer0) but 100 on rank "),
    ("rl_cartpole", [[], ["--batch", "--max_episodes", 5]], "--batch is not set on rank 0 (agent) "
                                                            "but set on rank 1 (observer1)"),
    ("rl_cartpole", [["--world_size", 2], ["--world_size", 3], ["--world_size", 3]],
     "--world_size is 2 on rank 0 (agent) but 3 on rank "),
]


@pytest.mark.slow
def test_ranks_with_different_flags_all_end_naming_the_flag(runs):
    """Every rank ends within 20 s of the last one's start, with one line that names the flag
    and both values, and status 2; world sizes that differ included."""
    started = []
    for example, flags, expected in DIFFERENT_FLAGS:
        port = find_free_port()
        started.append((expected, [runs.start(example, *own, "--rank", rank,
                                              "--master_port", port)
                                   for rank, own in enumerate(flags)]))
    for expected, ranks in started:
        for run in ranks:
            run.wait_for_output(WAITING, timeout=90)
        everyone_started = time.monotonic()
        for run in ranks:
            run.wait(timeout=60)
            took = time.monotonic() - everyone_started
            assert took < 20, (took, run.output)
            assert run.returncode == 2, run.output
            assert run.stderr.count("\n") == 1 and expected in run.stderr, run.stderr
            assert "start every rank with the same values" in run.stderr
            assert not run.leftovers(grace=0)


@pytest.mark.slow
def test_a_rank_started_twice_is_told_it_is_taken(runs):
    port = find_free_port()
    common = ["--world_size", 2, "--master_port", port, *EXAMPLES["rl_cartpole"].quick]
    agent = runs.start("rl_cartpole", *common, "--rank", 0)
    first = runs.start("rl_cartpole", *common, "--rank", 1)
    first.wait_for_output(r"^observer1: joined", timeout=90)
    second = runs.start("rl_cartpole", *common, "--rank", 1).wait(timeout=60)
    assert second.returncode == 2
    assert re.fullmatch(r"observer1: rank 1 is taken: process \d+ on \S+ joined as rank 1 first; "
                        r"give every rank its own --rank\n", second.stderr), second.stderr
    for run in (agent, first):
        run.wait(timeout=60)
        assert run.returncode == 0, run.output


def test_a_rank_that_asks_before_rank_0_claims_joins_at_once(monkeypatch):
    """Rank 1 at the store before rank 0 has claimed its rank (the host's claim can lag under
    load): it joins as soon as rank 0 claims, not after --init_timeout. In-process: rank 1's
    join (_meet) in a thread, rank 0's claim from the test half a second later."""
    import argparse
    import datetime
    import threading

    launch = load_example("rl_cartpole", "launch")
    port = find_free_port()
    args = argparse.Namespace(world_size=2, init_timeout=20.0, max_episodes=5,
                              per_rank=[*launch.PER_RANK_FLAGS, "per_rank"])
    for name, value in (("_args", args), ("_name", "observer1"),
                        ("_worker_name", lambda rank, _: f"rank{rank}")):
        monkeypatch.setattr(launch, name, value)
    host = launch._host_store("127.0.0.1", port, 20)
    monkeypatch.setattr(launch, "_store", launch.dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=20)))
    joined = []
    started = time.monotonic()
    rank1 = threading.Thread(target=lambda: joined.append(
        launch._meet(1, started + 20, f"127.0.0.1:{port}")))
    rank1.start()
    time.sleep(0.5)
    host.compare_set("rpc_examples/rank0", "", json.dumps(
        {"flags": {"max_episodes": 5, "world_size": 2}, "host": "h", "pid": 1}))
    rank1.join(timeout=25)
    assert joined == [None]  # everyone joined
    assert time.monotonic() - started < 5


# --------- Several hosts --------------------

def _ip(*args, check=True):
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair, with private addresses: two 'machines'."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("needs root and iproute2's ip to create network namespaces")
    tag = f"{os.getpid() % 10000}"
    hosts = [f"rpcA{tag}", f"rpcB{tag}"]
    subnet = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
    addresses = [f"{subnet}.1", f"{subnet}.2"]
    try:
        for host in hosts:
            _ip("netns", "add", host)
        _ip("link", "add", f"ve{tag}a", "type", "veth", "peer", "name", f"ve{tag}b")
        for host, end, address in zip(hosts, "ab", addresses, strict=True):
            _ip("link", "set", f"ve{tag}{end}", "netns", host)
            _ip("-n", host, "addr", "add", f"{address}/24", "dev", f"ve{tag}{end}")
            _ip("-n", host, "link", "set", f"ve{tag}{end}", "up")
            _ip("-n", host, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as err:
        for host in hosts:
            _ip("netns", "del", host, check=False)
        pytest.skip(f"cannot create network namespaces here: {err.stderr.strip()}")
    yield list(zip(hosts, addresses, strict=True))
    for host in hosts:
        for pid in _ip("netns", "pids", host, check=False).stdout.split():
            os.kill(int(pid), signal.SIGKILL)
        _ip("netns", "del", host, check=False)


@pytest.mark.slow
@pytest.mark.parametrize("example", LAUNCH_EXAMPLES)
def test_ranks_on_two_hosts(example, two_hosts, runs, tmp_path):
    config = EXAMPLES[example]
    (host_a, addr_a), (host_b, _) = two_hosts
    common = [*config.quick, "--world_size", config.world_size, "--master_addr", addr_a,
              "--master_port", find_free_port(), "--init_timeout", 60,
              "--summary_json", tmp_path / "summary.json"]
    processes = [runs.start(example, *common, "--rank", rank,
                            prefix=["ip", "netns", "exec", host_a if rank == 0 else host_b])
                 for rank in range(config.world_size)]
    for process in processes:
        process.wait(timeout=120)
        assert process.returncode == 0, process.output
    assert (tmp_path / "summary.json").exists()


def test_every_example_is_covered():
    assert {p.name for p in ROOT.iterdir() if (p / "main.py").exists()} <= set(EXAMPLES)


# The most lines each main.py may have (about 1.3 times upstream's; rnn_model_parallel's
# counts rnn.py too, a file of its own upstream).
LINE_BUDGETS = {"param_server": 400, "rl_cartpole": 325, "rnn_model_parallel": 250,
                "ddp_rpc_hybrid": 260, "pipeline_parallel": 300,
                "rpc_profiling": 260}  # the recipe's 60 lines, then the way that works today


@pytest.mark.parametrize("example", EXAMPLES)
def test_main_py_within_its_line_budget(example):
    files = ["main.py", "rnn.py"] if example == "rnn_model_parallel" else ["main.py"]
    lines = sum(len((ROOT / example / name).read_text().splitlines()) for name in files)
    assert lines <= LINE_BUDGETS[example], (example, lines)


@pytest.mark.parametrize("name", ["launch.py", "profiling.py"])
def test_every_folder_has_the_same_launch_py(name):
    """The harness is one file (and profiling.py beside it), copied into every example's folder
    so that each runs on its own; the fault tests above lean on it being the same everywhere."""
    copies = {example: (ROOT / example / name).read_bytes() for example in EXAMPLES}
    assert len(set(copies.values())) == 1, f"{name} differs between the examples"


def _code_and_comments(path):
    """(line number, code, comment) of every line of a Python file, split where its comment
    starts (the tokenizer knows a # in a string from one that starts a comment)."""
    lines = path.read_text().splitlines()
    comments = {token.start[0]: token for token in
                tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
                if token.type == tokenize.COMMENT}
    return [(number, line[:comments[number].start[1]] if number in comments else line,
             comments[number].string if number in comments else "")
            for number, line in enumerate(lines, 1)]


def test_main_py_holds_no_harness():
    """main.py is the tutorial's code: the harness stays in launch.py (comments may name the
    tutorial's calls that the harness stands in for)."""
    for example in EXAMPLES:
        code = "\n".join(code for _, code, _ in _code_and_comments(ROOT / example / "main.py"))
        for harness in ("HEARTBEAT_SECONDS", "SIOCGIFADDR", "def spawn_all", "TCPStore",
                        "ArgumentTypeError", "mp.spawn", "mp.Process"):
            assert harness not in code, (example, harness)


# The harness's stand-ins for the tutorials' calls, and the calls each may stand for.
STAND_INS = {"start": ("mp.spawn(", "mp.Process("), "init_rpc_with_timeout": ("rpc.init_rpc(",),
             "init_process_group_with_timeout": ("dist.init_process_group(",),
             "finish_and_shutdown": ("rpc.shutdown()",)}


@pytest.mark.parametrize("path", [f"{example}/{module}.py" for example in EXAMPLES
                                  for module in ("main", "batch", "remote_module")
                                  if (ROOT / example / f"{module}.py").exists()])
def test_every_stand_in_for_a_tutorial_call_names_it(path):
    """Beside every launch.py call that stands in for one of the tutorial's (on its line, or in
    the comment lines just above), a `# tutorial:` comment gives the tutorial's call; and main.py
    calls nothing else of launch.py before its "Not in the tutorial" heading but
    profile_step(), marked on its line as not in the tutorial."""
    lines = _code_and_comments(ROOT / path)
    heading = next((number for number, _, comment in lines
                    if comment.startswith("# --------- Not in the tutorial")), len(lines) + 1)
    seen = 0
    for number, code, comment in lines:
        for called in re.findall(r"\blaunch\.(\w+)\(", code):
            if called == "profile_step":
                assert comment.startswith("# not in the tutorial: --profile"), (path, number)
                continue
            if called not in STAND_INS:
                assert not path.endswith("/main.py") or number > heading, (path, number)
                continue
            above = []  # the comment lines just above the call
            for _, earlier_code, earlier_comment in reversed(lines[:number - 1]):
                if earlier_code.strip():
                    break
                above.append(earlier_comment)
            said = " ".join([comment, *above])
            assert "# tutorial: " in said, (path, number, code.strip())
            assert any(call in said for call in STAND_INS[called]), (path, number, said)
            seen += 1
    assert seen >= 2 or not path.endswith("/main.py"), path  # every rank joins, then ends


class _RecordedWrites(io.RawIOBase):
    def __init__(self):
        self.writes = []

    def writable(self):
        return True

    def write(self, data):
        self.writes.append(bytes(data))
        return len(data)


def test_each_printed_line_is_one_write(monkeypatch):
    """Under PYTHONUNBUFFERED (as the tests run the examples), print("a", 1) wrote "a", " ",
    "1" and a newline separately, and two ranks' lines ran into each other in the log."""
    raw = _RecordedWrites()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, write_through=True))
    load_example("ddp_rpc_hybrid", "launch")._print_whole_lines()
    print("Training done for epoch", 0)
    print("next")
    assert raw.writes == [b"Training done for epoch 0\n", b"next\n"]
