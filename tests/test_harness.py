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
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.multiprocessing as mp
from conftest import ROOT, RUNS, TCP, _processes, example_command, find_free_port, load_example

from rpc_harness import cli, launch, rendezvous
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
                              started=time.time(), spawn_all=False, rank=1, reasons=None)
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


def test_a_summary_without_a_ranks_figures_names_that_rank(capsys):
    """A rank that never said it was done (so its figures never came): the summary says whose
    figures are missing, instead of raising."""
    args = _harness_args()
    rank_module.write_summary(args, {0: {"peak_memory_mb": {"rss": 1}}, 2: {"accuracy": 0.9}})
    captured = capsys.readouterr()
    assert captured.err == ("Summary: not written: no figures from trainer_1 (rank 1), which did "
                            "not say it was done within 10 s\n")
    rank_module.write_summary(args, {0: {}, 1: {"accuracy": 0.9}, 2: {"accuracy": 0.8}})
    assert capsys.readouterr().out.startswith("Summary: ok; ")


@pytest.fixture
def rank_0(monkeypatch):
    """Rank 0's state (rank.Rank), without its loop: what the loop does with what it reads is
    called directly. end() raises _Ended(line, status)."""
    this = rank_module.Rank(_harness_args(), 0)

    def end(line, status):
        raise _Ended(line, status)

    monkeypatch.setattr(this, "end", end)
    yield this
    os.close(this.terminal)


def test_a_ranks_figures_come_with_its_bye(rank_0):
    """The figures travel on the watch's connection, in the line that says the rank is done: rank
    0 cannot read older ones. Figures it cannot read count as none."""
    rank_0._read(2, 'bye {"accuracy": 0.5}')
    rank_0._read(1, "bye {not json")
    assert rank_0.byes == {2: {"accuracy": 0.5}, 1: {}}


@pytest.mark.parametrize("line", ["gone", "gone x", "gone 99 silent", "failed -1 x", "\ufffd\ufffd",
                                  "hello world", ""])
def test_a_line_that_is_not_the_harnesss_changes_nothing(rank_0, line):
    """The watch's loop reads what a peer says; anything it cannot read is left alone (it used to
    end the loop, and with it the watch over the peers, in silence)."""
    rank_0._read(1, line)
    assert not rank_0.lost.is_set()


def test_a_peer_that_says_a_rank_failed_ends_this_rank_naming_it(rank_0):
    with pytest.raises(_Ended) as ended:
        rank_0._read(2, "failed 2 ValueError: a bad batch")
    assert ended.value.args == ("parameter_server: trainer_2 (rank 2) failed (ValueError: a bad "
                                "batch); stopping", 1)


def test_under_mp_spawn_a_silent_peer_is_a_reason_left_for_the_command(rank_0, tmp_path,
                                                                    monkeypatch):
    """Under mp.spawn the command says the run's line; a rank that finds a peer silent (which
    mp.spawn cannot see) leaves it the reason, and ends silently with status 1; the command reads
    the reason of the rank that mp.spawn names."""
    rank_0.spawn_all = True
    rank_0.args.harness.reasons = str(tmp_path / "reasons")
    monkeypatch.setattr(launch.cli, "launched", rank_0.args.harness)
    rank_0.heard[1] = time.monotonic() - 10
    monkeypatch.setattr(rank_0.selector, "select", lambda timeout: [])
    with pytest.raises(_Ended) as ended:
        rank_0._turn()
    assert ended.value.args == (None, 1)
    assert launch._reason_left_by(0) == ("lost contact with trainer_1 (rank 1, silent for 5 s "
                                         "(--rpc_timeout))")
    assert launch._reason_left_by(2) is None


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


@pytest.mark.parametrize("seconds_left, expected", [
    (0, "parameter_server (rank 0) did not come: nothing answered at localhost:1 within 5 s"),
    (30, "cannot reach parameter_server (rank 0)'s store at localhost:1 (Connection reset by "
         "peer)"),
])
def test_a_failed_connection_to_the_store_says_its_own_cause(monkeypatch, ends, seconds_left,
                                                             expected):
    """torch raises one error (DistNetworkError) for both; the store's client tries until
    --init_timeout, so an error at the deadline is rank 0 that did not come."""
    def store(*args, **kwargs):
        raise RuntimeError("Connection reset by peer")
    monkeypatch.setattr(rendezvous.dist, "TCPStore", store)
    monkeypatch.setattr(rendezvous.time, "sleep", lambda seconds: None)
    deadline = time.monotonic() + seconds_left
    with pytest.raises(_Ended) as ended:
        rendezvous._open_store(_harness_args(), 1, "localhost", 1, deadline)
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
    asked = cli.omp_num_threads(cli.ArgumentParser())
    assert cli._thread_counts(args, computing=[0], threads_asked=asked) == expected


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
    rank_module.whole_lines()
    print("Training done for epoch", 0)
    print("next")
    assert raw.writes == [b"Training done for epoch 0\n", b"next\n"]


def test_a_signal_without_a_name_is_named_by_its_number():
    """Real-time signals have no name in Python's signal.Signals: a rank killed by one is still
    reported, not a traceback."""
    assert cli.signal_name(signal.SIGKILL) == "SIGKILL"
    assert cli.signal_name(signal.SIGRTMIN + 2) == f"signal {signal.SIGRTMIN + 2}"


@pytest.mark.parametrize("value, threads", [("4,2", 4), (" 3 ", 3), ("", None)])
def test_omp_num_threads_is_read_as_openmp_reads_it(monkeypatch, value, threads):
    """OpenMP reads a list, a number a level of nesting; torch's pool is the first level."""
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    assert cli.omp_num_threads(cli.ArgumentParser()) == threads


@pytest.mark.parametrize("value", ["four", "0", "-2"])
def test_an_omp_num_threads_that_is_not_a_number_of_threads_is_bad_input(monkeypatch, capsys,
                                                                        value):
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    with pytest.raises(SystemExit) as exited:
        rl.parse_args(["--master_port", str(find_free_port())])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and len(err.strip().splitlines()) == 1
    assert f"OMP_NUM_THREADS={value}: not a number of threads" in err


def test_a_rank_killed_by_a_signal_is_said_by_its_command(monkeypatch, capsys):
    """The rank that --rank names, killed (kill -9 of its own process), cannot say so: its
    command does, and ends as a shell reports a killed command, 128 + the signal's number. A
    rank that ended otherwise said why itself: its status, nothing more."""
    monkeypatch.setattr(cli, "launched", _harness_args().harness)
    assert launch.exit_status(SimpleNamespace(exitcode=-signal.SIGKILL)) == 137
    assert capsys.readouterr().err == "trainer_1 (rank 1) was killed by SIGKILL\n"
    assert launch.exit_status(SimpleNamespace(exitcode=1)) == 1
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("exit_code, reason, expected, status", [
    (-9, None, "trainer_2 (rank 2) was killed by SIGKILL; stopped the other ranks", 137),
    (1, "lost contact with trainer_1 (rank 1, silent for 5 s (--rpc_timeout))",
     "trainer_2 (rank 2) lost contact with trainer_1 (rank 1, silent for 5 s (--rpc_timeout)); "
     "stopped the other ranks", 1),
    (3, None, "trainer_2 (rank 2) exited with status 3; stopped the other ranks", 1),
    (143, None, "trainer_2 (rank 2) was interrupted (SIGTERM); stopped every rank", 143),
])
def test_mp_spawns_failed_rank_is_named_with_its_cause(monkeypatch, tmp_path, exit_code, reason,
                                                       expected, status):
    """Under mp.spawn the command says the line: the rank that mp.spawn saw end first, and why
    (its exit code, or the reason it left)."""
    harness = _harness_args().harness
    harness.reasons = str(tmp_path / "reasons")
    monkeypatch.setattr(cli, "launched", harness)
    if reason:
        launch.leave_reason(SimpleNamespace(harness=harness), 2, reason)
    monkeypatch.setattr(launch, "_stop_ranks", lambda wait_first: None)
    ended = []
    monkeypatch.setattr(launch, "_end", lambda line, code: ended.append((line, code)) or 1 / 0)
    failure = mp.ProcessExitedException("", error_index=2, error_pid=1, exit_code=exit_code)
    with pytest.raises(ZeroDivisionError):
        launch.excepthook(type(failure), failure, None)
    assert ended == [(expected, status)]


class _Store:
    """The store's add() and check(), for the wait of rank 0 after the verdict."""

    def __init__(self, read, came):
        self.read = read
        self.came = came

    def add(self, key, amount):
        return self.read

    def check(self, keys):
        return int(keys[0][-1]) in self.came


def test_rank_0_stays_until_the_ranks_that_came_read_the_verdict(monkeypatch):
    """Rank 0 holds the store: once its deadline has passed, it stays for the ranks that came,
    until they have read the verdict (a rank started after rank 0 reads it later than rank 0
    writes it); and never longer than READ_SECONDS after that."""
    monkeypatch.setattr(rendezvous, "POLL_SECONDS", 0.01)
    monkeypatch.setattr(rendezvous, "READ_SECONDS", 0.5)
    passed = time.monotonic() - 1
    started = time.monotonic()
    rendezvous._stay_until_the_verdict_is_read(_Store(read=2, came={0, 1}), 3, passed)
    assert time.monotonic() - started < 0.2  # both that came have read it
    started = time.monotonic()
    rendezvous._stay_until_the_verdict_is_read(_Store(read=1, came={0, 1}), 3, passed)
    assert 0.5 <= time.monotonic() - started < 1.5  # rank 1 never read it: READ_SECONDS


def test_monarch_is_asked_for_only_where_it_has_wheels():
    """torchmonarch's wheels are for Linux and Python 3.10 to 3.13; torch has 3.14's too.
    requirements.txt's marker, evaluated for each: everything else installs on 3.14."""
    from packaging.markers import Marker
    from packaging.requirements import Requirement

    for path in ("requirements.txt", "requirements-newest.txt", "requirements-oldest.txt"):
        lines = (ROOT / path).read_text().splitlines()
        wanted = [Requirement(line) for line in lines if line.strip().startswith("torchmonarch")]
        assert len(wanted) == 1, path
        marker = wanted[0].marker or Marker("python_version >= '0'")
        for python, platform_name, expected in (("3.10", "linux", True),
                                                ("3.13", "linux", True),
                                                ("3.14", "linux", False),
                                                ("3.12", "darwin", False)):
            environment = {"python_version": python, "sys_platform": platform_name}
            assert marker.evaluate(environment) is expected, (path, python, platform_name)


def test_without_a_monarch_for_this_python_the_program_says_why(monkeypatch):
    from rpc_harness import monarch_runs

    monkeypatch.setattr(sys, "version_info", (3, 14, 0, "final", 0))
    assert monarch_runs.monarch_missing() == (
        "Monarch (torchmonarch) has no release for Python 3.14 (its wheels are for 3.10 to "
        "3.13): run this program with one of those; the RPC programs beside it run here")


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
    assert "rpc_harness.exit_status" in calls, path  # a rank killed by a signal is said
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


# --------- A rank killed, stopped or failing mid-run --------------------
#
# One case for each way a rank ends and a way its peers learn of it; bench/faults.py runs every
# entry point, launch mode and fault (make faults). Output merged as a terminal shows it: the
# harness's line must be each terminal's last.

FAULT_INJECTION = ROOT / "bench" / "fault_injection"


def raising(spec, folder):
    """The environment of a run whose rank raises where bench/faults.py makes it raise
    (bench/fault_injection/sitecustomize.py): spec is its FAULTS_RAISE."""
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(FAULT_INJECTION),
                                                         os.environ.get("PYTHONPATH")])),
            "FAULTS_RAISE": spec, "FAULTS_RAISED": str(folder / "raised")}


@pytest.mark.slow
def test_a_killed_rank_is_named_by_every_terminal(runs):
    """SIGKILL of a rank's own process. One rank a terminal (param_server, 3 ranks): its command
    says that it was killed, 137 (128 + 9, as a shell says); the others lose contact, each in
    one line, status 1. Every rank from one command (rl_cartpole): the command names it, 137,
    and nothing listened beyond loopback. Nothing is left running."""
    port = find_free_port()
    terminals = [start(runs, "param_server", "--world_size", 3, "--master_port", port,
                       rank=rank, endless=True, merged=True) for rank in range(3)]
    spawn_all = start(runs, "rl_cartpole", "--master_port", find_free_port(), endless=True,
                      merged=True)
    _wait_any(terminals, RUNS["param_server"].working)
    spawn_all.wait_for_output(RUNS["rl_cartpole"].working, timeout=90)
    assert_listening_on_loopback_only(spawn_all, 2)
    killed_at = time.monotonic()
    os.kill(terminals[1].children()[0], signal.SIGKILL)
    os.kill(spawn_all.children()[1], signal.SIGKILL)
    expected = {terminals[0]: (1, "parameter_server: lost contact with trainer_1 (rank 1, its "
                                  "connection closed); stopping"),
                terminals[1]: (137, "trainer_1 (rank 1) was killed by SIGKILL"),
                terminals[2]: (1, "trainer_2: lost contact with trainer_1 (rank 1, its connection "
                                  "closed, as parameter_server (rank 0) saw); stopping"),
                spawn_all: (137, "observer1 (rank 1) was killed by SIGKILL; stopped the other "
                                 "ranks")}
    for run, (status, line) in expected.items():
        run.wait(timeout=EXIT_BOUND_SECONDS + 30)
        assert time.monotonic() - killed_at < EXIT_BOUND_SECONDS
        assert (run.returncode, run.last_line) == (status, line), run.output
        assert "Traceback" not in run.output and "[W" not in run.output, run.output
        assert not run.leftovers()


@pytest.mark.slow
def test_a_killed_stage_of_a_process_group_alone_ends_the_other(runs):
    """pipelining.py has no RPC, only a process group (Gloo): the stage that holds the store is
    killed; the other, waiting in Gloo's receive, ends in one line."""
    port = find_free_port()
    stages = [start(runs, "pipeline_parallel/pipelining.py", "--master_port", port, rank=rank,
                    endless=True, merged=True) for rank in range(2)]
    _wait_any(stages, RUNS["pipeline_parallel/pipelining.py"].working)
    os.kill(stages[0].children()[0], signal.SIGKILL)
    stages[1].wait(timeout=EXIT_BOUND_SECONDS + 30)
    assert stages[1].returncode == 1
    assert stages[1].last_line == ("stage1: lost contact with stage0 (rank 0, its connection "
                                   "closed); stopping"), stages[1].output
    assert not stages[1].leftovers()


@pytest.mark.slow
def test_a_rank_whose_code_raises_ends_every_rank(runs, tmp_path):
    """The rank's own code raises (an error injected where it calls the harness): one rank a
    terminal (param_server's trainer_1): its traceback, then its line; the others name it.
    Every rank from one command (rl_cartpole's agent): the command prints the rank's traceback,
    which mp.spawn carried, and names it. Status 1; nothing left running."""
    port = find_free_port()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    terminals = [start(runs, "param_server", "--master_port", port, rank=rank, endless=True,
                       merged=True, env=raising("rank profile_step 1 4", tmp_path / "a"))
                 for rank in range(2)]
    spawn_all = start(runs, "rl_cartpole", "--master_port", find_free_port(), endless=True,
                      merged=True, env=raising("rank profile_step 0 4", tmp_path / "b"))
    error = "RuntimeError: an error injected by bench/faults.py"
    expected = {terminals[0]: f"parameter_server: trainer_1 (rank 1) failed ({error}); stopping",
                terminals[1]: f"trainer_1: failed ({error}); the other ranks stop too",
                spawn_all: "agent (rank 0) failed; stopped the other ranks"}
    for run, line in expected.items():
        run.wait(timeout=120)
        assert (run.returncode, run.last_line) == (1, line), run.output
        assert not run.leftovers()
    for run in (terminals[1], spawn_all):
        assert re.search(rf"^Traceback .*\n(.*\n)*{error}\n", run.output, re.M), run.output
    assert "Traceback" not in terminals[0].output


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["per-rank", "spawn-all"])
def test_a_stopped_rank_is_given_up_on_and_told_when_it_resumes(mode, runs):
    """SIGSTOP of a rank's process past --rpc_timeout. One rank a terminal: rank 0 gives up on it
    in one line; resumed (SIGCONT), the rank says that rank 0 gave up on it. Every rank from one
    command: mp.spawn cannot see a silent rank, so the rank that gave up leaves the command the
    reason, and the command names both (and does not wait mp.spawn's 30 s for a stopped rank
    to act on SIGTERM)."""
    port = find_free_port()
    if mode == "per-rank":
        ranks = [start(runs, "param_server", "--master_port", port, "--rpc_timeout", 3,
                       rank=rank, endless=True, merged=True) for rank in (0, 1)]
        _wait_any(ranks, RUNS["param_server"].working)
        trainer = ranks[1].children()[0]
    else:
        command = start(runs, "param_server", "--master_port", port, "--rpc_timeout", 3,
                        endless=True, merged=True)
        command.wait_for_output(RUNS["param_server"].working, timeout=90)
        ranks = [command]
        trainer = command.children()[1]
    os.kill(trainer, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        ranks[0].wait(timeout=30)
    finally:
        os.kill(trainer, signal.SIGCONT)
    assert ranks[0].returncode == 1
    gave_up = "parameter_server (rank 0) gave up on"
    if mode == "spawn-all":
        assert time.monotonic() - stopped_at < 3 + EXIT_BOUND_SECONDS
        assert ranks[0].last_line in (
            "parameter_server (rank 0) lost contact with trainer_1 (rank 1, silent for 3 s "
            "(--rpc_timeout)); stopped the other ranks",
            f"trainer_1 (rank 1) was not heard from for 3 s (--rpc_timeout): {gave_up} it; "
            "stopped the other ranks"), ranks[0].output
        assert not ranks[0].leftovers()
        return
    assert ranks[0].last_line == ("parameter_server: lost contact with trainer_1 (rank 1, silent "
                                  "for 3 s (--rpc_timeout)); stopping"), ranks[0].output
    ranks[1].wait(timeout=30)
    assert ranks[1].returncode == 1
    assert ranks[1].last_line == (f"trainer_1: {gave_up} this rank, which it had not heard "
                                  "from for 3 s (--rpc_timeout); stopping"), ranks[1].output
    assert not ranks[1].leftovers()


@pytest.mark.slow
def test_a_rank_killed_while_profiling_loses_only_its_own_trace(runs, tmp_path):
    """--profile with the windows open for the whole run: SIGKILL trainer_2's process, and the
    parameter server and trainer_1, which end as above, first write what their profilers hold,
    whole (where this torch lets another thread stop the profiler)."""
    traces = tmp_path / "traces"
    common = ["--world_size", 3, "--log_interval", 5, "--profile", traces,
              "--profile_steps", 100000, "--master_port", find_free_port()]
    windows_open = r"^Rank 2 training batch 5 "  # the trainers' windows open after 2 steps
    processes = [start(runs, "param_server", *common, rank=rank, endless=True, merged=True)
                 for rank in range(3)]
    _wait_any(processes, windows_open)
    # the rank's own process, which its command started (killing the command would give the
    # rank its death signal, on which it writes its trace)
    os.kill(processes[2].children()[0], signal.SIGKILL)
    for survivor in processes[:2]:
        survivor.wait(timeout=EXIT_BOUND_SECONDS + 30)
        assert survivor.returncode == 1 and not survivor.leftovers()
        assert survivor.last_line.endswith("; stopping"), survivor.output
    if not profiler_options()[1]:
        assert not list(traces.glob("*.json"))
        pytest.skip("a rank that stops early writes its trace from a thread of its own; this "
                    "torch's profiler can be stopped only by the thread that started it")
    for name in ("parameter_server", "trainer_1"):
        path = traces / f"{name}.json"
        assert path.exists(), "".join(survivor.output for survivor in processes)
        assert json.loads(path.read_text())["rankName"] == name
    assert sorted(path.name for path in traces.iterdir()) == ["parameter_server.json",
                                                              "trainer_1.json"]  # no parts


@pytest.mark.slow
def test_a_killed_command_takes_its_ranks_with_it(runs):
    """SIGKILL of the command a user started: every rank of one command ends too, instead of
    running on unseen; a rank that --rank names says so in its terminal, and the others lose
    contact with it."""
    launcher = start(runs, "pipeline_parallel", "--master_port", find_free_port(), endless=True)
    port = find_free_port()
    ranks = [start(runs, "rl_cartpole", "--master_port", port, rank=rank, endless=True,
                   merged=True) for rank in range(2)]
    launcher.wait_for_output(RUNS["pipeline_parallel"].working, timeout=90)
    _wait_any(ranks, RUNS["rl_cartpole"].working)
    assert len(launcher.children()) == 3
    os.kill(launcher.proc.pid, signal.SIGKILL)
    os.kill(ranks[1].proc.pid, signal.SIGKILL)
    launcher.proc.wait(timeout=10)
    assert not launcher.leftovers(grace=EXIT_BOUND_SECONDS)
    ranks[0].wait(timeout=EXIT_BOUND_SECONDS + 30)
    assert ranks[0].returncode == 1 and ranks[0].last_line == (
        "agent: lost contact with observer1 (rank 1, its connection closed); stopping")
    assert not ranks[1].leftovers(grace=EXIT_BOUND_SECONDS)
    assert ranks[1].last_line == ("observer1: the command that started this rank has ended; "
                                  "stopping"), ranks[1].output


# --------- One terminal per rank: waiting, missing ranks, interrupting, flags that differ -----

WAITING = r"^\S+ \(rank \d+ of \d+\): waiting for the other ranks at localhost:\d+, up to 60 s$"


@pytest.mark.slow
def test_a_rank_that_never_comes_is_named_by_every_rank_that_came(runs):
    """A world of 3, ranks 0 and 1 started (1 a moment later, so that rank 0's --init_timeout
    ends first): both name rank 2, the one that is missing, whichever rank decides (rank 0
    stays, with the store, until rank 1 has read the verdict). Then the last rank of a world
    alone, whose rank 0 never came, of an example whose trainers first meet in a process
    group."""
    port = find_free_port()
    came = [start(runs, "param_server", "--world_size", 3, "--master_port", port,
                  "--init_timeout", 4, rank=0)]
    came[0].wait_for_output(WAITING.replace("60", "4"), timeout=90)
    came.append(start(runs, "param_server", "--world_size", 3, "--master_port", port,
                      "--init_timeout", 4, rank=1))
    alone = start(runs, "ddp_rpc_hybrid", "--master_port", find_free_port(), "--init_timeout", 2,
                  rank=2)
    for run in came:
        run.wait(timeout=90)
        assert run.returncode == 1, run.output
        assert run.stderr.count("\n") == 1, run.stderr
        assert (": trainer_2 (rank 2) did not join at localhost:" in run.stderr
                and "within 4 s (--init_timeout); start it with the same flags" in run.stderr), (
            run.stderr)
        assert not run.leftovers()
    alone.wait(timeout=90)
    assert alone.returncode == 1 and alone.stderr.count("\n") == 1, alone.stderr
    assert "ps: trainer0 (rank 0) did not come: nothing answered at localhost:" in alone.stderr
    assert "within 2 s (--init_timeout)" in alone.stderr
    assert not alone.leftovers()


@pytest.mark.slow
def test_a_waiting_rank_ends_at_once_on_ctrl_c_or_sigterm(runs):
    """A rank alone, waiting for the others (rank 0, which hosts the rendezvous, and a rank that
    waits to reach it), ends within 2 s of SIGINT (Ctrl-C) or SIGTERM with one line."""
    cases = [("param_server", 0, signal.SIGINT, "parameter_server"),
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
def test_ctrl_c_mid_run_is_every_terminals_last_line(runs):
    """Ctrl-C mid-run: to one rank in its terminal (ddp_rpc_hybrid's trainer1, whose loop prints
    its epochs), and to every process of a spawn-all run, as a terminal sends it: each terminal's
    last line is the harness's, none of the loop's lines after it."""
    port = find_free_port()
    ranks = [start(runs, "ddp_rpc_hybrid", "--world_size", 4, "--master_port", port, rank=rank,
                   endless=True, merged=True) for rank in (1, 3, 0, 2)]
    spawn_all = start(runs, "rl_cartpole", "--master_port", find_free_port(), endless=True,
                      merged=True)
    _wait_any(ranks, RUNS["ddp_rpc_hybrid"].working)
    spawn_all.wait_for_output(RUNS["rl_cartpole"].working, timeout=90)
    trainer1 = ranks[0]
    sent = time.monotonic()
    os.killpg(trainer1.proc.pid, signal.SIGINT)
    os.killpg(spawn_all.proc.pid, signal.SIGINT)
    for run in (trainer1, spawn_all):
        run.wait(timeout=30)
        assert time.monotonic() - sent < 2 and run.returncode == 130, run.output
    assert trainer1.last_line == "trainer1: interrupted", trainer1.output
    assert spawn_all.last_line == "interrupted; stopped every rank", spawn_all.output
    for survivor in ranks[1:]:
        survivor.wait(timeout=EXIT_BOUND_SECONDS + 30)
        assert survivor.returncode == 1, survivor.output
        assert re.fullmatch(r"\w+: lost contact with trainer1 \(rank 1, .*\); stopping",
                            survivor.last_line), survivor.output
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


@pytest.mark.slow
def test_every_rank_of_a_mismatched_world_ends_with_the_line(runs):
    """Four ranks of ddp_rpc_hybrid (trainer0, trainer1, master, ps: the trainers meet in a
    process group first, the others in RPC), rank 0 with other flags, started last to first:
    every one ends within --init_timeout (10 s here) of its start with the line that names the
    flag, status 2: rank 0 keeps the store until every rank has read the verdict. make faults
    starts ranks in other orders."""
    port = find_free_port()
    started = {}
    for rank in (3, 2, 1, 0):
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

@pytest.mark.slow
def test_torchrun_runs_every_rank_and_ends_with_its_agent(runs, tmp_path):
    """torchrun's agent starts the commands (one a rank), which it gives no death signal: a run,
    then the agent killed mid-run: every command and rank ends with it."""
    config = RUNS["param_server"]
    script = example_command(config.name, *config.quick, *TCP, "--summary_json",
                             tmp_path / "summary.json")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                str(config.world_size)]
    run = runs.start_command([*torchrun, "--master_port", str(find_free_port()),
                              *script[1:]]).wait(timeout=120)
    assert run.returncode == 0, run.output
    assert json.loads((tmp_path / "summary.json").read_text())["world_size"] == config.world_size
    assert not run.leftovers()
    endless = example_command(config.name, *config.endless, *TCP)
    agent = runs.start_command([*torchrun, "--master_port", str(find_free_port()),
                                *endless[1:]])
    agent.wait_for_output(config.working, timeout=120)
    commands = agent.children()
    assert len(commands) == config.world_size
    os.kill(agent.proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + EXIT_BOUND_SECONDS
    while any(_processes(lambda stat, pid=pid: stat[1] == pid) for pid in commands) or any(
            Path(f"/proc/{pid}").exists() and _proc_state(pid) != "Z" for pid in commands):
        assert time.monotonic() < deadline, "torchrun's commands outlived it"
        time.sleep(0.1)


def _proc_state(pid):
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "Z"
    return stat[stat.rindex(")") + 2:].split()[0]


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
def test_ranks_on_two_hosts(two_hosts, runs, tmp_path):
    """ddp_rpc_hybrid (RPC, and the trainers' process group) with rank 0 on one host and the
    others on another, as on two machines."""
    key = "ddp_rpc_hybrid"
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
