"""rpcrun, the supervisor, on a stand-in for an example (tests/standin/main.py: the same command
line and launch, without torch, so that a run takes a second): each path once, through its
command line. What it does with the examples themselves is test_failures.py's."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, find_free_port

from rpc_harness.command import parse, script_flags
from rpc_harness.supervisor import last_error

STANDIN = ROOT / "tests" / "standin" / "main.py"
CORES = len(os.sched_getaffinity(0))


def rpcrun(*words):
    return [sys.executable, "-m", "rpc_harness", *map(str, words)]


class World:
    """The ranks of one run, each its own supervised command (a terminal each), on ports of
    their own; `rpcrun_flags` before the script, `flags` after it, for every rank."""

    def __init__(self, runs, world_size, *flags, rpcrun_flags=()):
        self.runs = runs
        self.world_size = world_size
        self.flags = [*flags, "--world_size", world_size, "--master_port", find_free_port()]
        self.rpcrun_flags = ["--port", find_free_port(), *rpcrun_flags]
        self.terminals = {}

    def start(self, rank, *flags, script=STANDIN):
        self.terminals[rank] = self.runs.start_command(
            rpcrun(*self.rpcrun_flags, script, *self.flags, "--rank", rank, *flags), merged=True)
        return self.terminals[rank]

    def start_all(self, *flags, order=None):
        for rank in order or range(self.world_size):
            self.start(rank, *flags)
        return [self.terminals[rank] for rank in range(self.world_size)]

    def working(self):
        """Once every rank works: each was admitted, and its command runs."""
        for rank, terminal in self.terminals.items():
            terminal.wait_for_output(rf"^rank {rank} working", timeout=30)
        return self

    def wait_all(self, timeout=30):
        for terminal in self.terminals.values():
            terminal.wait(timeout)
            assert not terminal.leftovers(grace=5), terminal.output
        return self.terminals


def last_lines(terminal):
    """The terminal's last line, and its status."""
    return terminal.last_line, terminal.returncode


def rank_process(terminal, rank):
    """The pid of rank `rank`'s own process (the mp.Process that its command started), once
    it works."""
    terminal.wait_for_output(rf"^rank {rank} working", timeout=20)
    supervised = [pid for pid in terminal.processes() if pid != terminal.proc.pid]
    children = {pid: Path(f"/proc/{pid}/stat").read_text().split(") ")[1].split()[1]
                for pid in supervised}
    command = next(pid for pid, parent in children.items() if int(parent) == terminal.proc.pid)
    return next(pid for pid, parent in children.items() if int(parent) == command
                and b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes())


# --------- A run that succeeds --------------------

def test_every_rank_from_one_command_runs_with_its_share_of_the_cores(runs):
    run = runs.start_command(rpcrun(STANDIN, "--world_size", 2, "--seconds", 0.2), merged=True)
    run.wait(30)
    assert run.returncode == 0, run.output
    share = max(1, CORES // 2)
    assert run.output.count(f"OMP_NUM_THREADS={share}, TP_SOCKET_IFNAME=lo") == 2, run.output
    assert run.output.count("rpcrun: OMP_NUM_THREADS=") == 1  # said once
    assert run.last_line == "Summary: every rank is done"
    assert not run.leftovers()


def test_a_thread_count_of_the_users_own_is_kept(runs):
    run = runs.start_command(rpcrun(STANDIN, "--world_size", 2, "--seconds", 0.1),
                             env={"OMP_NUM_THREADS": "3"}, merged=True)
    run.wait(30)
    assert run.output.count("OMP_NUM_THREADS=3,") == 2 and "rpcrun: OMP" not in run.output


def test_one_rank_a_terminal_in_any_order_meet_and_say_so(runs):
    """Ranks 2 and 1 first, each saying that it waits for rank 0; then rank 0: all meet."""
    world = World(runs, 3, "--seconds", 0.5)
    for rank in (2, 1):
        world.start(rank)
        world.terminals[rank].wait_for_output(
            rf"^rpcrun: rank {rank} of 3: waiting for rank 0 at localhost:", timeout=30)
    world.start(0)
    for terminal in world.wait_all().values():
        assert terminal.returncode == 0, terminal.output
        assert "rpcrun: all 3 ranks have joined" in terminal.output
    assert world.terminals[0].last_line == "Summary: every rank is done"


def test_help_and_bad_flags_are_the_commands_own(runs):
    """rpcrun does not meet for a command that asks for help or whose --rank makes no sense:
    the script says what it says, with its status."""
    helped = runs.start_command(rpcrun(STANDIN, "--rank", 1, "--help"), merged=True).wait(30)
    assert helped.returncode == 0 and "--world_size" in helped.output
    bad = runs.start_command(rpcrun(STANDIN, "--world_size", 1, "--rank", 0), merged=True)
    bad.wait(30)
    assert bad.returncode == 2
    assert bad.last_line.endswith("argument --world_size: must be at least 2, got 1")


# --------- A rank that fails, is killed or stopped --------------------

def test_a_rank_whose_code_raises_is_named_in_every_terminal(runs):
    world = World(runs, 3, "--seconds", 1, "--fail", 1, "--hang", 0, 2)
    world.start_all()
    terminals = world.wait_all()
    line, status = last_lines(terminals[1])
    assert (line, status) == ("rpcrun: rank 1 failed (ValueError: rank 1 went wrong)", 1)
    assert "Traceback (most recent call last):" in terminals[1].output  # kept: its own
    for rank in (0, 2):
        assert last_lines(terminals[rank]) == (
            f"rpcrun: rank {rank} ended: rank 1 failed (ValueError: rank 1 went wrong)", 1)


def test_the_rank_whose_error_came_first_is_named_though_its_process_ends_last(runs, tmp_path):
    """Rank 1 raises and its process takes 3 s to end (as torch tears down); rank 0 raises a
    second after it, as a peer that lost rank 1 does, and ends at once: rank 1 is named, and
    rank 0's traceback, which followed from it, is left out."""
    world = World(runs, 2, "--seconds", 1, "--fail", 1, 0, "--slow_end", 1,
                  "--mark", tmp_path / "rank 1 raised")
    world.start_all()
    terminals = world.wait_all()
    assert last_lines(terminals[1]) == ("rpcrun: rank 1 failed (ValueError: rank 1 went wrong)", 1)
    assert last_lines(terminals[0]) == (
        "rpcrun: rank 0 ended: rank 1 failed (ValueError: rank 1 went wrong)", 1)
    assert "Traceback (most recent call last):" not in terminals[0].output, terminals[0].output


# A rank whose RPC to trainer1 raised there (param_server/batch.py, whose server runs each
# trainer's loop by RPC): the end of its traceback, as torch's RPC carries the callee's
# exception back to the caller.
CARRIED = """Traceback (most recent call last):
  File "/work/param_server/batch.py", line 197, in run_ps
    torch.futures.wait_all(futs)
RuntimeError: RuntimeError: On WorkerInfo(id=1, name=trainer1):
RuntimeError('an error injected by bench/faults.py')
Traceback (most recent call last):
  File "/work/torch/distributed/rpc/internal.py", line 209, in _run_function
    result = python_udf.func(*python_udf.args, **python_udf.kwargs)
  File "/work/param_server/batch.py", line 152, in train
    loss = F.nll_loss(m(inputs), labels)
RuntimeError: an error injected by bench/faults.py


At:
  /work/torch/distributed/rpc/internal.py(236): _handle_exception
"""


def test_an_error_carried_by_rpc_is_named_with_the_worker_that_raised_it():
    """The cause in rpcrun's line is the callee's exception, and where it was raised; not the
    frames that torch appends after it."""
    assert last_error(CARRIED.splitlines()) == (
        "RuntimeError: an error injected by bench/faults.py, raised on trainer1 in an RPC")
    own = CARRIED.splitlines()[:3] + ["ValueError: rank 0 went wrong"]
    assert last_error(own) == "ValueError: rank 0 went wrong"


@pytest.mark.parametrize("what", ["rank process", "supervised command"])
def test_a_killed_rank_is_named_in_every_terminal(runs, what):
    world = World(runs, 2, "--seconds", 60)
    killed, other = world.start_all()
    pid = rank_process(world.working().terminals[0], 0)
    if what == "supervised command":
        pid = int(Path(f"/proc/{pid}/stat").read_text().split(") ")[1].split()[1])
    os.kill(pid, signal.SIGKILL)
    world.wait_all()
    assert last_lines(killed) == ("rpcrun: rank 0 was killed by SIGKILL", 137)
    assert last_lines(other) == ("rpcrun: rank 1 ended: rank 0 was killed by SIGKILL", 1)


def test_a_killed_rpcrun_leaves_nothing_behind(runs):
    world = World(runs, 2, "--seconds", 60)
    first, second = world.start_all()
    world.working()
    second.proc.send_signal(signal.SIGKILL)
    world.wait_all()
    assert second.returncode == -signal.SIGKILL
    assert last_lines(first) == ("rpcrun: rank 0 ended: lost contact with rank 1 (its rpcrun's "
                                 "connection closed)", 1)


def test_a_stopped_rank_is_ended_after_the_bound(runs):
    world = World(runs, 2, "--seconds", 60, rpcrun_flags=["--lost_timeout", 2])
    stopped, other = world.start_all()
    pid = rank_process(world.working().terminals[0], 0)
    os.kill(pid, signal.SIGSTOP)
    world.wait_all()
    expected = "rank 0 was stopped (SIGSTOP) for 2 s (--lost_timeout)"
    assert last_lines(stopped) == (f"rpcrun: {expected}; ended it", 1)
    assert last_lines(other) == (f"rpcrun: rank 1 ended: {expected}", 1)


def test_a_stopped_rpcrun_is_lost_and_ends_when_it_resumes(runs):
    world = World(runs, 2, "--seconds", 60, rpcrun_flags=["--lost_timeout", 2])
    first, stopped = world.start_all()
    world.working()
    stopped.proc.send_signal(signal.SIGSTOP)
    first.wait(30)
    assert last_lines(first) == ("rpcrun: rank 0 ended: lost contact with rank 1 (its rpcrun was "
                                 "silent for 2 s (--lost_timeout))", 1)
    stopped.proc.send_signal(signal.SIGCONT)
    world.wait_all()
    assert last_lines(stopped) == ("rpcrun: rank 1 ended: lost contact with rank 0 (its rpcrun's "
                                   "connection closed)", 1)


# --------- Signals --------------------

@pytest.mark.parametrize("number, times, words, status", [
    (signal.SIGINT, 1, "interrupted (Ctrl-C)", 130),
    (signal.SIGINT, 3, "interrupted (Ctrl-C)", 130),
    (signal.SIGTERM, 2, "interrupted (SIGTERM)", 143),
])
def test_ctrl_c_and_sigterm_end_every_terminal_in_one_line(runs, number, times, words, status):
    world = World(runs, 2, "--seconds", 60)
    other, interrupted = world.start_all()
    world.working()
    signalled = time.monotonic()
    for _ in range(times):  # as a terminal sends Ctrl-C: to its foreground process group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(interrupted.proc.pid, number)
        time.sleep(0.2)
    interrupted.wait(10)
    ended_after = time.monotonic() - signalled
    world.wait_all()
    assert last_lines(interrupted) == (f"rpcrun: rank 1 {words}", status)
    assert ended_after < 2 + 0.2 * times + 2  # within 2 s (room for a busy machine)
    assert last_lines(other) == (f"rpcrun: rank 0 ended: rank 1 was {words}", 1)


def test_ctrl_c_while_waiting_to_join(runs):
    world = World(runs, 2)
    waiting = world.start(1)
    waiting.wait_for_output("waiting for rank 0", timeout=20)
    os.killpg(waiting.proc.pid, signal.SIGINT)
    waiting.wait(10)
    assert last_lines(waiting) == ("rpcrun: rank 1 interrupted (Ctrl-C)", 130)


def test_ctrl_c_ends_every_rank_of_one_command(runs):
    run = runs.start_command(rpcrun(STANDIN, "--world_size", 2, "--seconds", 60), merged=True)
    run.wait_for_output("^rank 1 working", timeout=20)
    os.killpg(run.proc.pid, signal.SIGINT)
    run.wait(10)
    assert last_lines(run) == ("rpcrun: interrupted (Ctrl-C); ended every rank", 130)
    assert not run.leftovers()


# --------- The meeting --------------------

def test_a_rank_that_never_comes_is_named_by_those_that_came(runs):
    world = World(runs, 3, "--seconds", 60, rpcrun_flags=["--join_timeout", 2])
    world.start(0)
    world.start(1)
    world.wait_all()
    for rank in (0, 1):
        line, status = last_lines(world.terminals[rank])
        assert status == 1
        assert line.startswith(f"rpcrun: rank {rank} ended: rank 2 did not join at localhost:")
        assert line.endswith("within 2 s (--join_timeout); start every rank with the same flags")


def test_a_rank_0_that_never_comes(runs):
    world = World(runs, 2, rpcrun_flags=["--join_timeout", 1])
    alone = world.start(1)
    world.wait_all()
    line, status = last_lines(alone)
    assert status == 1 and line.startswith("rpcrun: rank 0 did not come: nothing answered at")


def test_a_rank_with_other_flags_is_refused_and_rank_0_waits_on(runs):
    world = World(runs, 2, "--seconds", 0.5, rpcrun_flags=["--join_timeout", 20])
    world.start(0, "--seed", 1)
    refused = world.start(1, "--seed", 2)
    refused.wait(20)
    assert last_lines(refused) == (
        "rpcrun: rank 1 has --seed 2, but rank 0 has --seed 1: start every rank with the same "
        "flags", 2)
    world.start(1, "--seed", 1)  # started again, right: the run goes on
    world.wait_all()
    assert world.terminals[0].returncode == 0, world.terminals[0].output
    assert "rpcrun: refused a rank: rank 1 has --seed 2" in world.terminals[0].output


def test_a_rank_started_twice_and_another_program_are_refused(runs, tmp_path):
    world = World(runs, 3, "--seconds", 5)
    world.start(0)
    world.start(1).wait_for_output("^rank 1 working", timeout=20)
    twice = runs.start_command(rpcrun(*world.rpcrun_flags, STANDIN, *world.flags, "--rank", 1),
                               merged=True).wait(20)
    assert last_lines(twice) == (
        "rpcrun: rank 1 is taken: another command of this run has it already", 2)
    other = tmp_path / "other" / "main.py"
    other.parent.mkdir()
    other.write_text(STANDIN.read_text())
    stranger = runs.start_command(rpcrun(*world.rpcrun_flags, other, *world.flags, "--rank", 2),
                                  merged=True).wait(20)
    assert last_lines(stranger) == (
        "rpcrun: rank 0 runs standin/main.py, but rank 2 runs other/main.py: start every rank "
        "with the same program", 2)


def test_rank_0_taken(runs):
    world = World(runs, 2, "--seconds", 5)
    world.start(0).wait_for_output("^rank 0 working", timeout=20)
    again = runs.start_command(rpcrun(*world.rpcrun_flags, STANDIN, *world.flags, "--rank", 0),
                               merged=True).wait(20)
    line, status = last_lines(again)
    assert status == 2 and "rank 0 of this run is taken, or another run uses the port" in line


# --------- Output --------------------

def test_a_closed_pipe_ends_the_run_quietly(tmp_path):
    """`rpcrun ... | head -1`: every process ends, status 141, nothing on standard error."""
    done = subprocess.run(
        f"{' '.join(map(str, rpcrun(STANDIN, '--world_size', 2, '--seconds', 60)))} "
        f"| head -1; echo \"status ${{PIPESTATUS[0]}}\" >&2",
        shell=True, executable="/bin/bash", capture_output=True, text=True, timeout=60,
        env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.stdout.startswith("rank ") and done.stdout.count("\n") == 1
    assert done.stderr.splitlines()[-1] == "status 141", done.stderr
    assert [line for line in done.stderr.splitlines() if not line.startswith("rpcrun: OMP")] == [
        "status 141"]


def test_long_lines_of_several_ranks_stay_whole(runs):
    run = runs.start_command(rpcrun(STANDIN, "--world_size", 4, "--seconds", 0.1,
                                    "--long_line", 8000))
    run.wait(30)
    lines = run.stdout.splitlines()
    assert lines.count("x" * 8000) == 4 and all(set(line) == {"x"} or line.startswith(
        ("rank ", "Summary")) for line in lines)


def test_standard_error_keeps_its_place_among_the_lines(runs):
    run = runs.start_command(rpcrun(STANDIN, "--world_size", 2, "--seconds", 0.3, "--warn", 0),
                             merged=True)
    run.wait(30)
    lines = run.output.splitlines()
    assert lines.index("rank 0: a warning on standard error") < lines.index("rank 0 done")


# --------- rpcrun's own command line --------------------

def test_rpcrun_under_torchrun_is_refused(runs):
    run = runs.start_command(rpcrun(STANDIN), env={"RANK": "0", "WORLD_SIZE": "2"},
                             merged=True).wait(20)
    assert run.returncode == 2 and "torchrun supervises its own ranks" in run.last_line


@pytest.mark.parametrize("words, expected", [
    ([], "the following arguments are required: SCRIPT"),
    (["--join_timeout", "0", STANDIN], "must be greater than 0, got 0"),
    (["--port", "70000", STANDIN], "must be a port from 1 to 65535, got 70000"),
    (["no_such_script.py"], "no_such_script.py: no such file"),
])
def test_rpcrun_bad_input_is_one_line_and_status_2(runs, words, expected):
    run = runs.start_command(rpcrun(*words), merged=True).wait(20)
    assert run.returncode == 2 and expected in run.last_line


def test_the_script_flags_are_read_as_argparse_reads_them():
    assert script_flags(["--world-size=3", "--num_split", "1", "2", "--rank", "1", "--x"]) == {
        "world_size": ("3",), "num_split": ("1", "2"), "rank": ("1",), "x": ()}


@pytest.mark.parametrize("script, world_size", [
    ("param_server/main.py", 4), ("rl_cartpole/main.py", 2), ("rnn_model_parallel/main.py", 2),
    ("ddp_rpc_hybrid/main.py", 4),
])
def test_each_examples_default_world_size_is_read_from_its_script(script, world_size):
    command = parse([str(ROOT / script), "--rank", "1"])
    assert command.world_size == world_size and command.master_port == 29500
    assert command.port == 29400 and command.master_addr == "localhost"


# --------- --profile's timeline --------------------

def write_trace(folder, rank, name):
    (folder / f"{name}.json").write_text(json.dumps({
        "rank": rank, "baseTimeNanoseconds": 10**9 + rank, "traceEvents": [
            {"ph": "M", "name": "process_labels", "pid": 7 + rank, "args": {"labels": "CPU"}},
            {"ph": "X", "name": "aten::mm", "pid": 7 + rank, "tid": 1, "ts": 5, "dur": 1}]}))


def test_the_timeline_command_merges_a_folder_of_traces(tmp_path):
    write_trace(tmp_path, 1, "trainer_1")
    write_trace(tmp_path, 0, "parameter_server")
    (tmp_path / "other.json").write_text("{}")  # not a rank's trace: left out
    done = subprocess.run([sys.executable, "-m", "rpc_harness.timeline", tmp_path],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(r"wrote the timeline of 2 ranks to .*timeline\.json \(\d+ kB\): open it "
                        r"in https://ui\.perfetto\.dev\n", done.stdout)
    events = json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
    tracks = sorted((e["pid"], e["args"]["name"]) for e in events if e["name"] == "process_name")
    assert [name for _, name in tracks] == ["parameter_server", "trainer_1"]
    work = [e for e in events if e["name"] == "aten::mm"]
    assert [e["ts"] for e in work] == [5.0, 5.001]  # one clock: trainer_1's 1 ns later


def test_a_profiled_run_ends_with_one_timeline(runs, tmp_path):
    traces = tmp_path / "traces"
    traces.mkdir()
    write_trace(traces, 5, "an_earlier_run")
    os.utime(traces / "an_earlier_run.json", (1, 1))  # old: not this run's
    run = runs.start_command(rpcrun(STANDIN, "--world_size", 2, "--seconds", 0.1, "--profile",
                                    traces), merged=True).wait(30)
    assert run.returncode == 0, run.output
    assert re.fullmatch(r"rpcrun: wrote the timeline of 2 ranks to .*timeline\.json \(\d+ kB\): "
                        r"open it in https://ui\.perfetto\.dev", run.last_line)
    events = json.loads((traces / "timeline.json").read_text())["traceEvents"]
    assert [e["args"]["name"] for e in events if e["name"] == "process_name"] == ["rank0",
                                                                                   "rank1"]
