"""How the Monarch programs (param_server/actors.py, rl_cartpole/actors.py) end, tested against
rl_cartpole/actors.py (the lighter: an agent in the controller's process, one observer in a
process of its own), and their processes on another host. The plain command: a killed observer
and a hung one each end it in one line (monarch_extras.py); under rpcrun: Ctrl-C and a killed
controller, in rpcrun's line. No process is left behind. Every Monarch program under every
fault: make faults; the tests marked `faults` are cells of its matrix, and make test leaves
them to make test-oldest (pyproject.toml's marker says why)."""

import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    WHY_NO_MONARCH,
    _ip,
    _processes,
    find_free_port,
    load_actors,
    load_example,
    supervised_command,
)

# Long enough that the run is still going when a test acts on it.
LONG_RUN = ("--max_episodes", 100000, "--log_interval", 1)
# Each process's share of the 2 cores, as rpcrun gives it: torch's default, every core in every
# process, makes Monarch's programs several times slower on a busy machine.
THREADS = {"OMP_NUM_THREADS": "1"}


def actor_processes(pid):
    """The processes that Monarch started for the controller `pid`: its children."""
    return [child for child in _processes(lambda stat: stat[1] == pid)
            if b"bootstrap_main" in Path(f"/proc/{child}/cmdline").read_bytes()]


def playing(runs, *flags, rpcrun=False):
    """rl_cartpole/actors.py started (plain, or under rpcrun), once its episodes have begun:
    (its run, the controller's pid, the observer's pid). Its output merged, as its terminal
    shows it."""
    if rpcrun:
        run = runs.start_command(supervised_command("rl_cartpole", *LONG_RUN, *flags,
                                                    script="actors.py"), merged=True)
    else:
        run = runs.start("rl_cartpole", *LONG_RUN, *flags, script="actors.py", env=THREADS,
                         merged=True)
    run.wait_for_output(r"^Episode 3\t", timeout=120)
    controller = run.proc.pid
    if rpcrun:
        (controller,) = _processes(lambda stat: stat[1] == run.proc.pid)
    (observer,) = actor_processes(controller)  # one observer, in a process that Monarch started
    return run, controller, observer


# --------- The plain command: its own line --------------------

@pytest.mark.slow
def test_a_killed_observer_ends_the_run_in_one_line_naming_it(runs):
    """Monarch's supervision names the process, and why, within 1 s. Under a load of 12 on 2
    cores, 2 runs in 15 met a check of Monarch's on the process under way as it died, which
    waited 30 s for an answer and then said that "the process likely crashed": --call_timeout
    is longer here, so that its own line does not come first."""
    load_actors("rl_cartpole")  # skipped where Monarch is not installed
    run, _, observer = playing(runs, "--call_timeout", 90)
    os.kill(observer, signal.SIGKILL)
    run.wait(timeout=60)
    assert run.returncode == 1, run.output
    assert re.fullmatch(r"observer1 (was killed by SIGKILL|failed: .* likely crashed\.?); "
                        r"stopped every process", run.last_line), run.output
    assert "Traceback" not in run.output and "Unhandled monarch error" not in run.output
    assert not run.leftovers(grace=5)


@pytest.mark.slow
@pytest.mark.faults
def test_a_hung_observer_ends_the_run_within_call_timeout(runs):
    """SIGSTOP of the observer: the run ends at --call_timeout, and the stopped process goes
    too."""
    load_actors("rl_cartpole")
    run, _, observer = playing(runs, "--call_timeout", 5)
    os.kill(observer, signal.SIGSTOP)
    run.wait(timeout=60)
    assert run.returncode == 1, run.output
    assert run.last_line == ("no answer from the observers within 5 s (--call_timeout); stopped "
                             "every process"), run.output
    assert "Traceback" not in run.output
    assert not run.leftovers(grace=5)


# --------- Under rpcrun: rpcrun's line --------------------

@pytest.mark.slow
@pytest.mark.faults
def test_ctrl_c_under_rpcrun_ends_every_process_in_one_line(runs):
    """Ctrl-C reaches rpcrun (the command runs on a terminal of its own), which ends the
    controller and Monarch's processes."""
    load_actors("rl_cartpole")
    run, _, _ = playing(runs, rpcrun=True)
    os.killpg(run.proc.pid, signal.SIGINT)
    run.wait(timeout=30)
    assert (run.last_line, run.returncode) == (
        "rpcrun: interrupted (Ctrl-C); ended every rank", 130), run.output
    assert "Traceback" not in run.output
    assert not run.leftovers(grace=5)


@pytest.mark.slow
@pytest.mark.faults
def test_a_killed_controller_under_rpcrun_leaves_no_process(runs):
    load_actors("rl_cartpole")
    run, controller, _ = playing(runs, rpcrun=True)
    os.kill(controller, signal.SIGKILL)
    run.wait(timeout=30)
    assert (run.last_line, run.returncode) == ("rpcrun: actors.py was killed by SIGKILL",
                                               137), run.output
    assert not run.leftovers(grace=5)  # Monarch's processes die with their controller


# --------- What the programs say, in-process --------------------

def test_describing_a_failure_names_the_actor_and_the_cause():
    monarch_extras = load_example("param_server", "monarch_extras")

    class Failure:
        def __init__(self, text):
            self.text = text

        def __repr__(self):
            return self.text

        def report(self):
            return "The actor trainer failed:\n  ValueError: bad batch\n"

    killed = Failure("MeshFailure(mesh_name=trainer-4xQz, crashed_ranks=[1], event=... failed: "
                     "Killed(sig=9))")
    assert monarch_extras.describe(killed, "trainer") == "trainer2 was killed by SIGKILL"
    exited = Failure("MeshFailure(crashed_ranks=[0], event=exited with non-zero code 3)")
    assert monarch_extras.describe(exited, "trainer") == "trainer1 exited with status 3"
    failed = Failure("MeshFailure(crashed_ranks=[0], event=...)")
    assert monarch_extras.describe(failed, "trainer") == "trainer1 failed: ValueError: bad batch"


@pytest.mark.parametrize("example", ["param_server", "rl_cartpole"])
def test_without_monarch_the_program_says_so_in_one_line(monkeypatch, capsys, example):
    monarch_extras = load_example(example, "monarch_extras")
    monkeypatch.setitem(sys.modules, "monarch", None)  # import monarch fails, as if not installed
    monkeypatch.setitem(sys.modules, "monarch.actor", None)
    with pytest.raises(SystemExit) as exited:
        monarch_extras.import_monarch()
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Monarch is missing: `pip install torchmonarch`" in err
    assert err.startswith(f"{Path(sys.argv[0]).name}: error: ")


@pytest.mark.parametrize("argv, expected", [
    (["--workers", "10.0.0.2:26600"], "--workers: 10.0.0.2:26600: expected tcp://HOST:PORT"),
    (["--workers", "tcp://*:26600"], "expected tcp://HOST:PORT"),
    (["--world_size", "4", "--workers", "tcp://a:1,tcp://b:2"],
     "--workers: 3 observers cannot be shared equally by 2 workers"),
    (["--serve", "tcp://*:26600"], "--serve: tcp://*:26600: expected tcp://HOST:PORT"),
])
def test_bad_workers_are_one_line_and_status_2(capsys, argv, expected):
    with pytest.raises(SystemExit) as exited:
        load_actors("rl_cartpole").parse_args(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert len(err.strip().splitlines()) == 1 and expected in err, err


# --------- Two hosts --------------------

def _in_namespace(host):
    return [int(pid) for pid in _ip("netns", "pids", host, check=False).stdout.split()]


def _start(runs, host, *flags):
    """rl_cartpole/actors.py in network namespace `host` (a host of its own)."""
    script = Path(__file__).resolve().parent.parent / "rl_cartpole" / "actors.py"
    return runs.start_command(["ip", "netns", "exec", host, sys.executable, script,
                               *map(str, flags)], env=THREADS, merged=True)


@pytest.mark.slow
def test_observers_on_another_host_and_nothing_left_when_the_controller_dies(two_hosts, runs):
    """The controller on one host, its observer on a worker on another (network namespaces,
    `actors.py --serve`): SIGKILL of the controller leaves no process of it on the worker's host
    within 30 s (HYPERACTOR_MESH_ORPHAN_TIMEOUT, 5 s, and the teardown on a busy machine), and
    the worker serves the next controller at once. Ctrl-C ends the worker in one line, its
    processes with it."""
    pytest.importorskip("monarch.actor", reason=WHY_NO_MONARCH)
    (host_a, _), (host_b, address_b) = two_hosts
    address = f"tcp://{address_b}:{find_free_port()}"
    worker = _start(runs, host_b, "--serve", address)
    worker.wait_for_output(rf"^serving at {address}; Ctrl-C ends it$", timeout=60)
    first = _start(runs, host_a, *LONG_RUN, "--workers", address)
    first.wait_for_output(r"^Episode 3\t", timeout=120)
    orphans = set(_in_namespace(host_b)) - {worker.proc.pid}
    assert orphans  # the observer's process, on the worker's host
    os.kill(first.proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    second = _start(runs, host_a, "--max_episodes", 3, "--log_interval", 1, "--workers",
                    address)
    # Monarch ends an orphan after 5 s (HYPERACTOR_MESH_ORPHAN_TIMEOUT); its teardown then
    # took more than 10 s once, with two CI runs sharing 2 cores: 30 s bound, polled
    while orphans & set(_in_namespace(host_b)) and time.monotonic() < killed + 30:
        time.sleep(0.5)
    assert not orphans & set(_in_namespace(host_b))
    second.wait(timeout=120)
    assert second.returncode == 0, second.output
    assert second.last_line.startswith("Summary: 3 episodes"), second.output
    ended = time.monotonic()  # and the second controller's processes end with it
    while _in_namespace(host_b) != [worker.proc.pid] and time.monotonic() < ended + 15:
        time.sleep(0.5)
    assert _in_namespace(host_b) == [worker.proc.pid]
    worker.proc.send_signal(signal.SIGINT)
    worker.wait(timeout=30)
    assert (worker.last_line, worker.returncode) == (
        "interrupted (Ctrl-C); stopped every process", 130), worker.output
    assert _in_namespace(host_b) == []
