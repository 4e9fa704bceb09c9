"""The harness's ways of ending a run (rpc_harness), each tested once, end to end, against one
or two examples: a rank killed, its command killed, a rank stopped and resumed, a rank whose
code raises, Ctrl-C and SIGTERM, a rank that never comes, flags that differ, a rank taken
twice; torchrun and several hosts. Output is merged as a terminal shows it: the harness's line
must be each terminal's last. Every entry point in every launch mode under every fault is
make faults' (bench/faults.py); every entry point in every launch mode, test_launch_modes.py."""

import contextlib
import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    ROOT,
    RUNS,
    TCP,
    _processes,
    example_command,
    find_free_port,
    needs_monarch,
)

from rpc_harness.compat import profiler_options

# How long the other ranks may take to exit after one is killed. Measured: well under a second
# when the machine is idle (a dead process's connections close at once); the bound leaves room
# for a loaded 2-core CI machine.
EXIT_BOUND_SECONDS = 20


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
    """SIGKILL of a rank's own process, every rank from one command (rl_cartpole): the command
    names it, 137 (128 + 9, as a shell says), and nothing listened beyond loopback. Nothing is
    left running. One rank a terminal: the test of a rank killed while profiling, below."""
    spawn_all = start(runs, "rl_cartpole", "--master_port", find_free_port(), endless=True,
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
    terminals = [start(runs, "rl_cartpole", "--master_port", port, rank=rank, endless=True,
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
        ranks = [start(runs, "rl_cartpole", "--master_port", port, "--rpc_timeout", 3,
                       rank=rank, endless=True, merged=True) for rank in (0, 1)]
        _wait_any(ranks, RUNS["rl_cartpole"].working)
        observer = ranks[1].children()[0]
    else:
        command = start(runs, "rl_cartpole", "--master_port", port, "--rpc_timeout", 3,
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
    processes = [start(runs, "rl_cartpole/batch.py", *common, rank=rank, endless=True,
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
    ranks = [start(runs, "rl_cartpole", "--master_port", port, rank=rank, endless=True,
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


# --------- One terminal per rank: waiting, missing ranks, interrupting, flags that differ -----

WAITING = r"^\S+ \(rank \d+ of \d+\): waiting for the other ranks at localhost:\d+, up to 60 s$"


@pytest.mark.slow
def test_a_rank_that_never_comes_is_named_by_every_rank_that_came(runs):
    """A world of 3 (rl_cartpole/batch.py), observer1 waiting first, then the agent (which holds
    the store, and whose --init_timeout ends first): both name observer2, the one that is
    missing; the agent stays, with the store, until observer1 has read its verdict. Then the
    last rank of a world alone, whose rank 0 never came, of an example whose trainers first
    meet in a process group."""
    port = find_free_port()
    waiting = start(runs, "rl_cartpole/batch.py", "--master_port", port, "--init_timeout", 60,
                    rank=1)
    waiting.wait_for_output(WAITING, timeout=90)
    deciding = start(runs, "rl_cartpole/batch.py", "--master_port", port, "--init_timeout", 4,
                     rank=0)
    alone = start(runs, "ddp_rpc_hybrid", "--master_port", find_free_port(), "--init_timeout", 2,
                  rank=2)
    deciding.wait(timeout=90)
    waiting.wait(timeout=30)  # read the verdict: long before its own --init_timeout
    for run in (deciding, waiting):
        assert run.returncode == 1, run.output
        assert run.stderr.count("\n") == 1, run.stderr
        assert (": observer2 (rank 2) did not join at localhost:" in run.stderr
                and "within 4 s (--init_timeout); start it with the same flags" in run.stderr), (
            run.stderr)
        assert not run.leftovers()
    alone.wait(timeout=90)
    assert alone.returncode == 1 and alone.stderr.count("\n") == 1, alone.stderr
    assert "ps: trainer0 (rank 0) did not come: nothing answered at localhost:" in alone.stderr
    assert "within 2 s (--init_timeout)" in alone.stderr
    assert not alone.leftovers()


def signal_again_and_again(run, number, times, group=True):
    """Send signal `number` `times` times, 0.3 s apart, to every process of the run's terminal
    (group: as Ctrl-C does) or to its command alone (as `kill` does), as long as it runs: people
    press Ctrl-C again when a program does not stop at once."""
    for _ in range(times):
        with contextlib.suppress(ProcessLookupError):
            if group:
                os.killpg(run.proc.pid, number)
            else:
                run.proc.send_signal(number)
        time.sleep(0.3)


@pytest.mark.slow
def test_a_waiting_rank_ends_at_once_on_ctrl_c_or_sigterm(runs):
    """A rank alone, waiting for the others (rank 0, which hosts the rendezvous, and a rank that
    waits to reach it), ends within 2 s of SIGINT (Ctrl-C) or SIGTERM with one line; the same
    signal sent again meanwhile changes nothing."""
    cases = [("param_server", 0, signal.SIGINT, "parameter_server"),
             ("ddp_rpc_hybrid", 2, signal.SIGTERM, "ps")]
    started = [start(runs, key, "--master_port", find_free_port(), rank=rank)
               for key, rank, _, _ in cases]
    for run, (_, _, number, name) in zip(started, cases, strict=True):
        run.wait_for_output(WAITING, timeout=90)
        time.sleep(0.5)  # well into the wait, not at its first step
        sent = time.monotonic()
        signal_again_and_again(run, number, 2, group=False)
        run.wait(timeout=30)
        assert time.monotonic() - sent < 2, run.output
        assert run.returncode == 128 + number, run.output
        suffix = "" if number == signal.SIGINT else " (SIGTERM)"
        assert run.stderr == f"{name}: interrupted{suffix}\n", run.stderr
        # multiprocessing's resource tracker, which the spawn start method starts, ends as it
        # reads the end of the command's pipe: a moment after the command
        assert not run.leftovers(grace=3)
        assert not run.records_left()


@pytest.mark.slow
def test_ctrl_c_mid_run_is_every_terminals_last_line(runs):
    """Ctrl-C mid-run, pressed again and again, to every process of a spawn-all run
    (rl_cartpole/batch.py), as a terminal sends it; the ranks' loops print every episode, on
    the thread that the harness does not stop: the terminal's last line is the harness's, none
    of the loop's lines after it, no traceback. A rank a terminal: Ctrl-C to its command is in
    test_a_waiting_rank_ends_at_once_on_ctrl_c_or_sigterm, its peers' 'lost contact' line in
    test_a_killed_command_takes_its_ranks_with_it."""
    spawn_all = start(runs, "rl_cartpole/batch.py", "--master_port", find_free_port(),
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


@pytest.mark.slow
def test_ranks_with_different_flags_end_at_once_naming_the_flag(runs):
    """Rank 0 and a rank of another program (param_server's batch.py), while a third rank is
    still missing: each says the same line naming both programs, status 2; the rank that
    differs ends at once, rank 0 (which holds the store) once the missing rank could have read
    the verdict: by its --init_timeout. Then a world size that differs, named with its ranks."""
    port = find_free_port()
    batch = [start(runs, "param_server", "--world_size", 3, "--master_port", port,
                   "--init_timeout", 4, rank=0),
             start(runs, "param_server/batch.py", "--master_port", port, rank=1)]
    port = find_free_port()
    worlds = [start(runs, "rl_cartpole", "--master_port", port, "--init_timeout", 4, rank=0),
              start(runs, "rl_cartpole", "--world_size", 3, "--master_port", port, rank=2)]
    for ranks, expected in ((batch, "rank 0 (parameter_server) runs param_server/main.py, but "
                                    "rank 1 (trainer1) runs param_server/batch.py"),
                            (worlds, "--world_size is 2 on rank 0 (agent) but 3 on rank 2 "
                                     "(observer2)")):
        for run in ranks:
            run.wait_for_output(WAITING.replace("60", r"\d+"), timeout=90)
        everyone_started = time.monotonic()
        for run in ranks:
            run.wait_for_output("start every rank with the same (values|program)", timeout=10)
            assert time.monotonic() - everyone_started < 10, run.output
        ranks[1].wait(timeout=10)
        ranks[0].wait(timeout=30)
        for run in ranks:
            assert run.returncode == 2, run.output
            assert run.stderr.count("\n") == 1 and expected in run.stderr, run.stderr
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
    config = RUNS["rl_cartpole"]
    script = example_command(config.name, *config.quick, *TCP, "--summary_json",
                             tmp_path / "summary.json")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                str(config.world_size)]
    run = runs.start_command([*torchrun, "--master_port", str(find_free_port()),
                              *script[1:]]).wait(timeout=120)
    assert run.returncode == 0, run.output
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["observers"] == config.world_size - 1
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


# --------- Output that nobody reads, and files that cannot be written --------------------

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
    """A rank a terminal: rank 0's output piped into a program that stops reading. Rank 0 ends
    quietly (141, no traceback nor error, nothing left running); the other terminal says why in
    one line."""
    config = RUNS["rl_cartpole"]
    port = find_free_port()
    observer = start(runs, "rl_cartpole", "--master_port", port, rank=1, endless=True,
                     merged=True)
    agent_cmd = example_command(config.name, *config.endless, *TCP, "--world_size",
                                config.world_size, "--rank", 0, "--master_port", port)
    process, left, stderr = _read_lines_then_close(agent_cmd, 3, tmp_path)
    assert process.returncode == 128 + signal.SIGPIPE, stderr
    assert "Traceback" not in stderr and "Error" not in stderr, stderr
    assert not left
    observer.wait(timeout=EXIT_BOUND_SECONDS + 30)
    assert observer.returncode == 1, observer.output
    assert "agent (rank 0)" in observer.last_line and "output was closed" in observer.last_line
    assert not observer.leftovers()


@pytest.mark.parametrize("script", ["main.py", "actors.py"])
def test_a_summary_file_that_cannot_be_written_is_refused_before_any_rank_starts(script, runs,
                                                                               tmp_path):
    """Bad input on the real command line: one line, status 2, nothing started, nothing left."""
    if script == "actors.py":
        needs_monarch()
    missing = tmp_path / "no such folder" / "summary.json"
    run = runs.start("rl_cartpole", "--max_episodes", 3, "--summary_json", missing,
                     script=script).wait(timeout=60)
    assert run.returncode == 2, run.output
    assert run.stdout == ""  # nothing started
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert "--summary_json" in run.stderr and str(missing.parent) in run.stderr
    assert not run.leftovers(grace=3)  # the resource tracker ends just after


@pytest.mark.slow
def test_a_summary_file_lost_at_the_end_is_told_after_the_figures(runs, tmp_path):
    """The folder of --summary_json goes away mid-run (as a disk fills): the Summary line is
    printed, then one line naming the file, status 1."""
    folder = tmp_path / "going"
    folder.mkdir()
    run = start(runs, "rl_cartpole", "--max_episodes", 40, "--log_interval", 1,
                "--summary_json", folder / "summary.json", "--master_port", find_free_port(),
                merged=True)
    run.wait_for_output(r"^Episode 2\t", timeout=120)
    folder.rmdir()
    run.wait(timeout=120)
    assert run.returncode == 1, run.output
    lines = [line for line in run.output.splitlines() if line.strip()]
    assert lines[-2].startswith("Summary: 40 episodes"), run.output
    assert "--summary_json" in lines[-1] and "not written" in lines[-1], run.output
    assert not run.leftovers()
