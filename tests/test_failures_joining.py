"""The harness's ways of ending a run before and around the join (rpc_harness), and the ways
ranks are started, each tested once, end to end, against one or two examples: a rank that never
comes, Ctrl-C and SIGTERM while waiting, flags that differ, a rank taken twice, a summary file
refused before any rank starts; torchrun and several hosts. A run that is under way:
test_failures.py. Every entry point in every launch mode under every fault is make faults'
(bench/faults.py); every entry point in every launch mode, test_launch_modes.py."""

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    EXIT_BOUND_SECONDS,
    RUNS,
    TCP,
    _processes,
    example_command,
    find_free_port,
    needs_monarch,
    signal_again_and_again,
    start_run,
)

# --------- One terminal per rank: waiting, missing ranks, Ctrl-C, flags, a rank taken twice ---

WAITING = r"^\S+ \(rank \d+ of \d+\): waiting for the other ranks at localhost:\d+, up to 60 s$"


@pytest.mark.slow
def test_a_rank_that_never_comes_is_named_by_every_rank_that_came(runs):
    """A world of 3 (rl_cartpole/batch.py), observer1 waiting first, then the agent (which holds
    the store, and whose --init_timeout ends first): both name observer2, the one that is
    missing; the agent stays, with the store, until observer1 has read its verdict. Then the
    last rank of a world alone, whose rank 0 never came, of an example whose trainers first
    meet in a process group."""
    port = find_free_port()
    waiting = start_run(runs, "rl_cartpole/batch.py", "--master_port", port, "--init_timeout", 60,
                        rank=1)
    waiting.wait_for_output(WAITING, timeout=90)
    deciding = start_run(runs, "rl_cartpole/batch.py", "--master_port", port, "--init_timeout", 4,
                         rank=0)
    alone = start_run(runs, "ddp_rpc_hybrid", "--master_port", find_free_port(),
                      "--init_timeout", 2, rank=2)
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


@pytest.mark.slow
def test_a_waiting_rank_ends_at_once_on_ctrl_c_or_sigterm(runs):
    """A rank alone, waiting for the others (rank 0, which hosts the rendezvous, and a rank that
    waits to reach it), ends within 2 s of SIGINT (Ctrl-C) or SIGTERM with one line; the same
    signal sent again meanwhile changes nothing."""
    cases = [("param_server", 0, signal.SIGINT, "parameter_server"),
             ("ddp_rpc_hybrid", 2, signal.SIGTERM, "ps")]
    started = [start_run(runs, key, "--master_port", find_free_port(), rank=rank)
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
def test_ranks_with_different_flags_end_at_once_naming_the_flag(runs):
    """Rank 0 and a rank of another program (param_server's batch.py), while a third rank is
    still missing: each says the same line naming both programs, status 2; the rank that
    differs ends at once, rank 0 (which holds the store) once the missing rank could have read
    the verdict: by its --init_timeout. Then a world size that differs, named with its ranks."""
    port = find_free_port()
    batch = [start_run(runs, "param_server", "--world_size", 3, "--master_port", port,
                       "--init_timeout", 4, rank=0),
             start_run(runs, "param_server/batch.py", "--master_port", port, rank=1)]
    port = find_free_port()
    worlds = [start_run(runs, "rl_cartpole", "--master_port", port, "--init_timeout", 4, rank=0),
              start_run(runs, "rl_cartpole", "--world_size", 3, "--master_port", port, rank=2)]
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
    agent = start_run(runs, "rl_cartpole", "--master_port", port, rank=0, endless=True)
    first = start_run(runs, "rl_cartpole", "--master_port", port, rank=1, endless=True)
    first.wait_for_output(r"^observer1: joined", timeout=90)
    second = start_run(runs, "rl_cartpole", "--master_port", port, rank=1).wait(timeout=60)
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
    processes = [start_run(runs, key, *common, rank=rank,
                           prefix=["ip", "netns", "exec", host_a if rank == 0 else host_b])
                 for rank in range(RUNS[key].world_size)]
    for process in processes:
        process.wait(timeout=120)
        assert process.returncode == 0, process.output
    assert (tmp_path / "summary.json").exists()


# --------- Files that cannot be written --------------------

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


