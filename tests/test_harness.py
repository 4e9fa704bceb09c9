"""The harness (rpc_harness), in-process, against one or two examples: the command line, the
join (the flags compared, the peers' tokens, the store's failures, the verdict's wait), the
rank's loop (what it reads, the reasons it leaves for mp.spawn's command), the command's lines,
the cores, whole lines, --profile's merge, the summary, the requirements' markers; and what
every example keeps: the tutorial's calls in main.py, no import cycles. How runs end, end to
end: test_failures.py."""

import ast
import io
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.multiprocessing as mp
from conftest import ROOT, _processes, find_free_port, load_example

from rpc_harness import cli, launch, rendezvous
from rpc_harness import rank as rank_module

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


def test_a_rank_0_that_never_comes_is_said_at_the_deadline(monkeypatch, ends):
    """Nothing listens where rank 0 should: the wait ends at --init_timeout, not later (torch's
    store client, left to itself, took 12 s for a timeout of 8)."""
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(_Ended) as ended:
        rendezvous._open_store(_harness_args(), 1, "127.0.0.1", port, started + 1)
    assert 1 <= time.monotonic() - started < 2
    line, status = ended.value.args
    assert line == (f"trainer_1: parameter_server (rank 0) did not come: nothing answered at "
                    f"127.0.0.1:{port} within 5 s (--init_timeout); start it with the same "
                    "flags") and status == 1


def test_a_store_that_goes_away_is_said_with_its_cause(monkeypatch, ends):
    def store(*args, **kwargs):
        raise RuntimeError("Connection reset by peer")
    monkeypatch.setattr(rendezvous.dist, "TCPStore", store)
    monkeypatch.setattr(rendezvous, "_wait_for_a_listener", lambda *args: True)
    monkeypatch.setattr(rendezvous.time, "sleep", lambda seconds: None)
    with pytest.raises(_Ended) as ended:
        rendezvous._open_store(_harness_args(), 1, "localhost", 1, time.monotonic() + 30)
    line, status = ended.value.args
    assert line == ("trainer_1: cannot reach parameter_server (rank 0)'s store at localhost:1 "
                    "(Connection reset by peer)") and status == 1


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


# --------- The real command line --------------------

@pytest.mark.slow
def test_bad_input_on_the_real_command_line(runs):
    run = runs.start("rl_cartpole", "--world_size", "1").wait(timeout=60)
    assert run.returncode == 2 and run.stdout == ""
    assert len(run.stderr.strip().splitlines()) == 1 and "must be at least" in run.stderr
    assert not run.leftovers(grace=3)  # the resource tracker ends just after
