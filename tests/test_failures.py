"""rpcrun in front of the examples themselves: what only a real run of torch shows, each once.
A rank killed while its peers wait in torch's calls (their tracebacks of the lost peer are left
out), mp.spawn's report of a killed or failing rank turned into one line, a killed rpcrun taking
torch's processes with it, Ctrl-C mid-run, a closed pipe, the loopback-only listeners, a
profiled run's one timeline, and ranks on two hosts. Every other path of the supervisor is
test_rpcrun.py's (on a stand-in); every entry point, launch mode and fault is make faults'
(bench/faults.py). The tests marked `faults` are cells of that matrix too: make test leaves
them to make test-oldest, which runs them on the oldest torch (pyproject.toml's marker says
why). Output is merged as a terminal shows it: rpcrun's line must be each terminal's last."""

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
from conftest import ROOT, RUNS, check_timeline, find_free_port, supervised_command

pytestmark = pytest.mark.slow

FAULT_INJECTION = ROOT / "bench" / "fault_injection"


def supervised(runs, key, *flags, rank=None, endless=False, rpcrun=(), prefix=(), **kwargs):
    """An example's short (or endless) run under rpcrun, in its smallest world; `rank`: that
    rank alone, in a terminal of its own."""
    config = RUNS[key]
    words = [*(config.endless if endless else config.quick), "--world_size", config.world_size,
             *flags, *(() if rank is None else ("--rank", rank))]
    command = supervised_command(config.name, *words, script=config.script, rpcrun=rpcrun)
    return runs.start_command([*prefix, *command], merged=True, **kwargs)


def per_rank(runs, key, *flags, endless=True, rpcrun=()):
    """Every rank of a run in a terminal of its own, the last first, on fresh ports."""
    ports = ["--master_port", find_free_port()]
    rpcrun = ["--port", find_free_port(), *rpcrun]
    terminals = {rank: supervised(runs, key, *ports, *flags, rank=rank, endless=endless,
                                  rpcrun=rpcrun)
                 for rank in reversed(range(RUNS[key].world_size))}
    return [terminals[rank] for rank in sorted(terminals)]


def rank_process(terminal):
    """The pid of the rank process that a per-rank terminal's command started (the tutorial's
    mp.Process): rpcrun's grandchild."""
    def children(pid):
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                    cmdline = (entry / "cmdline").read_bytes()
                except OSError:
                    continue
                fields = stat[stat.rindex(")") + 2:].split()
                if (int(fields[1]) == pid and fields[0] != "Z"
                        and b"resource_tracker" not in cmdline):
                    found.append(int(entry.name))
        return found

    command = children(terminal.proc.pid)[0]
    return children(command)[0]


def no_traceback(terminal):
    return "Traceback (most recent call last)" not in terminal.output


def wait_working(terminals, key, timeout=120):
    for terminal in terminals:
        if re.search(RUNS[key].working, terminal.output, re.M):
            return
    deadline = time.monotonic() + timeout
    while not any(re.search(RUNS[key].working, t.output, re.M) for t in terminals):
        assert time.monotonic() < deadline, [t.output[-2000:] for t in terminals]
        assert all(t.proc.poll() is None for t in terminals), [t.output for t in terminals]
        time.sleep(0.05)


# --------- A rank killed: its peers' tracebacks are left out --------------------

def test_a_killed_trainer_is_every_terminals_last_line_without_torchs_tracebacks(runs):
    """param_server, one rank a terminal: the trainer's own process killed while the server
    serves it. torch's errors of the lost peer in the server's terminal are left out."""
    server, trainer = per_rank(runs, "param_server")
    wait_working([trainer], "param_server")
    os.kill(rank_process(trainer), signal.SIGKILL)
    for terminal in (server, trainer):
        terminal.wait(60)
        assert not terminal.leftovers(), terminal.output
    assert (trainer.last_line, trainer.returncode) == ("rpcrun: rank 1 was killed by SIGKILL",
                                                       137)
    assert (server.last_line, server.returncode) == (
        "rpcrun: rank 0 ended: rank 1 was killed by SIGKILL", 1)
    assert no_traceback(server) and no_traceback(trainer), server.output


@pytest.mark.faults
def test_mp_spawns_report_of_a_killed_rank_is_one_line(runs):
    """Every rank from one command: mp.spawn's traceback of the rank it lost is left out."""
    run = supervised(runs, "rl_cartpole", "--master_port", find_free_port(), endless=True)
    wait_working([run], "rl_cartpole")
    command = run.processes()[1]  # rpcrun's child: the oldest after rpcrun
    ranks = sorted(pid for pid in run.processes()
                   if Path(f"/proc/{pid}/stat").read_text().split(") ")[1].split()[1]
                   == str(command) and b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
                   and b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes())
    os.kill(ranks[1], signal.SIGKILL)
    run.wait(60)
    assert (run.last_line, run.returncode) == (
        "rpcrun: rank 1 was killed by SIGKILL; ended the other ranks", 137)
    assert no_traceback(run), run.output
    assert not run.leftovers()


@pytest.mark.faults
def test_a_rank_whose_code_raises_shows_its_traceback_then_one_line(runs, tmp_path):
    """Every rank from one command, the agent's own code raising (an error injected into its
    optimizer step by bench/fault_injection): its traceback, as mp.spawn carried it, then one
    line naming it."""
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(FAULT_INJECTION),
                                                       os.environ.get("PYTHONPATH")])),
           "FAULTS_RAISE": "rank torch.optim:Adam.step 0 3",
           "FAULTS_RAISED": str(tmp_path / "raised")}
    run = supervised(runs, "rl_cartpole", "--master_port", find_free_port(), endless=True,
                     env=env)
    run.wait(120)
    assert run.returncode == 1, run.output
    assert run.last_line == ("rpcrun: rank 0 failed (RuntimeError: an error injected by "
                             "bench/faults.py); ended the other ranks")
    assert run.output.count("Traceback (most recent call last)") == 1  # the rank's own
    assert "ProcessRaisedException" not in run.output  # mp.spawn's wrapping, left out
    assert not run.leftovers()


# --------- The supervisor killed, Ctrl-C, a closed pipe --------------------

@pytest.mark.faults
def test_a_killed_rpcrun_takes_torchs_processes_with_it(runs):
    agent, observer = per_rank(runs, "rl_cartpole")
    wait_working([agent], "rl_cartpole")
    rank = rank_process(observer)
    observer.proc.send_signal(signal.SIGKILL)
    agent.wait(60)
    assert agent.last_line == ("rpcrun: rank 0 ended: lost contact with rank 1 (its rpcrun's "
                               "connection closed)")
    assert not observer.leftovers(), f"rank process {rank} outlived its rpcrun"
    assert not agent.leftovers()


@pytest.mark.faults
def test_ctrl_c_mid_run_ends_within_2_s_in_one_line(runs):
    server, trainer = per_rank(runs, "param_server")
    wait_working([trainer], "param_server")
    pressed = time.monotonic()
    os.killpg(server.proc.pid, signal.SIGINT)  # Ctrl-C in rank 0's terminal
    server.wait(30)
    seconds = time.monotonic() - pressed
    trainer.wait(30)
    assert (server.last_line, server.returncode) == ("rpcrun: rank 0 interrupted (Ctrl-C)", 130)
    assert (trainer.last_line, trainer.returncode) == (
        "rpcrun: rank 1 ended: rank 0 was interrupted (Ctrl-C)", 1)
    assert seconds < 2 + 2  # within 2 s, room for a busy machine
    assert no_traceback(server) and no_traceback(trainer)
    assert not server.leftovers() and not trainer.leftovers()


@pytest.mark.faults
def test_a_closed_pipe_ends_a_real_run_quietly(tmp_path):
    config = RUNS["rl_cartpole"]
    command = supervised_command(config.name, *config.endless, "--master_port",
                                 find_free_port())
    done = subprocess.run(
        f"{' '.join(map(str, command))} | head -3; echo \"status ${{PIPESTATUS[0]}}\" >&2",
        shell=True, executable="/bin/bash", capture_output=True, text=True, timeout=180,
        cwd=ROOT, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.stdout.count("\n") == 3
    errors = [line for line in done.stderr.splitlines() if not line.startswith("rpcrun: OMP")]
    assert errors == ["status 141"], done.stderr
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True)
    assert left.stdout == ""


# --------- Where the ranks listen --------------------

def _listening_sockets():
    """{socket inode: (address, port)} of every listening TCP socket of this network
    namespace."""
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


def test_a_local_supervised_run_listens_on_loopback_but_for_torchs_store(runs):
    """rpcrun pins TensorPipe and Gloo to the loopback interface for a loopback --master_addr:
    every listener of the run is on a loopback address, but torch's two stores where the ranks
    meet, on --master_port (the trainers' process group) and the next port (RPC's), which
    listen on every interface whatever the address says."""
    port = find_free_port()
    run = supervised(runs, "ddp_rpc_hybrid", "--master_port", port, endless=True)
    wait_working([run], "ddp_rpc_hybrid")
    listening = _listening_sockets()
    ours = {listening[inode] for pid in run.processes() for inode in _sockets_of(pid)
            if inode in listening}
    others = {(address, at) for address, at in ours if at not in (port, port + 1)}
    assert len(others) >= RUNS["ddp_rpc_hybrid"].world_size, sorted(map(str, ours))
    assert all(address.is_loopback for address, _ in others), sorted(map(str, ours))


# --------- --profile's timeline --------------------

def test_a_profiled_supervised_run_ends_with_the_timeline_of_every_rank(runs, tmp_path):
    """One rank a terminal, profiled: each rank writes its trace, and rank 0's rpcrun merges
    them into one timeline once every rank is done."""
    traces = tmp_path / "traces"
    server, trainer = per_rank(runs, "param_server", "--profile", traces, "--max_batches", 8,
                               endless=False)
    for terminal in (server, trainer):
        terminal.wait(180)
    assert re.fullmatch(r"rpcrun: wrote the timeline of 2 ranks to .*timeline\.json \(\d+ kB\): "
                        r"open it in https://ui\.perfetto\.dev", server.last_line), server.output
    check_timeline([server, trainer], traces, ["parameter_server", "trainer_1"],
                   "parameter_server", {"aten::conv2d", "aten::convolution"})
    events = json.loads((traces / "timeline.json").read_text())["traceEvents"]
    assert [e["args"]["name"] for e in events if e.get("name") == "process_name"] == [
        "parameter_server", "trainer_1"]


# --------- Two hosts --------------------

def test_ranks_on_two_hosts_meet_and_a_killed_host_leaves_nothing(two_hosts, runs, tmp_path):
    """ddp_rpc_hybrid with rank 0 on one host and the others on another, as on two machines,
    each under rpcrun: they meet at rank 0's address and finish; then a second run whose second
    host's rpcrun is killed ends on the first host in one line, and nothing is left on either."""
    (host_a, addr_a), (host_b, _) = two_hosts
    key = "ddp_rpc_hybrid"

    def start(*flags, endless):
        common = ["--master_addr", addr_a, "--master_port", find_free_port()]
        rpcrun = ["--port", find_free_port()]
        return [supervised(runs, key, *common, *flags, rank=rank, endless=endless,
                           rpcrun=rpcrun,
                           prefix=["ip", "netns", "exec", host_a if rank == 0 else host_b])
                for rank in range(RUNS[key].world_size)]

    for terminal in start("--summary_json", tmp_path / "summary.json", endless=False):
        terminal.wait(180)
        assert terminal.returncode == 0, terminal.output
        assert "rpcrun: OMP_NUM_THREADS" not in terminal.output  # unknown for two hosts
    assert (tmp_path / "summary.json").exists()
    first, *others = start(endless=True)
    wait_working([first, *others], key)
    others[0].proc.send_signal(signal.SIGKILL)
    first.wait(60)
    assert first.last_line.startswith("rpcrun: rank 0 ended: lost contact with rank 1")
    for terminal in (first, *others):
        terminal.wait(60)
        assert not terminal.leftovers(), terminal.output


@pytest.mark.faults
def test_rpcrun_refuses_to_run_under_torchrun(runs):
    """torchrun's agent supervises its workers: rpcrun in front of the script is refused."""
    port = find_free_port()
    run = runs.start_command(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", 2, "--master_port",
         port, "--no-python", sys.executable, "-m", "rpc_harness",
         ROOT / "rl_cartpole" / "main.py", "--max_episodes", 2], merged=True).wait(120)
    assert run.returncode != 0
    assert "torchrun supervises its own ranks" in run.output
