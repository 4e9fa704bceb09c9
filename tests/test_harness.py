"""The harness (rpc_harness) through its public names, in-process, against one or two examples:
the command line, the join's lines for programs and flags that differ, rank 0's wait for its
peers, the cores, whole lines, --profile's merge, the requirements' markers; and what every
example keeps: the tutorial's calls in main.py, no import cycles. How runs end, end to end:
test_failures.py and test_failures_joining.py."""

import ast
import contextlib
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
from conftest import ROOT, _processes, find_free_port, load_example

from rpc_harness import cli, ending, rendezvous
from rpc_harness.ending import whole_lines

rl = load_example("rl_cartpole")  # the example that starts quickest


# --------- The command line, in-process --------------------

GENERIC_BAD_INPUTS = [
    (["--world_size", "1"], "must be at least 2"),
    (["--world_size", "x"], "--world"),  # argparse words it its own way
    (["--rank", "-1"], "must be at least 0"),
    (["--rank", "64"], "outside a world of"),
    (["--seed", "-3"], "must be at least 0"),
    (["--master_port", "0"], "from 1 to 65535"),
    (["--master_port", "99999"], "from 1 to 65535"),
    (["--master_port", "http"], "--master_port"),
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
    """Every flag but those of a rank's own machine is compared at the join, and the program
    that runs (its folder and script), so that a rank of another program is refused."""
    monkeypatch.setattr(sys, "argv", ["/somewhere/rl_cartpole/batch.py"])
    args = rl.parse_args(["--rank", "1", "--master_port", str(find_free_port()),
                          "--summary_json", "s.json", "--rpc_timeout", "9", "--gamma", "0.5"])
    plan = args.harness
    assert plan.program == "rl_cartpole/batch.py"
    assert plan.flags["gamma"] == 0.5 and plan.flags["world_size"] == 2
    assert not set(plan.flags) & {"rank", "master_port", "summary_json", "rpc_timeout",
                                  "torchrun"}
    assert plan.names == ["agent", "observer1"] and plan.loops == [0]
    assert not plan.spawn_all


def _claim(name, program, **flags):
    return {"name": name, "program": program, "flags": {"world_size": 3, "lr": 0.03, **flags}}


def test_two_programs_on_one_port_are_told_by_their_names():
    """Ranks of two programs that meet on one port: the line names the programs, not every
    flag in which they differ."""
    claims = {0: _claim("parameter_server", "param_server/main.py"),
              1: _claim("trainer1", "param_server/batch.py", batch_update_size=2),
              2: _claim("observer2", "rl_cartpole/main.py", gamma=0.99)}
    assert rendezvous.differences(claims) == (
        "rank 0 (parameter_server) runs param_server/main.py, but rank 1 (trainer1) runs "
        "param_server/batch.py; rank 2 (observer2) runs rl_cartpole/main.py: start every rank "
        "with the same program")


def test_the_line_for_flags_that_differ_names_every_rank_and_flag():
    """One program, ranks that differ from rank 0 in other ways: the world size first."""
    claims = {0: _claim("parameter_server", "param_server/main.py"),
              1: _claim("trainer_1", "param_server/main.py"),
              2: _claim("trainer_2", "param_server/main.py", world_size=4, lr=0.1)}
    assert rendezvous.differences(claims) == (
        "the ranks were started with different flags: --world_size is 3 on rank 0 "
        "(parameter_server) but 4 on rank 2 (trainer_2); --lr is 0.03 on rank 0 "
        "(parameter_server) but 0.1 on rank 2 (trainer_2); start every rank with the same values")
    assert rendezvous.differences({0: claims[0], 1: claims[1]}) == ""


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
    peers = rendezvous.accept_peers(listener, claims, time.monotonic() + 10)
    assert sorted(peers) == [1, 2]
    for client in clients:
        client.close()
    for sock in peers.values():
        sock.close()
    listener.close()


def test_stray_connections_do_not_keep_rank_0_past_its_bound():
    """Connections that say nothing hold rank 0's wait for its peers no longer than its bound:
    it ends with an error at the bound, not a read's timeout per stray later."""
    listener = socket.create_server(("127.0.0.1", 0))
    strays = [socket.create_connection(listener.getsockname()) for _ in range(3)]
    started = time.monotonic()
    with pytest.raises(OSError):
        rendezvous.accept_peers(listener, {0: {}, 1: {"token": "t"}}, started + 1)
    assert time.monotonic() - started < 1.5
    for sock in [*strays, listener]:
        sock.close()


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
    assert cli.threads_per_rank(args, computing=[0]) == expected


def test_a_python_without_the_harness_is_told_how_to_set_up():
    """A Python with torch but without this project's package (a copied folder, say): the
    import fails, and Python's traceback shows main.py's line, which says how to install it."""
    script = ("import runpy, sys; sys.modules['rpc_harness'] = None; sys.argv = ['main.py']; "
              "runpy.run_path('main.py', run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT / "param_server",
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == ""
    assert "import rpc_harness  # ours: this project's package: `make run` installs it" in (
        done.stderr)


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
    whole_lines()
    print("Training done for epoch", 0)
    print("next")
    assert raw.writes == [b"Training done for epoch 0\n", b"next\n"]


def test_a_write_to_a_closed_pipe_goes_nowhere_and_the_rank_is_told(monkeypatch):
    """A rank's output is a pipe whose reader has gone (`| head`). A print in another thread (as
    in a call that a peer made by RPC) and a logging.basicConfig handler's line raise nothing and
    print no "--- Logging error ---": each tells the rank, which ends as the reader asked."""
    import logging
    import threading

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader has gone
    closed_stdout = io.TextIOWrapper(open(write_end, "wb", closefd=True), line_buffering=True)
    errors = io.StringIO()
    told = []
    try:
        with monkeypatch.context() as patched:
            patched.setattr(sys, "stdout", closed_stdout)
            patched.setattr(sys, "stderr", errors)
            logger = logging.getLogger("a rank's logger")
            patched.setattr(logger, "handlers", [logging.StreamHandler(sys.stdout)])
            patched.setattr(logger, "propagate", False)
            ending.quiet_when_closed(lambda: told.append("closed"))
            in_another_thread = threading.Thread(target=print, args=("Rank 1 training batch 2",))
            in_another_thread.start()
            in_another_thread.join()
            printed_told = list(told)
            logger.warning("worker1 successfully initialized RPC.")
            logged_told = told[len(printed_told):]
    finally:
        with contextlib.suppress(BrokenPipeError):  # its last flush has nowhere to go
            closed_stdout.close()
    assert printed_told, "the print did not tell"
    assert logged_told, "the logging handler's line did not tell"
    assert errors.getvalue() == ""


def test_a_signal_without_a_name_is_named_by_its_number():
    """Real-time signals have no name in Python's signal.Signals: a rank killed by one is still
    reported, not a traceback."""
    assert ending.signal_name(signal.SIGKILL) == "SIGKILL"
    assert ending.signal_name(signal.SIGRTMIN + 2) == f"signal {signal.SIGRTMIN + 2}"


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


def test_the_newest_pins_give_every_claimed_python_one_release_of_each_package():
    """requirements-newest.txt pins each package once for every Python that pyproject.toml
    claims (3.10 to 3.14), its markers evaluated for each: where the newest release has no
    wheel for an older Python, that Python gets the newest one that does."""
    from packaging.requirements import Requirement

    lines = (ROOT / "requirements-newest.txt").read_text().splitlines()
    pins = [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]
    for python in ("3.10", "3.11", "3.12", "3.13", "3.14"):
        environment = {"python_version": python, "sys_platform": "linux"}
        chosen = [pin.name for pin in pins
                  if pin.marker is None or pin.marker.evaluate(environment)]
        assert len(chosen) == len(set(chosen)), (python, chosen)
        assert {"torch", "torchvision", "numpy", "gymnasium"} <= set(chosen), python
        assert ("torchmonarch" in chosen) == (python != "3.14")


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
    # the harness's two calls in the command: its line, and the status of the rank it started
    assert {"rpc_harness.supervise", "rpc_harness.exit_status"} <= set(calls), path
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

