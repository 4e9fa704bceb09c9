"""rpc_harness.monarch_runs, tested once, against rl_cartpole/actors.py (the lighter of the two
Monarch programs: an agent in the controller's process, one observer in a process of its own):
a killed actor process, a hung one, an endpoint's error, Ctrl-C and a killed controller each end
the run in one line (or silently, for the controller), with no process left behind. Every
Monarch program under every fault: make faults."""

import os
import signal
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, WHY_NO_MONARCH, _processes, load_example

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
    """SIGINT to every process of the terminal's group, as Ctrl-C sends it."""
    run, _ = playing(runs)
    os.killpg(run.proc.pid, signal.SIGINT)
    run.wait(timeout=30)
    assert run.returncode == 130, run.output
    assert run.last_line == "interrupted; stopped every process"
    assert "Traceback" not in run.output
    assert not run.leftovers(grace=3)


@pytest.mark.slow
def test_an_endpoints_error_is_its_traceback_and_one_line(runs, tmp_path):
    """The observer's own code raises (an error injected where it calls monarch_runs, as
    bench/faults.py does): the actor's traceback, then one line naming the endpoint and the
    error, status 1."""
    injection = ROOT / "bench" / "fault_injection"
    env = {"PYTHONPATH": str(injection), "FAULTS_RAISE": "actor get 40",
           "FAULTS_RAISED": str(tmp_path / "raised")}
    run = runs.start("rl_cartpole", *LONG_RUN, script="actors.py", env=env, merged=True)
    run.wait(timeout=120)
    assert run.returncode == 1, run.output
    error = "RuntimeError: an error injected by bench/faults.py"
    assert run.last_line == (f"Actor call observer.run_episode failed ({error}); stopped every "
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
    assert monarch_runs._describe(killed, "trainer") == "trainer2 was killed by SIGKILL"
    exited = Failure("MeshFailure(crashed_ranks=[0], event=exited with non-zero code 3)")
    assert monarch_runs._describe(exited, "trainer") == "trainer1 exited with status 3"
    failed = Failure("MeshFailure(crashed_ranks=[0], event=...)")
    assert monarch_runs._describe(failed, "trainer") == "trainer1 failed: ValueError: bad batch"


def test_without_monarch_the_program_says_so_in_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "monarch", None)  # import monarch fails, as if not installed
    monkeypatch.setitem(sys.modules, "monarch.actor", None)
    with pytest.raises(SystemExit) as exited:
        monarch_runs.import_monarch()
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Monarch is missing: `pip install torchmonarch`" in err
    assert err.startswith(f"{Path(sys.argv[0]).name}: error: ")

