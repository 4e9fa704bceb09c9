"""rpc_harness.monarch_runs, tested once, against rl_cartpole/actors.py (the lighter of the two
Monarch programs: an agent in the controller's process, one observer in a process of its own):
a killed actor process, a hung one, an endpoint's error, Ctrl-C and a killed controller each end
the run in one line (or silently, for the controller), with no process left behind. Every
Monarch program under every fault: make faults."""

import contextlib
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, WHY_NO_MONARCH, _ip, _processes, find_free_port, load_example

pytest.importorskip("monarch.actor", reason=WHY_NO_MONARCH)

monarch_runs = load_example("rl_cartpole", "actors").monarch_runs

# Long enough that the run is still going when a test acts on it.
LONG_RUN = ("--max_episodes", 100000, "--log_interval", 1)


def playing(runs, *flags, env=None):
    """actors.py started, once its episodes have begun: (its run, the observer's pid). Its output
    merged, as its terminal shows it."""
    run = runs.start("rl_cartpole", *LONG_RUN, *flags, script="actors.py", env=env, merged=True)
    run.wait_for_output(r"^Episode 3\t", timeout=120)
    actors = [pid for pid in _processes(lambda stat: stat[2] == run.proc.pid)
              if b"bootstrap_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(actors) == 1, actors  # one observer, in a process that Monarch started
    return run, actors[0]


@pytest.mark.slow
def test_a_killed_observer_ends_the_run_in_one_line_naming_it(runs):
    run, observer = playing(runs)
    killed = time.monotonic()
    os.kill(observer, signal.SIGKILL)
    run.wait(timeout=30)
    seconds = time.monotonic() - killed
    assert run.returncode == 1, run.output
    assert run.last_line == "observer1 was killed by SIGKILL; stopped every process"
    assert "Traceback" not in run.output and "Unhandled monarch error" not in run.output
    # Seen on 2 cores: 0.2-0.6 s (Monarch checks its processes every 500 ms here).
    assert seconds < 5, seconds
    assert not run.leftovers(grace=3)


@pytest.mark.slow
def test_a_hung_observer_ends_the_run_within_call_timeout(runs):
    """SIGSTOP of the observer: the run ends within --call_timeout, and the stopped process
    goes too (the controller kills what it started before its line)."""
    run, observer = playing(runs, "--call_timeout", 3)
    os.kill(observer, signal.SIGSTOP)
    run.wait(timeout=60)
    assert run.returncode == 1, run.output
    assert run.last_line == ("no answer from the observers within 3 s (--call_timeout); stopped "
                             "every process"), run.output
    assert "Traceback" not in run.output
    assert not run.leftovers(grace=3)


@pytest.mark.slow
def test_ctrl_c_ends_every_process(runs):
    """SIGINT to every process of the terminal's group, as Ctrl-C sends it, twice 0.3 s apart:
    the second changes nothing."""
    run, _ = playing(runs)
    for _ in range(2):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.proc.pid, signal.SIGINT)
        time.sleep(0.3)
    run.wait(timeout=30)
    assert run.returncode == 130, run.output
    assert run.last_line == "interrupted; stopped every process"
    assert "Traceback" not in run.output
    assert not run.leftovers(grace=3)


@pytest.mark.slow
def test_an_endpoints_error_is_its_traceback_and_one_line(runs, tmp_path):
    """The observer's own code raises (an error injected in its environment's step, as
    bench/faults.py does): the actor's traceback, then one line naming the endpoint and the
    error, status 1."""
    injection = ROOT / "bench" / "fault_injection"
    env = {"PYTHONPATH": str(injection),
           "FAULTS_RAISE": "actor gymnasium.wrappers.common:TimeLimit.step 40",
           "FAULTS_RAISED": str(tmp_path / "raised")}
    run = runs.start("rl_cartpole", *LONG_RUN, script="actors.py", env=env, merged=True)
    run.wait(timeout=120)
    assert run.returncode == 1, run.output
    error = "RuntimeError: an error injected by bench/faults.py"
    assert run.last_line == (f"Actor call observer.step failed ({error}); stopped every "
                             "process"), run.output
    assert "Traceback of where the remote call failed" in run.output
    assert not run.leftovers(grace=3)


@pytest.mark.slow
def test_a_killed_controller_leaves_no_process(runs):
    run, _ = playing(runs)
    os.kill(run.proc.pid, signal.SIGKILL)
    run.wait(timeout=30)
    assert not run.leftovers(grace=3)  # Monarch's processes die with their parent


def test_describing_a_failure_names_the_actor_and_the_cause():
    class Failure:
        mesh_name = "trainer-4xQz"

        def __init__(self, text):
            self.text = text

        def __repr__(self):
            return self.text

        def report(self):
            return "The actor trainer failed:\n  ValueError: bad batch\n"

    killed = Failure("MeshFailure(mesh_name=trainer-4xQz, crashed_ranks=[1], event=... failed: "
                     "Killed(sig=9))")
    assert monarch_runs.describe(killed, "trainer") == "trainer2 was killed by SIGKILL"
    exited = Failure("MeshFailure(crashed_ranks=[0], event=exited with non-zero code 3)")
    assert monarch_runs.describe(exited, "trainer") == "trainer1 exited with status 3"
    failed = Failure("MeshFailure(crashed_ranks=[0], event=...)")
    assert monarch_runs.describe(failed, "trainer") == "trainer1 failed: ValueError: bad batch"


def test_without_monarch_the_program_says_so_in_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "monarch", None)  # import monarch fails, as if not installed
    monkeypatch.setitem(sys.modules, "monarch.actor", None)
    with pytest.raises(SystemExit) as exited:
        monarch_runs.import_monarch()
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Monarch is missing: `pip install torchmonarch`" in err
    assert err.startswith(f"{Path(sys.argv[0]).name}: error: ")



def _worker(runs, host, address):
    """A Monarch worker (rpc_harness.monarch_worker) in network namespace `host`, serving."""
    worker = runs.start_command(["ip", "netns", "exec", host, sys.executable, "-m",
                                 "rpc_harness.monarch_worker", address], merged=True)
    worker.wait_for_output(r"^monarch_worker: serving at ", timeout=60)
    return worker


def _controller(runs, host, script, *flags):
    """A Monarch program of this repository, started in network namespace `host`."""
    return runs.start_command(["ip", "netns", "exec", host, sys.executable, ROOT / script,
                               *flags], merged=True)


def _in_namespace(host):
    return [int(pid) for pid in _ip("netns", "pids", host, check=False).stdout.split()]


@pytest.mark.slow
def test_processes_on_another_host_and_nothing_left_when_the_controller_dies(two_hosts, runs):
    """The controller on one host, its observer on a worker on another (network namespaces):
    SIGKILL of the controller leaves no process of it on the worker's host within 15 s
    (monarch_runs.ORPHAN_TIMEOUT), and the worker serves the next controller at once, whose
    trainers train there."""
    (host_a, _), (host_b, address_b) = two_hosts
    address = f"tcp://{address_b}:{find_free_port()}"
    worker = _worker(runs, host_b, address)
    controller = _controller(runs, host_a, "rl_cartpole/actors.py", *LONG_RUN, "--workers",
                             address)
    controller.wait_for_output(r"^Episode 3\t", timeout=120)
    orphans = set(_in_namespace(host_b)) - {worker.proc.pid}
    assert orphans  # the observer's process
    os.kill(controller.proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    second = _controller(runs, host_a, "param_server/actors.py", "--dataset", "synthetic",
                         "--world_size", 3, "--max_batches", 6, "--workers", address)
    while orphans & set(_in_namespace(host_b)) and time.monotonic() < killed + 15:
        time.sleep(0.5)
    assert not orphans & set(_in_namespace(host_b))
    second.wait(timeout=120)
    assert second.returncode == 0, second.output
    assert second.last_line.startswith("Summary: accuracy"), second.output
    # The trainers print in the worker's terminal: they run on its host.
    assert re.search(r"^trainer2 trains its copy of the model on cpu", worker.output, re.M)
    ended = time.monotonic()  # and the second controller's processes end with it
    while _in_namespace(host_b) != [worker.proc.pid] and time.monotonic() < ended + 15:
        time.sleep(0.5)
    assert _in_namespace(host_b) == [worker.proc.pid]


@pytest.mark.slow
def test_a_dead_worker_ends_the_controller_in_one_line(two_hosts, runs):
    """SIGKILL of the worker: its processes die with it, and the controller, which hears
    nothing more, ends within --call_timeout in one line, status 1."""
    (host_a, _), (host_b, address_b) = two_hosts
    address = f"tcp://{address_b}:{find_free_port()}"
    worker = _worker(runs, host_b, address)
    controller = _controller(runs, host_a, "rl_cartpole/actors.py", *LONG_RUN, "--workers",
                             address, "--call_timeout", 8)
    controller.wait_for_output(r"^Episode 3\t", timeout=120)
    os.kill(worker.proc.pid, signal.SIGKILL)
    controller.wait(timeout=30)
    assert controller.returncode == 1, controller.output
    assert controller.last_line == ("no answer from the observers within 8 s "
                                    "(--call_timeout); stopped every process"), controller.output
    assert _in_namespace(host_b) == []


@pytest.mark.parametrize("argv, expected", [
    (["--workers", "10.0.0.2:26600"], "--workers: 10.0.0.2:26600: expected tcp://HOST:PORT"),
    (["--workers", "tcp://*:26600"], "expected tcp://HOST:PORT"),
    (["--world_size", "4", "--workers", "tcp://a:1,tcp://b:2"],
     "--workers: 3 observers cannot be shared equally by 2 workers"),
])
def test_bad_workers_are_one_line_and_status_2(capsys, argv, expected):
    with pytest.raises(SystemExit) as exited:
        load_example("rl_cartpole", "actors").parse_args(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert len(err.strip().splitlines()) == 1 and expected in err, err


def test_a_worker_s_address_is_checked_in_one_line(capsys):
    from rpc_harness import monarch_worker

    with pytest.raises(SystemExit) as exited:
        monarch_worker.parse_args(["tcp://*:26600"])
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert len(err.strip().splitlines()) == 1 and "expected tcp://HOST:PORT" in err, err
