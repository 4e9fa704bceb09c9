"""The harness (rpc_harness), tested once, against one or two examples: the command line, the
join (who waits where, flags compared, a taken rank, missing ranks, a mismatched world in every
start order), lost peers, a stopped and resumed rank, signals, torchrun, several hosts,
loopback-only listeners, --profile's merge, the summary; and what every example keeps: the
tutorial's calls in main.py, no import cycles. Everything that starts processes against a run
in progress is marked slow."""

import ast
import io
import ipaddress
import json
import multiprocessing
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import ROOT, TCP, _processes, example_command, find_free_port, load_example

from rpc_harness import cli, rendezvous
from rpc_harness import rank as rank_module
from rpc_harness.compat import profiler_options

# How long the other ranks may take to exit after one is killed. Measured: well under a second
# when the machine is idle (a dead process's connections close at once); the bound leaves room
# for a loaded 2-core CI machine.
EXIT_BOUND_SECONDS = 20

rl = load_example("rl_cartpole")  # the example that starts quickest


# --------- The command line, in-process --------------------

GENERIC_BAD_INPUTS = [
    (["--world_size", "1"], "must be at least 2"),
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
    (["--profile", str(Path(__file__))], "cannot make that folder (File exists)"),
    (["--profile_steps", "0"], "must be at least 1"),
]


def _child_processes():
    return _processes(lambda stat: stat[1] == os.getpid())


@pytest.mark.parametrize("flags, expected", GENERIC_BAD_INPUTS,
                         ids=[" ".join(flags) for flags, _ in GENERIC_BAD_INPUTS])
def test_bad_input_exits_2_with_one_line_and_starts_nothing(capsys, flags, expected):
    before = _child_processes()
    with pytest.raises(SystemExit) as exited:
        rl.parse_args(["--master_port", str(find_free_port()), *flags])
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert expected in err
    assert not multiprocessing.active_children() and _child_processes() == before


def test_busy_port_is_one_line_naming_it(capsys):
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit) as exited:
            rl.parse_args(["--master_port", str(port)])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and len(err.strip().splitlines()) == 1
    assert f":{port}" in err and "--master_port" in err


def test_the_flags_that_must_agree(monkeypatch):
    """Every flag but those of a rank's own machine is compared at the join, and the script that
    runs (main.py, or a variant's entry point), so that a rank of another program is refused."""
    monkeypatch.setattr(sys, "argv", ["/somewhere/batch.py"])
    args = rl.parse_args(["--rank", "1", "--master_port", str(find_free_port()),
                          "--summary_json", "s.json", "--rpc_timeout", "9", "--gamma", "0.5"])
    flags = args.harness.flags
    assert flags["script"] == "batch.py" and flags["gamma"] == 0.5 and flags["world_size"] == 2
    assert not set(flags) & {"rank", "master_port", "summary_json", "rpc_timeout", "torchrun"}
    assert args.harness.names == ["agent", "observer1"] and args.harness.loops == [0]
    assert not args.harness.spawn_all


def test_the_line_for_flags_that_differ_names_every_rank_and_flag():
    """Rank 0 and two ranks that differ from it in other ways; each named by its own program,
    the world size first."""
    claims = {0: {"name": "parameter_server", "flags": {"script": "main.py", "world_size": 3,
                                                        "lr": 0.03}},
              1: {"name": "trainer1", "flags": {"script": "batch.py", "world_size": 3,
                                                "lr": 0.03}},
              2: {"name": "trainer_2", "flags": {"script": "main.py", "world_size": 4,
                                                 "lr": 0.1}}}
    assert rendezvous._differences(claims) == (
        "the ranks were started with different flags: script is main.py on rank 0 "
        "(parameter_server) but batch.py on rank 1 (trainer1); --world_size is 3 on rank 0 "
        "(parameter_server) but 4 on rank 2 (trainer_2); --lr is 0.03 on rank 0 "
        "(parameter_server) but 0.1 on rank 2 (trainer_2); start every rank with the same values")
    assert rendezvous._differences({0: claims[0], 3: claims[0]}) == ""


def _harness_args(**more):
    """A command line as check_args leaves it, for the harness's functions in-process."""
    harness = SimpleNamespace(names=["parameter_server", "trainer_1", "trainer_2"],
                              summary=lambda args, reports: ({"trainers": len(reports)}, "ok"),
                              started=time.time(), spawn_all=False)
    return SimpleNamespace(harness=harness, summary_json=None, init_timeout=5, rpc_timeout=5,
                           torchrun=False, **more)


class _Ended(Exception):
    pass


@pytest.fixture
def ends(monkeypatch):
    """rank_module.end() raises _Ended(line, status) instead of ending this test process."""
    def end(line, status):
        raise _Ended(line, status)
    monkeypatch.setattr(rank_module, "end", end)


def test_a_summary_without_a_ranks_figures_names_that_rank(monkeypatch, capsys):
    """A rank that never said it was done (so its figures never came): the summary says whose
    figures are missing, instead of raising."""
    monkeypatch.setattr(rank_module, "_args", _harness_args())
    rank_module._write_summary({0: {"peak_memory_mb": {"rss": 1}}, 2: {"accuracy": 0.9}})
    captured = capsys.readouterr()
    assert captured.err == ("Summary: not written: no figures from trainer_1 (rank 1), which did "
                            "not say it was done within 10 s\n")
    rank_module._write_summary({0: {}, 1: {"accuracy": 0.9}, 2: {"accuracy": 0.8}})
    assert capsys.readouterr().out.startswith("Summary: ok; ")


def test_a_ranks_figures_come_with_its_bye():
    """The figures travel on the watch's connection, in the line that says the rank is done: rank
    0 cannot read older ones."""
    rank_module._byes.clear()
    rank_module._read(2, b'bye {"accuracy": 0.5}')
    assert rank_module._byes == {2: {"accuracy": 0.5}}
    rank_module._byes.clear()


def test_only_a_rank_with_its_claims_token_is_taken_on_rank_0s_port():
    """A stray connection, one that closes before it says anything, a wrong token and a second
    claim of a rank already taken are closed and ignored; the rank with its token is taken."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    claims = {0: {"token": "r0"}, 1: {"token": "good1"}, 2: {"token": "good2"}}
    said = [b"", b"x", b"1 wrong\n", b"1 good1\n", b"1 good1\n", b"2 good2\n"]
    clients = []
    for words in said:
        client = socket.create_connection(("127.0.0.1", port))
        client.sendall(words)
        if not words:
            client.close()
        clients.append(client)
    clients[1].shutdown(socket.SHUT_WR)  # "x", then nothing more
    peers = rendezvous._accept_peers(listener, claims, time.monotonic() + 10)
    assert sorted(peers) == [1, 2]
    for client in clients:
        client.close()
    for sock in peers.values():
        sock.close()
    listener.close()


@pytest.mark.parametrize("error, expected", [
    ("The client socket has timed out after 2000ms while trying to connect to (localhost, 1).",
     "parameter_server (rank 0) did not come: nothing answered at localhost:1 within 5 s"),
    ("Connection reset by peer",
     "cannot reach parameter_server (rank 0)'s store at localhost:1 (Connection reset by peer)"),
])
def test_a_failed_connection_to_the_store_says_its_own_cause(monkeypatch, ends, error, expected):
    def store(*args, **kwargs):
        raise RuntimeError(error)
    monkeypatch.setattr(rendezvous.dist, "TCPStore", store)
    monkeypatch.setattr(rendezvous.time, "sleep", lambda seconds: None)
    with pytest.raises(_Ended) as ended:
        rendezvous._open_store(_harness_args(), 1, "localhost", 1)
    line, status = ended.value.args
    assert line.startswith("trainer_1: ") and expected in line and status == 1


@pytest.mark.parametrize("rank, addr, environ, expected", [
    (None, "localhost", {}, {0: 2, 1: 1, 2: 1}),  # 2 cores: the computing rank 0 gets both
    (None, "localhost", {"OMP_NUM_THREADS": "4"}, {0: 4, 1: 4, 2: 4}),
    (1, "localhost", {}, {0: 2, 1: 1, 2: 1}),  # --rank on loopback: every rank on this machine
    (0, "10.0.0.1", {}, {0: 2}),  # alone on its machine, as far as it can tell
    (1, "10.0.0.1", {"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0"}, {1: 1, 2: 1}),  # torchrun
])
def test_each_rank_gets_its_share_of_the_cores(monkeypatch, rank, addr, environ, expected):
    monkeypatch.setattr(cli, "CORES", 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    args = SimpleNamespace(world_size=3, rank=rank, master_addr=addr)
    assert cli._thread_counts(args, computing=[0]) == expected


def test_a_python_without_the_harness_is_told_how_to_set_up():
    """A Python with torch but without this project's package (a copied folder, say): one line
    saying how to install it."""
    script = ("import runpy, sys; sys.modules['rpc_harness'] = None; sys.argv = ['main.py']; "
              "runpy.run_path('main.py', run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT / "param_server",
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == "" and "Traceback" not in done.stderr
    # torch 2.4 prints its TorchScript deprecation warning as main.py imports
    # torch.distributed.optim, before rpc_harness is imported
    assert done.stderr.splitlines()[-1] == (
        "rpc_harness, this project's package, is missing: install it with `pip install -e "
        "PATH`, PATH being the repository's folder (the one that holds pyproject.toml), or run "
        "`make run` there")


def test_the_merge_command_makes_the_timeline_of_a_folder_of_traces(tmp_path):
    """`python -m rpc_harness.profiling FOLDER`, which a rank 0 that cannot read the others'
    traces names: one timeline of the traces in the folder, a track per rank in rank order."""
    for rank, name in ((1, "trainer_1"), (0, "parameter_server")):
        (tmp_path / f"{name}.json").write_text(json.dumps({
            "rank": rank, "rankName": name, "baseTimeNanoseconds": 10**9, "traceEvents": [
                {"ph": "M", "name": "process_labels", "pid": 7 + rank, "args": {"labels": "CPU"}},
                {"ph": "X", "name": "aten::mm", "pid": 7 + rank, "tid": 1, "ts": 5, "dur": 1}]}))
    (tmp_path / "other.json").write_text("{}")  # not a trace of ours: left out
    done = subprocess.run([sys.executable, "-m", "rpc_harness.profiling", tmp_path],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "wrote the timeline of 2 ranks" in done.stdout
    events = json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
    tracks = sorted((e["pid"], e["args"]["name"]) for e in events if e["name"] == "process_name")
    assert [name for _, name in tracks] == ["parameter_server", "trainer_1"]


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
    monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(_RecordedWrites(), write_through=True))
    rank_module._whole_lines()
    print("Training done for epoch", 0)
    print("next")
    assert raw.writes == [b"Training done for epoch 0\n", b"next\n"]


# --------- What every example keeps --------------------

EXAMPLES = ["param_server", "rl_cartpole", "rnn_model_parallel", "ddp_rpc_hybrid",
            "pipeline_parallel", "rpc_profiling"]
# Each example's entry points: main.py, and a variant's script of its own.
ENTRY_POINTS = [f"{example}/{script}" for example in EXAMPLES for script in
                ("main.py", "batch.py", "remote_module.py", "pipelining.py")
                if (ROOT / example / script).exists()]


def test_every_example_is_covered():
    assert {p.name for p in ROOT.iterdir() if (p / "main.py").exists()} == set(EXAMPLES)


def test_the_harness_is_one_package():
    """One copy, at the root: no launch.py or profiling.py in an example's folder."""
    assert not [path for example in EXAMPLES for path in (ROOT / example).glob("*.py")
                if path.name in ("launch.py", "profiling.py")]


def _calls(tree):
    return [ast.unparse(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)]


def _assigned_environment(tree):
    """The names of the environment variables that the code sets: os.environ[NAME] = ..."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if (isinstance(target, ast.Subscript) and ast.unparse(target.value) == "os.environ"
                        and isinstance(target.slice, ast.Constant)):
                    names.add(target.slice.value)
    return names


@pytest.mark.parametrize("path", ENTRY_POINTS)
def test_each_entry_point_makes_the_tutorials_calls(path):
    """rpc.init_rpc(...) and rpc.shutdown() (dist.init_process_group(...) too where the tutorial
    has it) as the tutorial writes them, MASTER_ADDR and MASTER_PORT set in os.environ, and the
    ranks started by torch.multiprocessing itself: mp.spawn for every rank, mp.Process for one."""
    tree = ast.parse((ROOT / path).read_text())
    calls = _calls(tree)
    assert ("rpc.init_rpc" in calls) == ("rpc.shutdown" in calls), path
    if path.endswith("main.py"):
        assert "rpc.init_rpc" in calls, path
    if path in ("ddp_rpc_hybrid/main.py", "pipeline_parallel/pipelining.py"):
        assert "dist.init_process_group" in calls
    if path == "pipeline_parallel/pipelining.py":  # no RPC: the pipelining tutorial's calls
        assert {"PipelineStage", "dist.new_group", "dist.destroy_process_group"} <= set(calls)
    assert {"MASTER_ADDR", "MASTER_PORT"} <= _assigned_environment(tree), path
    assert {"mp.spawn", "mp.Process"} <= set(calls), path
    assert "rpc_harness.spawn" not in calls


@pytest.mark.parametrize("example", EXAMPLES)
def test_no_module_imports_the_script_that_runs(example):
    """From each entry point, the modules of its folder that it imports, and theirs, never lead
    back to it: a script imported as a module would load a second time, with a second copy of
    every class and global."""
    folder = ROOT / example
    local = {path.stem for path in folder.glob("*.py")}
    imports = {}
    for path in folder.glob("*.py"):
        tree = ast.parse(path.read_text())
        imports[path.stem] = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                              for alias in node.names} | {
            node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        imports[path.stem] &= local
    for entry in ("main", "batch", "remote_module", "pipelining"):
        if entry not in local:
            continue
        reached, todo = set(), list(imports[entry])
        while todo:
            module = todo.pop()
            if module not in reached:
                reached.add(module)
                todo.extend(imports[module])
        assert entry not in reached, (example, entry, reached)


# --------- Runs --------------------

@dataclass
class Example:
    name: str
    world_size: int  # the smallest world that has every role
    quick: list  # flags for a short complete run
    endless: list  # flags for a run that lasts until it is killed
    roles: dict  # rank -> worker name
    working: str  # a line that shows the run is under way
    script: str = "main.py"
    transport: tuple = TCP  # pipelining.py has no RPC, nor --rpc_transport


RUNS = {
    "param_server": Example(
        "param_server", 2, ["--dataset", "synthetic", "--max_batches", 5],
        ["--dataset", "synthetic", "--epochs", 1000], {0: "parameter_server", 1: "trainer_1"},
        r"^Rank 1 training batch"),
    "param_server/batch.py": Example(
        "param_server", 3, ["--dataset", "synthetic", "--max_batches", 5],
        ["--dataset", "synthetic", "--epochs", 1000], {0: "ps", 1: "trainer1"},
        r"^Rank 1 training batch", script="batch.py"),
    "rl_cartpole": Example(
        "rl_cartpole", 2, ["--max_episodes", 5], ["--max_episodes", 100000, "--log_interval", 1],
        {0: "agent", 1: "observer1"}, r"^Episode 1\t"),
    "rnn_model_parallel": Example(
        "rnn_model_parallel", 2, ["--epochs", 1, "--max_batches", 20], ["--epochs", 100000],
        {0: "ps", 1: "trainer"}, r"^Training epoch 0"),
    "ddp_rpc_hybrid": Example(
        "ddp_rpc_hybrid", 3, ["--epochs", 2], ["--epochs", 100000],
        {0: "trainer0", 1: "master", 2: "ps"}, r"^Training done for epoch"),
    "ddp_rpc_hybrid/remote_module.py": Example(
        "ddp_rpc_hybrid", 3, ["--epochs", 2], ["--epochs", 100000],
        {0: "trainer0", 1: "master", 2: "ps"}, r"^Training done for epoch",
        script="remote_module.py"),
    "pipeline_parallel": Example(
        "pipeline_parallel", 3, ["--num_split", 2, "--num_batches", 2, "--batch_size", 4],
        ["--num_split", 2, "--num_batches", 100000, "--batch_size", 4],
        {0: "master", 1: "worker1", 2: "worker2"}, r"^Processing batch 1$"),
    "pipeline_parallel/pipelining.py": Example(
        "pipeline_parallel", 2, ["--num_split", 2, "--num_batches", 2, "--batch_size", 4,
                                 "--schedule", "GPipe"],
        ["--num_split", 2, "--num_batches", 100000, "--batch_size", 4, "--schedule", "GPipe"],
        {0: "stage0", 1: "stage1"}, r"^GPipe, n_microbatches 2, batch 1:", "pipelining.py", ()),
}


def start(runs, key, *flags, rank=None, endless=False, **kwargs):
    """A run of an example, over TCP: TensorPipe's shared memory keeps a thread of every process
    polling, which on 2 cores starved even this process's reads of /proc for seconds."""
    config = RUNS[key]
    return runs.start(config.name, *(config.endless if endless else config.quick),
                      *config.transport, "--world_size", config.world_size, *flags,
                      *(() if rank is None else ("--rank", rank)), script=config.script, **kwargs)


def _wait_any(processes, pattern, timeout=90):
    deadline = time.monotonic() + timeout
    while not any(re.search(pattern, p.output, re.M) for p in processes):
        assert time.monotonic() < deadline, "the run never got under way"
        time.sleep(0.05)


@pytest.mark.slow
def test_bad_input_on_the_real_command_line(runs):
    run = runs.start("rl_cartpole", "--world_size", "1").wait(timeout=60)
    assert run.returncode == 2 and run.stdout == ""
    assert len(run.stderr.strip().splitlines()) == 1 and "must be at least" in run.stderr
    assert not run.leftovers(grace=3)  # the resource tracker ends just after


# --------- Loopback only --------------------

def _listening_sockets():
    """{socket inode: (address, port)} of every listening TCP socket in this network namespace."""
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


# --------- A rank killed mid-run --------------------

# One run each, the victim a rank of a kind that the others wait for in another way: in RPC
# calls (param_server's trainers), for a model that needs the dead trainer's gradients
# (batch.py), in an allreduce and for the trainers' loops (ddp_rpc_hybrid), ps holding the
# RemoteModule (remote_module.py), the micro-batches of a shard (pipeline_parallel), the
# stage that holds the store, the other waiting in Gloo's recv (pipelining.py); and under
# spawn-all, where the command that started them stops every rank alike.
KILL_CASES = [("param_server", 1, "per-rank"), ("param_server/batch.py", 1, "per-rank"),
              ("ddp_rpc_hybrid", 0, "per-rank"), ("ddp_rpc_hybrid/remote_module.py", 2, "per-rank"),
              ("pipeline_parallel", 1, "per-rank"), ("rl_cartpole", 1, "spawn-all"),
              ("ddp_rpc_hybrid", 2, "spawn-all"),
              ("pipeline_parallel/pipelining.py", 0, "per-rank")]


@pytest.mark.slow
@pytest.mark.parametrize("key, victim, mode", KILL_CASES,
                         ids=[f"{k}-{RUNS[k].roles[r]}-{m}" for k, r, m in KILL_CASES])
def test_killed_rank_stops_every_other_rank(key, victim, mode, runs):
    """SIGKILL one rank mid-run: every other rank ends within the bound, each command naming the
    rank that went in one line (one rank per terminal: the lost peer; spawn-all: the killed
    rank), status 1, and nothing is left running. Spawn-all runs also check that nothing
    listens beyond loopback."""
    config = RUNS[key]
    port = find_free_port()
    if mode == "spawn-all":
        launcher = start(runs, key, "--master_port", port, endless=True)
        launcher.wait_for_output(config.working, timeout=90)
        assert_listening_on_loopback_only(launcher, config.world_size)
        ranks = launcher.children()
        assert len(ranks) == config.world_size
        survivors, victim_pid = [launcher], ranks[victim]
    else:
        processes = [start(runs, key, "--master_port", port, rank=rank, endless=True)
                     for rank in range(config.world_size)]
        _wait_any(processes, config.working)
        survivors = [p for rank, p in enumerate(processes) if rank != victim]
        victim_pid = processes[victim].proc.pid
    killed_at = time.monotonic()
    os.kill(victim_pid, signal.SIGKILL)
    victim_name = config.roles[victim]
    for survivor in survivors:
        survivor.wait(timeout=EXIT_BOUND_SECONDS + 30)
        took = time.monotonic() - killed_at
        assert survivor.returncode == 1, survivor.output
        assert took < EXIT_BOUND_SECONDS, f"exited {took:.1f} s after the kill"
        assert not survivor.leftovers()
        # one line, naming the rank that went (whoever told): no C++ warnings or traces about it
        assert re.fullmatch(rf"\w+: lost contact with {victim_name} \(rank {victim}, .*\); "
                            r"stopping\n" if mode == "per-rank" else
                            rf"{victim_name} \(rank {victim}\) was killed by SIGKILL; stopped the "
                            r"other ranks\n", survivor.stderr), survivor.stderr


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["per-rank", "spawn-all"])
def test_a_rank_killed_while_profiling_loses_only_its_own_trace(mode, runs, tmp_path):
    """--profile with the windows open for the whole run: SIGKILL trainer_2, and the parameter
    server and trainer_1, which end as above (a lost peer, or stopped by the launcher), first
    write what their profilers hold, whole (where this torch lets another thread stop the
    profiler)."""
    traces = tmp_path / "traces"
    common = ["--world_size", 3, "--log_interval", 5, "--profile", traces,
              "--profile_steps", 100000, "--master_port", find_free_port()]
    windows_open = r"^Rank 2 training batch 5 "  # the trainers' windows open after 2 steps
    if mode == "spawn-all":
        launcher = start(runs, "param_server", *common, endless=True)
        launcher.wait_for_output(windows_open, timeout=90)
        survivors, victim_pid = [launcher], launcher.children()[2]
    else:
        processes = [start(runs, "param_server", *common, rank=rank, endless=True)
                     for rank in range(3)]
        _wait_any(processes, windows_open)
        # the rank's own process, which its command started (killing the command would give
        # the rank its death signal, on which it writes its trace)
        survivors, victim_pid = processes[:2], processes[2].children()[0]
    os.kill(victim_pid, signal.SIGKILL)
    for survivor in survivors:
        survivor.wait(timeout=EXIT_BOUND_SECONDS + 30)
        assert survivor.returncode == 1 and not survivor.leftovers()
    if not profiler_options()[1]:
        assert not list(traces.glob("*.json"))
        pytest.skip("a rank that stops early writes its trace from a thread of its own; this "
                    "torch's profiler can be stopped only by the thread that started it")
    for name in ("parameter_server", "trainer_1"):
        path = traces / f"{name}.json"
        assert path.exists(), "".join(survivor.output for survivor in survivors)
        assert json.loads(path.read_text())["rankName"] == name
    assert sorted(path.name for path in traces.iterdir()) == ["parameter_server.json",
                                                              "trainer_1.json"]  # no parts


@pytest.mark.slow
def test_killed_launcher_takes_its_ranks_with_it(runs):
    """SIGKILL the command that started every rank: the ranks end too, instead of running on
    unseen."""
    launcher = start(runs, "pipeline_parallel", "--master_port", find_free_port(), endless=True)
    launcher.wait_for_output(RUNS["pipeline_parallel"].working, timeout=90)
    assert len(launcher.children()) == 3
    os.kill(launcher.proc.pid, signal.SIGKILL)
    launcher.proc.wait(timeout=10)
    assert not launcher.leftovers(grace=EXIT_BOUND_SECONDS)


# --------- One terminal per rank: waiting, missing ranks, interrupting, flags that differ -----

WAITING = r"^\S+ \(rank \d+ of \d+\): waiting for the other ranks at localhost:\d+, up to 60 s$"


@pytest.mark.slow
def test_missing_ranks_are_named_after_init_timeout(runs):
    """Rank 0 (which hosts the rendezvous) alone, and the last rank alone, for an example that
    only joins RPC and for one whose trainers first meet in a process group."""
    alone = [start(runs, key, "--master_port", find_free_port(), "--init_timeout", 2, rank=rank)
             for key in LAUNCH_EXAMPLES for rank in (0, RUNS[key].world_size - 1)]
    expected = ["trainer_1 (rank 1) did not join at localhost:",
                "parameter_server (rank 0) did not come: nothing answered at localhost:",
                "master (rank 1), ps (rank 2) did not join at localhost:",
                "trainer0 (rank 0) did not come: nothing answered at localhost:"]
    for run, missing in zip(alone, expected, strict=True):
        run.wait(timeout=90)
        assert run.returncode == 1, run.output
        assert run.stderr.count("\n") == 1 and missing in run.stderr, run.stderr
        assert "within 2 s (--init_timeout)" in run.stderr, run.stderr
        assert not run.leftovers()


@pytest.mark.slow
def test_a_waiting_rank_ends_at_once_on_ctrl_c_or_sigterm(runs):
    """A rank alone, waiting for the others (rank 0, which hosts the rendezvous, and a rank that
    waits to reach it), ends within 2 s of SIGINT (Ctrl-C) or SIGTERM with one line."""
    cases = [("param_server", 0, signal.SIGINT, "parameter_server"),
             ("rl_cartpole", 1, signal.SIGINT, "observer1"),
             ("ddp_rpc_hybrid", 2, signal.SIGTERM, "ps")]
    started = [start(runs, key, "--master_port", find_free_port(), rank=rank)
               for key, rank, _, _ in cases]
    for run, (_, _, number, name) in zip(started, cases, strict=True):
        run.wait_for_output(WAITING, timeout=90)
        time.sleep(0.5)  # well into the wait, not at its first step
        sent = time.monotonic()
        run.proc.send_signal(number)
        run.wait(timeout=30)
        assert time.monotonic() - sent < 2, run.output
        assert run.returncode == 128 + number, run.output
        suffix = "" if number == signal.SIGINT else " (SIGTERM)"
        assert run.stderr == f"{name}: interrupted{suffix}\n", run.stderr
        # multiprocessing's resource tracker, which the spawn start method starts, ends as it
        # reads the end of the command's pipe: a moment after the command
        assert not run.leftovers(grace=3)


@pytest.mark.slow
def test_ctrl_c_mid_run(runs):
    """Ctrl-C mid-run: to one rank in its terminal (ddp_rpc_hybrid's master, which waits in
    torch's C++ code for the trainers' whole loops), and to every process of a spawn-all run,
    as a terminal sends it: the command that started the ranks stops them, in one line."""
    port = find_free_port()
    ranks = [start(runs, "ddp_rpc_hybrid", "--master_port", port, rank=rank, endless=True)
             for rank in range(3)]
    spawn_all = start(runs, "rl_cartpole", "--master_port", find_free_port(), endless=True)
    _wait_any(ranks, RUNS["ddp_rpc_hybrid"].working)
    spawn_all.wait_for_output(RUNS["rl_cartpole"].working, timeout=90)
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
        assert survivor.returncode == 1 and "lost contact with master" in survivor.stderr
    for run in runs:
        assert not run.leftovers()


@pytest.mark.slow
def test_ranks_with_different_flags_end_at_once_naming_the_flag(runs):
    """Rank 0 and one rank that differs from it, while a third rank is still missing: each says
    at once the same line naming the flag, both values and both ranks (the variant's own names
    for its ranks), status 2; the rank that differs ends at once, rank 0 (which holds the store)
    once the missing rank could have read the verdict: by its --init_timeout. Then a world size
    that differs."""
    port = find_free_port()
    batch = [start(runs, "param_server", "--world_size", 3, "--master_port", port,
                   "--init_timeout", 8, rank=0),
             start(runs, "param_server/batch.py", "--master_port", port, rank=1)]
    port = find_free_port()
    worlds = [start(runs, "rl_cartpole", "--master_port", port, "--init_timeout", 8, rank=0),
              start(runs, "rl_cartpole", "--world_size", 3, "--master_port", port, rank=2)]
    for ranks, expected in ((batch, "script is main.py on rank 0 (parameter_server) but batch.py "
                                    "on rank 1 (trainer1)"),
                            (worlds, "--world_size is 2 on rank 0 (agent) but 3 on rank 2 "
                                     "(observer2)")):
        for run in ranks:
            run.wait_for_output(WAITING.replace("60", r"\d+"), timeout=90)
        everyone_started = time.monotonic()
        for run in ranks:
            run.wait_for_output("start every rank with the same values", timeout=10)
            assert time.monotonic() - everyone_started < 10, run.output
        ranks[1].wait(timeout=10)
        ranks[0].wait(timeout=30)
        for run in ranks:
            assert run.returncode == 2, run.output
            assert run.stderr.count("\n") == 1 and expected in run.stderr, run.stderr
            assert not run.leftovers(grace=3)  # the resource tracker ends just after


# Four ranks of ddp_rpc_hybrid (trainer0, trainer1, master, ps: the trainers meet in a process
# group first, the others in RPC), rank 0 with other flags, started in these orders.
MISMATCH_ORDERS = [(3, 2, 1, 0), (0, 1, 2, 3), (2, 0, 3, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("order", MISMATCH_ORDERS, ids=["-".join(map(str, o)) for o in
                                                         MISMATCH_ORDERS])
def test_every_rank_of_a_mismatched_world_ends_with_the_line(order, runs):
    """Whatever order the ranks start in, every one ends within --init_timeout (10 s here) of
    its start with the line that names the flag, status 2: rank 0 keeps the store until every
    rank has read the verdict."""
    port = find_free_port()
    started = {}
    for rank in order:
        flags = ["--epochs", 3] if rank == 0 else []
        started[rank] = (time.monotonic(),
                         start(runs, "ddp_rpc_hybrid", "--world_size", 4, "--master_port", port,
                               "--init_timeout", 10, *flags, rank=rank, endless=True))
        time.sleep(1)  # a person starting one terminal after another
    for rank, (began, run) in started.items():
        run.wait(timeout=60)
        assert time.monotonic() - began < 10 + EXIT_BOUND_SECONDS, run.output
        assert run.returncode == 2, (rank, run.output)
        assert run.stderr.count("\n") == 1, run.stderr
        assert "--epochs is 3 on rank 0 (trainer0) but 100000 on rank" in run.stderr, run.stderr
        assert not run.leftovers(grace=3)  # the resource tracker ends just after


@pytest.mark.slow
def test_a_resumed_rank_says_which_rank_gave_up_on_it(runs):
    """SIGSTOP a trainer's process past --rpc_timeout: the parameter server gives up on it, in
    one line; resumed (SIGCONT), the trainer says that rank 0 gave up on it, not that it lost
    contact with itself."""
    port = find_free_port()
    ranks = [start(runs, "param_server", "--master_port", port, "--rpc_timeout", 3, rank=rank,
                   endless=True) for rank in (0, 1)]
    _wait_any(ranks, RUNS["param_server"].working)
    trainer = ranks[1].children()[0]
    os.kill(trainer, signal.SIGSTOP)
    try:
        ranks[0].wait(timeout=30)
    finally:
        os.kill(trainer, signal.SIGCONT)
    assert ranks[0].returncode == 1
    assert ranks[0].stderr == ("parameter_server: lost contact with trainer_1 (rank 1, silent "
                               "for 3 s (--rpc_timeout)); stopping\n"), ranks[0].stderr
    ranks[1].wait(timeout=30)
    assert ranks[1].returncode == 1
    assert ranks[1].stderr == ("trainer_1: parameter_server (rank 0) gave up on this rank, which "
                               "it had not heard from for 3 s (--rpc_timeout); stopping\n"), (
        ranks[1].stderr)
    assert not ranks[1].leftovers()


@pytest.mark.slow
def test_a_rank_started_twice_is_told_it_is_taken(runs):
    """The second command ends with one line; the run goes on."""
    port = find_free_port()
    agent = start(runs, "rl_cartpole", "--master_port", port, rank=0, endless=True)
    first = start(runs, "rl_cartpole", "--master_port", port, rank=1, endless=True)
    first.wait_for_output(r"^observer1: joined", timeout=90)
    second = start(runs, "rl_cartpole", "--master_port", port, rank=1).wait(timeout=60)
    assert second.returncode == 2
    assert re.search(r"^observer1: rank 1 is taken: process \d+ on \S+ joined as rank 1 first; "
                     r"give every rank its own --rank\n\Z", second.stderr, re.M), second.stderr
    assert agent.proc.poll() is None and first.proc.poll() is None


# --------- torchrun, and several hosts --------------------

# param_server: a heavy rank's threads; ddp_rpc_hybrid: a process group beside RPC.
LAUNCH_EXAMPLES = ("param_server", "ddp_rpc_hybrid")


@pytest.mark.slow
@pytest.mark.parametrize("key", LAUNCH_EXAMPLES)
def test_torchrun_runs_every_rank(key, runs, tmp_path):
    config = RUNS[key]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                str(config.world_size), "--master_port", str(find_free_port())]
    script = example_command(config.name, *config.quick, *TCP, "--summary_json",
                             tmp_path / "summary.json")
    run = runs.start_command([*torchrun, *script[1:]]).wait(timeout=120)
    assert run.returncode == 0, run.output
    assert json.loads((tmp_path / "summary.json").read_text())["world_size"] == config.world_size
    assert not run.leftovers()


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
@pytest.mark.parametrize("key", LAUNCH_EXAMPLES)
def test_ranks_on_two_hosts(key, two_hosts, runs, tmp_path):
    (host_a, addr_a), (host_b, _) = two_hosts
    common = ["--master_addr", addr_a, "--master_port", find_free_port(),
              "--summary_json", tmp_path / "summary.json"]
    processes = [start(runs, key, *common, rank=rank,
                       prefix=["ip", "netns", "exec", host_a if rank == 0 else host_b])
                 for rank in range(RUNS[key].world_size)]
    for process in processes:
        process.wait(timeout=120)
        assert process.returncode == 0, process.output
    assert (tmp_path / "summary.json").exists()
