"""The harness's ways of ending a run that is under way (rpc_harness), each tested once, end to
end, against one or two examples: a rank killed, its command killed, a rank stopped and
resumed, a rank whose code raises, Ctrl-C mid-run, output that nobody reads, a summary lost at
the end. Before and around the join, torchrun and several hosts: test_failures_joining.py.
Output is merged as a terminal shows it: the harness's line must be each terminal's last. Every
entry point in every launch mode under every fault is make faults' (bench/faults.py); every
entry point in every launch mode, test_launch_modes.py."""

import contextlib
import ipaddress
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import (
    EXIT_BOUND_SECONDS,
    ROOT,
    RUNS,
    TCP,
    _processes,
    example_command,
    find_free_port,
    needs_monarch,
    signal_again_and_again,
    start_run,
)

from rpc_harness.compat import profiler_options

# --------- Runs --------------------

def _wait_any(processes, pattern, timeout=90):
    deadline = time.monotonic() + timeout
    while not any(re.search(pattern, p.output, re.M) for p in processes):
        assert time.monotonic() < deadline, "the run never got under way"
        time.sleep(0.05)


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


# --------- A rank killed, stopped, failing or interrupted mid-run --------------------
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
    """SIGKILL of a rank's own process, every rank from one command (rl_cartpole): the command
    names it, 137 (128 + 9, as a shell says), and nothing listened beyond loopback. Nothing is
    left running. One rank a terminal: the test of a rank killed while profiling, below."""
    spawn_all = start_run(runs, "rl_cartpole", "--master_port", find_free_port(), endless=True,
                          merged=True)
    spawn_all.wait_for_output(RUNS["rl_cartpole"].working, timeout=90)
    assert_listening_on_loopback_only(spawn_all, 2)
    killed_at = time.monotonic()
    os.kill(spawn_all.children()[1], signal.SIGKILL)
    spawn_all.wait(timeout=EXIT_BOUND_SECONDS + 30)
    assert time.monotonic() - killed_at < EXIT_BOUND_SECONDS
    assert (spawn_all.returncode, spawn_all.last_line) == (
        137, "observer1 (rank 1) was killed by SIGKILL; stopped the other ranks"), spawn_all.output
    assert "Traceback" not in spawn_all.output and "[W" not in spawn_all.output, spawn_all.output
    assert not spawn_all.leftovers()


@pytest.mark.slow
def test_a_rank_whose_code_raises_ends_every_rank(runs, tmp_path):
    """The rank's own code raises (an error injected where the agent calls the harness, each
    episode), one rank a terminal: the rank prints its traceback and names its error, and the
    observer names it too. Status 1; nothing left running. A command that names the earliest
    record of its ranks: test_a_stopped_rank_is_given_up_on_and_told_when_it_resumes[spawn-all]."""
    port = find_free_port()
    terminals = [start_run(runs, "rl_cartpole", "--master_port", port, rank=rank, endless=True,
                           merged=True, env=raising("rank profile_step 0 4", tmp_path))
                 for rank in range(2)]
    error = "RuntimeError: an error injected by bench/faults.py"
    expected = {terminals[0]: f"agent: failed ({error})",
                terminals[1]: f"observer1: agent (rank 0) failed ({error})"}
    for run, line in expected.items():
        run.wait(timeout=120)
        assert (run.returncode, run.last_line) == (1, line), run.output
        assert not run.leftovers()
    assert re.search(rf"^Traceback .*\n(.*\n)*{error}\n", terminals[0].output, re.M), (
        terminals[0].output)
    assert "Traceback" not in terminals[1].output


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["per-rank", "spawn-all"])
def test_a_stopped_rank_is_given_up_on_and_told_when_it_resumes(mode, runs):
    """SIGSTOP of the observer's process past --rpc_timeout. One rank a terminal: the agent
    (rank 0) gives up on it in one line; resumed (SIGCONT), the observer says that rank 0 gave
    up on it. Every rank from one command: the agent's record names the silent rank, and the
    command says it (without waiting mp.spawn's 30 s for a stopped rank to act on SIGTERM)."""
    port = find_free_port()
    if mode == "per-rank":
        ranks = [start_run(runs, "rl_cartpole", "--master_port", port, "--rpc_timeout", 3,
                           rank=rank, endless=True, merged=True) for rank in (0, 1)]
        _wait_any(ranks, RUNS["rl_cartpole"].working)
        observer = ranks[1].children()[0]
    else:
        command = start_run(runs, "rl_cartpole", "--master_port", port, "--rpc_timeout", 3,
                            endless=True, merged=True)
        command.wait_for_output(RUNS["rl_cartpole"].working, timeout=90)
        ranks = [command]
        observer = command.children()[1]
    os.kill(observer, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        ranks[0].wait(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):  # spawn-all: its command killed it
            os.kill(observer, signal.SIGCONT)
    assert ranks[0].returncode == 1
    gave_up = "agent (rank 0) gave up on"
    if mode == "spawn-all":
        assert time.monotonic() - stopped_at < 3 + EXIT_BOUND_SECONDS
        assert ranks[0].last_line == ("agent: lost contact with observer1 (rank 1, silent for 3 "
                                      "s (--rpc_timeout)); stopped the other ranks"), (
            ranks[0].output)
        assert not ranks[0].leftovers()
        return
    assert ranks[0].last_line == ("agent: lost contact with observer1 (rank 1, silent for 3 s "
                                  "(--rpc_timeout))"), ranks[0].output
    ranks[1].wait(timeout=30)
    assert ranks[1].returncode == 1
    assert ranks[1].last_line == (f"observer1: {gave_up} this rank, which it had not heard from "
                                  "for 3 s (--rpc_timeout)"), ranks[1].output
    assert not ranks[1].leftovers()


@pytest.mark.slow
def test_a_rank_killed_while_profiling_loses_only_its_own_trace(runs, tmp_path):
    """SIGKILL of a rank's own process, one rank a terminal (rl_cartpole/batch.py, an agent and
    two observers), with --profile and the agent's window open for the whole run: observer2's
    command says that it was killed, 137 (128 + 9, as a shell says); the others lose contact,
    each in one line, status 1, observer1 as the agent (rank 0) told it. Nothing is left
    running. The agent and observer1 first write what their profilers hold, whole (where this
    torch lets another thread stop the profiler)."""
    traces = tmp_path / "traces"
    common = ["--profile", traces, "--profile_steps", 100000, "--master_port", find_free_port()]
    windows_open = r"^Episode 3\t"  # the agent's window opens after 2 episodes
    processes = [start_run(runs, "rl_cartpole/batch.py", *common, rank=rank, endless=True,
                           merged=True) for rank in range(3)]
    _wait_any(processes, windows_open)
    killed_at = time.monotonic()
    # the rank's own process, which its command started (killing the command would give the
    # rank its death signal, on which it writes its trace)
    os.kill(processes[2].children()[0], signal.SIGKILL)
    expected = {processes[0]: (1, "agent: lost contact with observer2 (rank 2, its connection "
                                  "closed)"),
                processes[1]: (1, "observer1: lost contact with observer2 (rank 2, its connection "
                                  "closed, as agent (rank 0) saw)"),
                processes[2]: (137, "observer2 (rank 2) was killed by SIGKILL")}
    for run, (status, line) in expected.items():
        run.wait(timeout=EXIT_BOUND_SECONDS + 30)
        assert time.monotonic() - killed_at < EXIT_BOUND_SECONDS
        assert (run.returncode, run.last_line) == (status, line), run.output
        assert "Traceback" not in run.output and "[W" not in run.output, run.output
        assert not run.leftovers()
    if not profiler_options()[1]:
        assert not list(traces.glob("*.json"))
        pytest.skip("a rank that stops early writes its trace from a thread of its own; this "
                    "torch's profiler can be stopped only by the thread that started it")
    for name in ("agent", "observer1"):
        path = traces / f"{name}.json"
        assert path.exists(), "".join(survivor.output for survivor in processes)
        assert json.loads(path.read_text())["rankName"] == name
    assert sorted(path.name for path in traces.iterdir()) == ["agent.json",
                                                              "observer1.json"]  # no parts


@pytest.mark.slow
def test_a_killed_command_takes_its_ranks_with_it(runs):
    """SIGKILL of the command a user started, one rank a terminal: the rank that --rank names
    ends too (its death signal, SIGHUP), instead of running on unseen, and the others lose
    contact with it. Every rank from one command ends through the same SIGHUP: make faults'
    spawn-all kill-command cells."""
    port = find_free_port()
    ranks = [start_run(runs, "rl_cartpole", "--master_port", port, rank=rank, endless=True,
                       merged=True) for rank in range(2)]
    _wait_any(ranks, RUNS["rl_cartpole"].working)
    os.kill(ranks[1].proc.pid, signal.SIGKILL)
    ranks[0].wait(timeout=EXIT_BOUND_SECONDS + 30)
    assert ranks[0].returncode == 1 and ranks[0].last_line == (
        "agent: lost contact with observer1 (rank 1, its connection closed)")
    assert not ranks[1].leftovers(grace=EXIT_BOUND_SECONDS)
    # Its rank goes silently (the shell says that the command was killed), and removes the
    # folder where the ranks leave their records, which the killed command cannot.
    assert not ranks[1].records_left()


@pytest.mark.slow
def test_ctrl_c_mid_run_is_every_terminals_last_line(runs):
    """Ctrl-C mid-run, pressed again and again, to every process of a spawn-all run
    (rl_cartpole/batch.py), as a terminal sends it; the ranks' loops print every episode, on
    the thread that the harness does not stop: the terminal's last line is the harness's, none
    of the loop's lines after it, no traceback. A rank a terminal: Ctrl-C to its command is
    test_failures_joining.py's test_a_waiting_rank_ends_at_once_on_ctrl_c_or_sigterm, its
    peers' 'lost contact' line test_a_killed_command_takes_its_ranks_with_it's."""
    spawn_all = start_run(runs, "rl_cartpole/batch.py", "--master_port", find_free_port(),
                          endless=True, merged=True)
    spawn_all.wait_for_output(RUNS["rl_cartpole/batch.py"].working, timeout=90)
    sent = time.monotonic()
    signal_again_and_again(spawn_all, signal.SIGINT, 3)
    spawn_all.wait(timeout=30)
    assert time.monotonic() - sent < 4 and spawn_all.returncode == 130, spawn_all.output
    assert "Traceback" not in spawn_all.output, spawn_all.output
    assert spawn_all.last_line == "interrupted; stopped every rank", spawn_all.output
    assert not spawn_all.leftovers()
    assert not spawn_all.records_left()


# --------- Output that nobody reads, and a summary lost at the end --------------------

def _read_lines_then_close(cmd, lines, tmp_path, timeout=120):
    """Start `cmd` with its standard output into a pipe, as `cmd | head -LINES` does: read that
    many lines, then close the pipe. Its standard error goes to a file, as to a terminal that
    still shows it. Returns (the process, ended, what it wrote on standard error)."""
    err_path = tmp_path / f"stderr-{len(list(tmp_path.glob('stderr-*')))}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp_path)}
    with open(err_path, "w") as err:
        process = subprocess.Popen([str(part) for part in cmd], stdout=subprocess.PIPE,
                                   stderr=err, cwd=ROOT, env=env, start_new_session=True)
    try:
        for _ in range(lines):
            assert process.stdout.readline(), "the run ended before it printed enough lines"
        process.stdout.close()
        process.wait(timeout=timeout)
        # what is left 10 s on, polled, as Run.leftovers() does: multiprocessing's resource
        # tracker ends a moment after the command
        deadline = time.monotonic() + 10
        while (left := _processes(lambda stat: stat[2] == process.pid)) and \
                time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    return process, left, err_path.read_text()


@pytest.mark.slow
def test_a_closed_pipe_ends_the_run_quietly(tmp_path):
    """`python rl_cartpole/actors.py | head -3`, the Monarch program: once the pipe is closed,
    every process ends, nothing is said (no traceback), and the status is the one a shell gives
    a writer whose pipe closed (141). An RPC program's: the test below."""
    needs_monarch()
    cmd = example_command("rl_cartpole", "--max_episodes", 100000, "--log_interval", 1,
                          script="actors.py")
    process, left, stderr = _read_lines_then_close(cmd, 3, tmp_path)
    assert process.returncode == 128 + signal.SIGPIPE, stderr
    assert "Traceback" not in stderr and "Error" not in stderr, stderr
    assert not left


@pytest.mark.slow
def test_a_rank_whose_pipe_closed_is_named_by_its_peers(runs, tmp_path):
    """A rank a terminal: trainer1's output piped into a program that stops reading. trainer1
    prints inside a call that the parameter server made by RPC (batch.py's trainers train
    there), where the error would go back to the caller. trainer1 ends quietly (141, no
    traceback nor error, nothing left running); each other terminal says why in one line."""
    config = RUNS["param_server/batch.py"]
    port = find_free_port()
    others = [start_run(runs, "param_server/batch.py", "--master_port", port, rank=rank,
                        endless=True, merged=True) for rank in (0, 2)]
    trainer_cmd = example_command(config.name, *config.endless, *TCP, "--world_size",
                                  config.world_size, "--rank", 1, "--master_port", port,
                                  script=config.script)
    process, left, stderr = _read_lines_then_close(trainer_cmd, 5, tmp_path)
    assert process.returncode == 128 + signal.SIGPIPE, stderr
    assert "Traceback" not in stderr and "Error" not in stderr, stderr
    assert not left
    for other in others:
        other.wait(timeout=EXIT_BOUND_SECONDS + 30)
        assert other.returncode == 1, other.output
        assert "Traceback" not in other.output, other.output
        assert "trainer1 (rank 1)" in other.last_line, other.output
        assert "output was closed" in other.last_line, other.output
        assert not other.leftovers()


@pytest.mark.slow
def test_a_summary_file_lost_at_the_end_is_told_after_the_figures(runs, tmp_path):
    """The folder of --summary_json goes away mid-run (as a disk fills): the Summary line is
    printed, then one line naming the file, status 1."""
    folder = tmp_path / "going"
    folder.mkdir()
    run = start_run(runs, "rl_cartpole", "--max_episodes", 20, "--log_interval", 1,
                    "--summary_json", folder / "summary.json", "--master_port", find_free_port(),
                    merged=True)
    run.wait_for_output(r"^Episode 2\t", timeout=120)
    folder.rmdir()
    run.wait(timeout=120)
    assert run.returncode == 1, run.output
    lines = [line for line in run.output.splitlines() if line.strip()]
    assert lines[-2].startswith("Summary: 20 episodes"), run.output
    assert "--summary_json" in lines[-1] and "not written" in lines[-1], run.output
    assert not run.leftovers()
