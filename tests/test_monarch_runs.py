"""rpc_harness.monarch_runs, tested once, against param_server/actors.py: a killed actor process,
a hung one, Ctrl-C and a killed controller each end the run in one line (or silently, for the
controller), with no process left behind."""

import os
import re
import signal
import sys
import time

import pytest
from conftest import load_example

pytest.importorskip("monarch.actor", reason="torchmonarch is not installed")

monarch_runs = load_example("param_server", "actors").monarch_runs

# Long enough that the run is still training when a test acts on it.
LONG_RUN = ("--world_size", 3, "--dataset", "synthetic", "--max_batches", 100000,
            "--log_interval", 10)
TRAINER_LINE = re.compile(r"^trainer(\d) trains its copy of the model on \S+, in process (\d+)$",
                          re.M)


def training(runs, *flags):
    """actors.py started, once both trainers train: (its run, {trainer rank: pid})."""
    run = runs.start("param_server", *LONG_RUN, *flags, script="actors.py")
    run.wait_for_output(r"^Rank 2 training batch 10 loss", timeout=120)
    run.wait_for_output(r"^Rank 1 training batch 10 loss", timeout=30)
    pids = {int(rank): int(pid) for rank, pid in TRAINER_LINE.findall(run.stdout)}
    assert set(pids) == {1, 2}, run.stdout
    return run, pids


def last_line(run):
    return run.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_a_killed_trainer_ends_the_run_in_one_line_naming_it(runs):
    run, pids = training(runs)
    killed = time.monotonic()
    os.kill(pids[2], signal.SIGKILL)
    run.wait(timeout=30)
    seconds = time.monotonic() - killed
    assert run.returncode == 1, run.output
    assert last_line(run) == "trainer2 was killed by SIGKILL; stopped every process"
    assert "Traceback" not in run.output and "Unhandled monarch error" not in run.output
    # Seen on 2 cores: 0.3-0.6 s (Monarch checks its processes every 500 ms here).
    assert seconds < 5, seconds
    assert not run.leftovers(grace=3)


@pytest.mark.slow
def test_a_hung_trainer_ends_the_run_within_call_timeout(runs):
    run, pids = training(runs, "--call_timeout", 3)
    os.kill(pids[1], signal.SIGSTOP)
    run.wait(timeout=60)
    assert run.returncode == 1, run.output
    # The other trainer waits for a model that needs trainer1's gradient, and gives up; or the
    # controller, seeing no gradient come, does first.
    assert re.fullmatch(r".*no (answer from the parameter server|gradient reached the parameter "
                        r"server) within 3 s \(--call_timeout\); stopped every process",
                        last_line(run)), run.stderr
    assert "Traceback" not in run.output
    run.kill_session()  # the stopped trainer cannot act on its parent's death until continued
    assert not run.leftovers(grace=3)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["controller", "terminal"])
def test_ctrl_c_ends_every_process(runs, target):
    """SIGINT to the controller alone, or to every process of the terminal's group."""
    run, _ = training(runs)
    if target == "controller":
        os.kill(run.proc.pid, signal.SIGINT)
    else:
        os.killpg(run.proc.pid, signal.SIGINT)
    run.wait(timeout=30)
    assert run.returncode == 130, run.output
    assert last_line(run) == "interrupted"
    assert "Traceback" not in run.output
    assert not run.leftovers(grace=3)


@pytest.mark.slow
def test_a_killed_controller_leaves_no_process(runs):
    run, _ = training(runs)
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

