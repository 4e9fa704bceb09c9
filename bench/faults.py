"""`make faults`: every failure a user can cause, in every entry point and launch mode, and what
each terminal showed. Writes bench/FAULTS-<N>-cores.md (N: this machine's cores), the evidence
behind docs/failures.md, whose measured table it rewrites.

A cell is an entry point (10 RPC programs, 2 Monarch programs), a launch mode (every rank from
one command, `spawn-all`; a rank a terminal, `per-rank`, started in a changing order; `torchrun`;
the Monarch programs' own, `monarch`) and a fault. Every terminal runs its command under the
supervisor, `python -m rpc_harness COMMAND` (rpcrun), but torchrun's, which supervises its own
workers. With --plain, the same cells run the plain commands (torch alone, no rpcrun; torchrun's
cells are the same either way, and left out), into bench/FAULTS-plain-torch<T>-<N>-cores.md (T:
torch's minor version, as the plain commands are measured on the newest and the oldest): a cell
still running PLAIN_END_SECONDS after its fault is ended and shown as "running". The faults:

    kill-rank      SIGKILL of a rank's own process (an actor's process, for Monarch)
    kill-command   SIGKILL of the command a user started (rpcrun, or the plain command)
    ctrl-c         SIGINT to every process of a terminal, as Ctrl-C sends it
    ctrl-c-again   Ctrl-C pressed 2 or 3 times, 0.1 to 0.5 s apart (the counts and gaps change
                   from cell to cell)
    sigterm        SIGTERM to the command (`kill PID`)
    sigterm-again  SIGTERM sent to the command 2 or 3 times, 0.1 to 0.5 s apart
    stop           SIGSTOP of a rank's process, past rpcrun's --lost_timeout (Monarch's
                   --call_timeout), then SIGCONT
    never-comes    one rank never started (per-rank)
    other-flags    one rank started with a flag that differs (per-rank)
    raise          the rank's own code raises: a function it calls at each step
                   (bench/fault_injection/sitecustomize.py)
    pipe-closed    the output of a terminal (per-rank: a rank that prints) piped into a program that
                   stops reading, as `| head` does: its standard output is a pipe, closed once
                   the run is under way
    bad-path       --summary_json in a folder that does not exist, for every rank

Each terminal is a command in a session of its own, its standard output and error in one file,
in the order a terminal shows them. For each cell: each terminal's last line and exit status,
the seconds from the fault until the last process of the cell is gone, and the processes left
10 s after the terminals ended (then killed).

Each cell is recorded as it ends, in bench/faults-<N>-cores.json
(faults-plain-torch<T>-<N>-cores.json with --plain), with the commit it ran on. The pages are
written from that record, after a run and when Ctrl-C or SIGTERM stops one: a run picks up
where the last one stopped, skipping the cells already recorded, so that the matrix can run in
parts. --again runs the chosen cells again (after a change to rpcrun or an example, say),
replacing their records.

    python bench/faults.py              # the whole matrix (hours on 2 cores; resumes)
    python bench/faults.py --plain      # the same with the plain commands
    python bench/faults.py --quick      # param_server/main.py and actors.py, every mode and fault
    python bench/faults.py --program rl_cartpole/main.py --mode per-rank --fault stop --again
"""

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from ports import free_port

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
PY = sys.executable
CORES = len(os.sched_getaffinity(0))
# The plain commands are torch's own doing, measured on more than one torch (the newest and the
# oldest that requirements.txt allows): their record and page are named by its minor version.
TORCH_MINOR = ".".join(torch.__version__.split("+")[0].split(".")[:2])
INJECTION = BENCH / "fault_injection"
# rpcrun's bounds in the cells: short, so that the waits they bound end soon (its own: 60 s to
# join, 30 s lost). Monarch's --call_timeout, the same as --lost_timeout.
JOIN_TIMEOUT = 10
LOST_TIMEOUT = 6
RPCRUN = ["-m", "rpc_harness", "--join_timeout", JOIN_TIMEOUT, "--lost_timeout", LOST_TIMEOUT]
# The Monarch programs' bound on each answer, their first included: the trainers' first call
# makes their data and model, which took more than 6 s beside another cell on 2 cores.
CALL_TIMEOUT = 30
# How long a cell may take to get under way, and then to end after its fault (the plain
# commands: how long a cell is given before it is shown as still running).
START_SECONDS = 150
END_SECONDS = 90
PLAIN_END_SECONDS = 40
# How long the processes of a cell have to be gone once its terminals have ended.
LEFT_SECONDS = 10


@dataclass
class Program:
    """An entry point, and how the matrix runs it."""

    path: str  # from the repository's root
    world_size: int  # the smallest world with every role (3 where rank 0 passes on news)
    endless: list  # flags for a run that lasts until a fault ends it
    working: str  # a line that shows the run under way (a regular expression)
    victim: int = 1  # the rank that a fault acts on
    printer: int = None  # pipe-closed's rank: one that prints as it runs (default: the victim)
    raises: tuple = ()  # where the injected error goes: module:function, rank, call (Monarch:
    # module:function, call)
    # Where the raising code runs in an RPC that another rank made: that rank, whose process
    # fails with the error (torch's RPC carries it back, the callee's traceback inside its own).
    caller: int = None
    monarch: bool = False

    @property
    def piped(self):
        """The rank whose terminal pipe-closed pipes into a program that stops reading (a rank
        that prints nothing more would never meet the closed pipe)."""
        return self.victim if self.printer is None else self.printer

    @property
    def modes(self):
        return ["monarch"] if self.monarch else ["spawn-all", "per-rank", "torchrun"]


SYNTHETIC = ["--dataset", "synthetic"]
BACKWARD = "torch.distributed.autograd:backward"  # a trainer's step, in the RPC programs
PROGRAMS = [
    Program("param_server/main.py", 2, [*SYNTHETIC, "--epochs", 1000, "--log_interval", 2],
            r"^Rank \d training batch 2 ", raises=(BACKWARD, 1, 4)),
    Program("param_server/batch.py", 3, [*SYNTHETIC, "--epochs", 1000, "--log_interval", 2],
            r"^Rank \d training batch 2 ", raises=("torch.nn.functional:nll_loss", 1, 4),
            caller=0),
    Program("param_server/actors.py", 2, [*SYNTHETIC, "--max_batches", 100000,
                                          "--log_interval", 2],
            r"^Rank \d training batch 2 ", raises=("torch.nn.functional:nll_loss", 6),
            monarch=True),
    Program("rl_cartpole/main.py", 2, ["--max_episodes", 100000, "--log_interval", 1],
            r"^Episode 2\t", raises=("torch.optim:Adam.step", 0, 4), printer=0),
    Program("rl_cartpole/batch.py", 3, ["--max_episodes", 100000, "--log_interval", 1],
            r"^Episode 2\t", raises=("torch.optim:Adam.step", 0, 4), printer=0),
    Program("rl_cartpole/actors.py", 3, ["--max_episodes", 100000, "--log_interval", 1],
            r"^Episode 2\t", raises=("gymnasium.wrappers.common:TimeLimit.step", 40), monarch=True),
    Program("rnn_model_parallel/main.py", 2, ["--epochs", 100000],
            r"^Training epoch 1$", raises=(BACKWARD, 1, 30)),
    Program("ddp_rpc_hybrid/main.py", 4, ["--epochs", 100000],
            r"^Training done for epoch 0$", victim=0, raises=(BACKWARD, 0, 15), caller=2),
    Program("ddp_rpc_hybrid/remote_module.py", 4, ["--epochs", 100000],
            r"^Training done for epoch 0$", victim=0, raises=(BACKWARD, 0, 15), caller=2),
    Program("pipeline_parallel/main.py", 3, ["--num_split", 2, "--num_batches", 100000,
                                             "--batch_size", 4],
            r"^Processing batch 1$", raises=(BACKWARD, 0, 3), printer=0),
    Program("pipeline_parallel/pipelining.py", 2, ["--num_split", 2, "--num_batches", 100000,
                                                   "--batch_size", 4, "--schedule", "GPipe"],
            r"^GPipe, n_microbatches 2, batch 1:", raises=("torch.optim:SGD.step", 1, 3)),
    # The recipe has no loop to make endless: its run is under way once a worker has joined
    # (its profiles' tables are empty on today's torch, which records the caller alone).
    Program("rpc_profiling/main.py", 2, [],
            r"^DEBUG:root:worker\d successfully initialized RPC\.$", raises=("torch:rand", 1, 1),
            caller=0),
]
BY_PATH = {program.path: program for program in PROGRAMS}
FAULTS = ["kill-rank", "kill-command", "ctrl-c", "ctrl-c-again", "sigterm", "sigterm-again",
          "stop", "never-comes", "other-flags", "raise", "pipe-closed", "bad-path"]
# The status a shell gives a program whose output pipe closed under it (128 + SIGPIPE).
PIPE_CLOSED = 128 + signal.SIGPIPE
# A path that no run can write: --summary_json in a folder that is not there.
BAD_PATH = "/nonexistent-folder-of-make-faults/summary.json"
# A repeated signal's presses and the gap between them, which change from cell to cell.
MODES = ["spawn-all", "per-rank", "torchrun", "monarch"]
REPEATS = [(2, 0.1), (3, 0.3), (2, 0.5), (3, 0.1), (2, 0.3), (3, 0.5)]
# Faults that need terminals of their own: one command starts every rank otherwise.
PER_RANK_ONLY = {"never-comes", "other-flags"}
# Faults that are there from the start: the cell does not wait for the run to get under way.
FROM_THE_START = PER_RANK_ONLY | {"bad-path"}
# Faults whose cells spend most of their time waiting for a bound to pass.
WAITING_FAULTS = {"never-comes", "other-flags", "stop"}
QUICK = ["param_server/main.py", "param_server/actors.py"]


# --------- Processes --------------------

def _stat(pid):
    """(state, parent, session, start time) of a process, or None where it has ended."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return fields[0], int(fields[1]), int(fields[3]), int(fields[19])


def _all_processes():
    """{pid: stat} of every live process (zombies are gone already)."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat and stat[0] != "Z":
                found[int(entry)] = stat
    return found


def _cmdline(pid):
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _environ(pid):
    try:
        pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    return dict(pair.decode(errors="replace").partition("=")[::2] for pair in pairs if pair)


def children(pid):
    """The processes that `pid` started, oldest first, without multiprocessing's resource
    tracker."""
    found = sorted((stat[3], child) for child, stat in _all_processes().items() if stat[1] == pid)
    return [child for _, child in found if "resource_tracker" not in _cmdline(child)]


# The terminals of the cells under way, so that a Ctrl-C or SIGTERM to this program ends them
# too: each is a session of its own, which a terminal's Ctrl-C does not reach.
_in_play = []
_in_play_lock = threading.Lock()
_ending = threading.Event()


class _Ended(Exception):
    """This program was told to end (Ctrl-C, SIGTERM)."""


def _raise_ended(number, frame):
    raise _Ended()


def end_every_terminal():
    """Stop starting terminals, and SIGKILL every process of the terminals under way: one
    snapshot of the process tree first, so that a command's processes are found through it
    before any of them ends."""
    with _in_play_lock:
        _ending.set()
        terminals = list(_in_play)
    processes = _all_processes()
    pids = {pid for terminal in terminals for pid in terminal.session(processes)}
    for pid in pids:
        with _gone_already():
            os.kill(pid, signal.SIGKILL)
    return len(terminals)


class Terminal:
    """One command, as a user starts it in a terminal: a session of its own, its standard
    output and error in one file."""

    def __init__(self, name, cmd, env, folder, piped=False):
        self.name = name
        self.log = folder / f"{re.sub(r'[^a-z0-9]+', '-', name.lower())}.log"
        self.cmd = [str(part) for part in cmd]
        self.piped = piped  # its standard output a pipe that this program reads, until closed
        with _in_play_lock:
            if _ending.is_set():  # Ctrl-C or SIGTERM to this program: no new terminal
                raise _Ended()
            with open(self.log, "w") as log:
                self.proc = subprocess.Popen(
                    self.cmd, env=env, cwd=ROOT, stderr=log if piped else subprocess.STDOUT,
                    stdout=subprocess.PIPE if piped else log, start_new_session=True)
            _in_play.append(self)
        self.ended_at = None
        if piped:
            self.stop_reading = threading.Event()
            threading.Thread(target=self._read_the_pipe, daemon=True).start()

    def _read_the_pipe(self):
        """Copy what comes down the pipe to the log, as a terminal after `| head` shows it;
        once close_pipe() was called, close the pipe at the next line, as `head` does once it
        has its lines: the program's next write meets a pipe that nobody reads."""
        with open(self.log, "ab") as log:
            for line in iter(self.proc.stdout.readline, b""):
                if self.stop_reading.is_set():
                    break
                log.write(line)
                log.flush()
        self.proc.stdout.close()

    def close_pipe(self):
        self.stop_reading.set()

    @property
    def output(self):
        return self.log.read_text(errors="replace")

    def last_line(self):
        lines = [line for line in self.output.splitlines() if line.strip()]
        return lines[-1].strip() if lines else ""

    def poll(self):
        if self.ended_at is None and self.proc.poll() is not None:
            self.ended_at = time.monotonic()
        return self.proc.returncode

    def session(self, processes=None):
        """The processes of this terminal: its session, and whatever its command started, and
        they, in sessions of their own (torchrun's processes). `processes`: a snapshot of
        _all_processes(), or a new one."""
        processes = processes or _all_processes()
        ours = {pid for pid, stat in processes.items() if stat[2] == self.proc.pid}
        ours.add(self.proc.pid)
        grew = True
        while grew:
            found = {pid for pid, stat in processes.items() if stat[1] in ours} - ours
            grew = bool(found)
            ours |= found
        return [pid for pid in ours if pid in processes]


# --------- A cell --------------------

@dataclass
class Cell:
    program: str
    mode: str
    fault: str
    order: list = field(default_factory=list)  # per-rank: the ranks in the order started
    terminals: list = field(default_factory=list)  # (name, last line, status, seconds)
    seconds: float = None  # from the fault until the last process was gone
    left: int = 0  # processes alive LEFT_SECONDS after the terminals ended
    problem: str = ""  # what did not happen as it should, if anything
    wall: float = None  # the cell's own seconds, from its first terminal's start
    tracebacks: list = field(default_factory=list)  # the terminals that showed a traceback


def start_terminals(program, mode, fault, port, env, folder, plain):
    """The cell's terminals (for per-rank, in a start order that changes from program to
    program) and the start order. Each runs its command under rpcrun, unless `plain`, or under
    torchrun."""
    endless = [*program.endless, *(["--summary_json", BAD_PATH] if fault == "bad-path" else [])]
    common = [*endless, "--master_port", port]
    script = ROOT / program.path
    python = [PY] if plain else [PY, *RPCRUN, "--port", free_port()]
    piped = fault == "pipe-closed"
    if mode == "monarch":
        flags = [*endless, "--call_timeout", CALL_TIMEOUT]
        return [Terminal("controller", [*python, script, *flags], env, folder, piped)], []
    if mode == "spawn-all":
        cmd = [*python, script, "--world_size", program.world_size, *common]
        return [Terminal("command", cmd, env, folder, piped)], []
    if mode == "torchrun":
        cmd = [PY, "-m", "torch.distributed.run", "--nproc_per_node", program.world_size,
               "--master_port", port, script, *endless]
        return [Terminal("torchrun", cmd, env, folder, piped)], []
    ranks = list(range(program.world_size))
    shift = PROGRAMS.index(program) + FAULTS.index(fault)
    order = ranks[shift % len(ranks):] + ranks[:shift % len(ranks)]
    if shift % 2:
        order.reverse()
    terminals = {}
    for rank in order:
        if fault == "never-comes" and rank == program.victim:
            continue
        flags = ["--seed", 7] if fault == "other-flags" and rank == program.victim else []
        cmd = [*python, script, "--world_size", program.world_size, "--rank", rank, *common,
               *flags]
        terminals[rank] = Terminal(f"rank {rank}", cmd, env, folder,
                                   piped and rank == program.piped)
        time.sleep(0.2)  # one terminal after another, in this order
    return [terminals[rank] for rank in sorted(terminals)], order


def rank_process(program, mode, terminals, rank, plain):
    """The pid of a rank's own process (an actor's, for Monarch): a child of the command, which
    rpcrun started, unless `plain`."""
    if mode == "spawn-all":
        return children(command_process(terminals[0], plain))[rank]
    if mode == "per-rank":
        terminal = next(t for t in terminals if t.name == f"rank {rank}")
        return children(command_process(terminal, plain))[0]
    if mode == "torchrun":
        for command in children(terminals[0].proc.pid):
            if _environ(command).get("RANK") == str(rank):
                return children(command)[0]
        raise RuntimeError(f"torchrun has no rank {rank}")
    actors = [pid for pid in terminals[0].session() if "bootstrap_main" in _cmdline(pid)]
    return sorted(actors, key=lambda pid: _stat(pid)[3])[0]


def command_process(terminal, plain):
    """The pid of the example's command in a terminal: rpcrun's child, or the terminal's."""
    return terminal.proc.pid if plain else children(terminal.proc.pid)[0]


def command_of(program, mode, terminals, rank=None):
    """The command that the fault's terminal started (per-rank: the victim's, or `rank`'s)."""
    if mode == "per-rank":
        rank = program.victim if rank is None else rank
        return next(t for t in terminals if t.name == f"rank {rank}")
    return terminals[0]


def wait_for(terminals, pattern, seconds):
    """Until one terminal's output matches `pattern`; False if a terminal ended first or the
    time ran out."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if any(re.search(pattern, t.output, re.M) for t in terminals):
            return True
        if any(t.poll() is not None for t in terminals):
            return False
        time.sleep(0.1)
    return False


def wait_for_the_end(terminals, seconds, stopped=None):
    """Until every terminal has ended (`seconds` at most). A stopped process is resumed once
    every other terminal has ended, or a third of the time has passed."""
    deadline = time.monotonic() + seconds
    resume_at = time.monotonic() + seconds / 3
    while time.monotonic() < deadline:
        running = [t for t in terminals if t.poll() is None]
        if not running:
            return True
        if stopped and (time.monotonic() > resume_at or all(
                t.poll() is not None for t in terminals if t is not stopped[1])):
            with _gone_already():
                os.kill(stopped[0], signal.SIGCONT)
            stopped = None
        time.sleep(0.05)
    return False


class _Watcher:
    """Notes every process of the terminals, four times a second, from a thread of its own:
    a process that a command started and that outlives it (an orphan) is still counted."""

    def __init__(self, terminals, known):
        self.terminals = terminals
        self.known = known
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self):
        while not self.done.wait(0.25):
            processes = _all_processes()
            for terminal in self.terminals:
                self.known.update(terminal.session(processes))

    def stop(self):
        self.done.set()
        self.thread.join()
        for terminal in self.terminals:
            self.known.update(terminal.session())


class _gone_already:
    """Leaves out the error of a signal to a process that has ended."""

    def __enter__(self):
        return self

    def __exit__(self, kind, value, traceback):
        return kind is ProcessLookupError


def run_cell(program, mode, fault, folder, plain=False):
    """Run one cell: start, fault, wait for the end; what each terminal showed. `plain`: the
    plain commands, which may still run PLAIN_END_SECONDS after the fault (then ended)."""
    cell = Cell(program.path, mode, fault)
    cell_started = time.monotonic()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    raised = folder / "raised"
    if fault == "raise":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(INJECTION),
                                                          env.get("PYTHONPATH")]))
        env["FAULTS_RAISED"] = str(raised)
        kind = "actor" if program.monarch else "rank"
        env["FAULTS_RAISE"] = f"{kind} " + " ".join(map(str, program.raises))
    terminals, cell.order = start_terminals(program, mode, fault, free_port(), env, folder,
                                            plain)
    known = set()  # every process of the cell seen so far
    stopped = None
    watching = _Watcher(terminals, known)
    try:
        if fault in FROM_THE_START:
            fault_at = time.monotonic()
        elif fault == "raise":
            deadline = time.monotonic() + START_SECONDS
            while not raised.exists() and time.monotonic() < deadline and all(
                    t.poll() is None for t in terminals):
                time.sleep(0.05)
            fault_at = time.monotonic()
            if raised.exists():
                fault_at -= max(0.0, time.time() - float(raised.read_text().split()[0]))
            else:
                cell.problem = "the injected error was never raised"
        else:
            if not wait_for(terminals, program.working, START_SECONDS):
                cell.problem = "the run never got under way"
            known.update(pid for t in terminals for pid in t.session())
            fault_at = time.monotonic()
            if not cell.problem:
                stopped = act(program, mode, fault, terminals, plain)
        # torchrun's cells show what torchrun does, as the plain commands' do
        own_way = plain or mode == "torchrun"
        bound = PLAIN_END_SECONDS if own_way else END_SECONDS
        ended = wait_for_the_end(terminals, bound, stopped)
        watching.stop()
        if not ended and not own_way:
            cell.problem = cell.problem or f"a terminal was still running {bound} s on"
        gone = _wait_until_gone(terminals, known, LEFT_SECONDS)
        cell.left = len(gone[1])
        cell.seconds = round(gone[0] - fault_at, 1)
    finally:
        watching.stop()
        for terminal in terminals:
            with _gone_already():
                os.killpg(terminal.proc.pid, signal.SIGKILL)
        for pid in known:
            with _gone_already():
                os.kill(pid, signal.SIGKILL)
        for terminal in terminals:
            terminal.proc.wait()
        with _in_play_lock:
            for terminal in terminals:
                _in_play.remove(terminal)
    cell.wall = round(time.monotonic() - cell_started, 1)
    cell.tracebacks = [terminal.name for terminal in terminals
                       if "Traceback (most recent call last)" in terminal.output]
    for terminal in terminals:
        seconds = None if terminal.ended_at is None else round(terminal.ended_at - fault_at, 1)
        cell.terminals.append((terminal.name, terminal.last_line(), terminal.proc.returncode,
                               seconds))
    return cell


def act(program, mode, fault, terminals, plain):
    """Apply `fault`; for stop, (the stopped pid, its terminal)."""
    if fault == "kill-rank":
        os.kill(rank_process(program, mode, terminals, program.victim, plain), signal.SIGKILL)
    elif fault == "kill-command":
        os.kill(command_of(program, mode, terminals).proc.pid, signal.SIGKILL)
    elif fault == "ctrl-c":
        os.killpg(command_of(program, mode, terminals).proc.pid, signal.SIGINT)
    elif fault == "sigterm":
        os.kill(command_of(program, mode, terminals).proc.pid, signal.SIGTERM)
    elif fault in ("ctrl-c-again", "sigterm-again"):
        command = command_of(program, mode, terminals).proc.pid
        presses, gap = REPEATS[(PROGRAMS.index(program) + MODES.index(mode)) % len(REPEATS)]
        for _ in range(presses):
            with _gone_already():
                if fault == "ctrl-c-again":
                    os.killpg(command, signal.SIGINT)
                else:
                    os.kill(command, signal.SIGTERM)
            time.sleep(gap)
    elif fault == "pipe-closed":
        command_of(program, mode, terminals, program.piped).close_pipe()
    elif fault == "stop":
        pid = rank_process(program, mode, terminals, program.victim, plain)
        os.kill(pid, signal.SIGSTOP)
        owner = command_of(program, mode, terminals) if mode == "per-rank" else None
        return pid, owner
    return None


def _wait_until_gone(terminals, known, seconds):
    """(when the last process of the cell was gone, the pids still alive after `seconds`)."""
    deadline = time.monotonic() + seconds
    while True:
        alive = {pid for pid in known if _stat(pid) and _stat(pid)[0] != "Z"}
        alive.update(pid for t in terminals for pid in t.session())
        if not alive or time.monotonic() > deadline:
            return time.monotonic(), alive
        time.sleep(0.05)


# --------- What should have happened --------------------

# The lines a terminal may end with after a fault: rpcrun's own; a program's own line for bad
# input (argparse's "PROG: error: ..."), with status 2; a Monarch program's, whose controller
# supervises its processes and says what happened in one line of its own.
RPCRUN_LINE = re.compile(r"^rpcrun: ")
OWN_BAD_INPUT = re.compile(r"^\S+\.py: error: ")
MONARCH_LINE = re.compile(r"(; stopped every process|no answer from .* \(--call_timeout\)"
                          r"|was killed by \S+|failed \(.*\))$")


def check(cell):
    """What in a cell breaks the promise, or "": a terminal without rpcrun's line last (but
    where the fault killed the terminal's own command: there the shell says "Killed"; where a
    terminal's pipe closed: quiet; where the command refused its flags: its own line, status 2;
    a Monarch program's own line; and torchrun's, whose agent reports the failure its own way,
    last), a status of 0 after a fault, a traceback but the raising rank's own (and that of the
    rank whose RPC it raised in), a process left, a terminal still running."""
    if cell.problem:
        return cell.problem
    if cell.mode == "torchrun":  # torchrun's own way, which the page reports: not rpcrun's
        return ""
    program = BY_PATH[cell.program]
    if cell.mode != "torchrun":
        failing = {f"rank {program.raises[1]}", f"rank {program.caller}"}
        shown = [name for name in cell.tracebacks
                 if cell.fault != "raise" or (cell.mode == "per-rank" and name not in failing)]
        if shown:
            return f"{shown[0]}: a traceback"
    for name, line, status, _ in cell.terminals:
        killed = cell.fault == "kill-command" and status == -signal.SIGKILL and (
            cell.mode != "per-rank" or name == f"rank {program.victim}")
        piped = cell.fault == "pipe-closed" and (
            cell.mode != "per-rank" or name == f"rank {program.piped}")
        if status == 0:
            return f"{name}: status 0"
        if piped and cell.mode != "torchrun":
            # quiet: what it printed before the pipe closed is its last line
            if status != PIPE_CLOSED:
                return f"{name}: status {status} after its pipe closed, not {PIPE_CLOSED}"
            continue
        if killed or cell.mode == "torchrun":
            continue
        if RPCRUN_LINE.search(line) or (status == 2 and OWN_BAD_INPUT.search(line)):
            continue
        if cell.mode == "monarch" and MONARCH_LINE.search(line):
            continue
        return f"{name}: its last line is not rpcrun's"
    if cell.left:
        return f"{cell.left} process(es) left"
    return ""


def what_plain_did(cell):
    """A plain cell in words, as its row of the plain page counts it: whether every terminal
    ended by itself, the tracebacks shown, the processes left. Plain commands make no promise
    to check them against."""
    running = [name for name, _, _, ended in cell.terminals if ended is None]
    words = [f"{', '.join(running)} still running {PLAIN_END_SECONDS} s on" if running
             else "every terminal ended"]
    if cell.tracebacks:
        words.append(f"a traceback in {', '.join(cell.tracebacks)}")
    if cell.left:
        words.append(f"{cell.left} process(es) left")
    if cell.problem:
        words.append(cell.problem)
    return "; ".join(words)


def status_shown(status):
    """An exit status as a shell shows it: 128 + N for a command killed by signal N."""
    if status is not None and status < 0:
        return f"{128 - status}, {signal.Signals(-status).name}"
    return str(status)


# --------- The report --------------------

def machine():
    return (f"{platform.node() or 'this machine'}: {CORES} cores, Python "
            f"{platform.python_version()}, torch {torch.__version__}")


SUMMARY_HEADER = "| mode | fault | as they should be | statuses | most seconds |"
PLAIN_HEADER = ("| mode | fault | ended within {seconds} s | statuses | cells with a traceback "
                "| cells with processes left |")


def _named(plain):
    return f"plain-torch{TORCH_MINOR}-{CORES}-cores" if plain else f"{CORES}-cores"


def results_path(plain):
    return BENCH / f"FAULTS-{_named(plain)}.md"


def record_path(plain):
    """Where the cells are recorded as they end: the pages are written from it."""
    return BENCH / f"faults-{_named(plain)}.json"


def cell_key(program_path, mode, fault):
    return f"{program_path} {mode} {fault}"


def load_record(plain):
    """The record of the cells run so far: {"cells": {key: cell and "commit", "date"},
    "seconds": the minutes of every run together, in seconds}."""
    path = record_path(plain)
    record = json.loads(path.read_text()) if path.exists() else {}
    record.setdefault("cells", {})
    record.setdefault("seconds", 0.0)
    return record


def write_whole(path, text):
    """Write a file whole: a temporary file, then renamed, so that a stop in the middle never
    leaves half of it."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    temporary.replace(path)


def save_record(record, plain):
    write_whole(record_path(plain), json.dumps(record, indent=1, sort_keys=True) + "\n")


def record_cell(record, cell, commit_ran):
    record["cells"][cell_key(cell.program, cell.mode, cell.fault)] = {
        **asdict(cell), "commit": commit_ran, "date": datetime.date.today().isoformat()}


def recorded_cells(record, plain):
    """The recorded cells, in the matrix's order, as Cells; and the commits they ran on."""
    cells, commits = [], []
    for program, mode, fault in whole_matrix(plain):
        entry = record["cells"].get(cell_key(program.path, mode, fault))
        if entry is None:
            continue
        fields = {name: value for name, value in entry.items() if name not in ("commit", "date")}
        fields["terminals"] = [tuple(terminal) for terminal in fields["terminals"]]
        cells.append(Cell(**fields))
        if entry["commit"] not in commits:
            commits.append(entry["commit"])
    return cells, commits


def commit():
    """The checkout's commit (with "+" where files differ from it), which the cells ran. What
    this script writes (the records, the pages, docs/failures.md) is not counted."""
    def git(*words):
        return subprocess.run(["git", *words], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip()
    written_here = [f":(exclude){path.relative_to(ROOT)}" for plain in (False, True)
                    for path in (record_path(plain), results_path(plain))]
    written_here.append(":(exclude)docs/failures.md")
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", *written_here)
    return (git("rev-parse", "--short", "HEAD") or "?") + ("+" if changed else "")


def summary_table(cells, plain):
    """The table "By launch mode and fault": supervised, the cells as they should be, the
    statuses seen and the most seconds until every process was gone; plain, how many cells
    ended by themselves within PLAIN_END_SECONDS, the statuses, and the cells that showed a
    traceback or left a process."""
    groups = {}
    for cell in cells:
        groups.setdefault((cell.mode, cell.fault), []).append(cell)
    if plain:
        rows = [PLAIN_HEADER.format(seconds=PLAIN_END_SECONDS), "|---|---|---:|---|---:|---:|"]
    else:
        rows = [SUMMARY_HEADER, "|---|---|---:|---|---:|"]
    for (mode, fault), group in groups.items():
        statuses = sorted({"running" if ended is None else status_shown(status)
                           for cell in group for _, _, status, ended in cell.terminals}, key=str)
        if plain:
            ended = sum(1 for cell in group if all(t[3] is not None for t in cell.terminals))
            tracebacks = sum(1 for cell in group if cell.tracebacks)
            left = sum(1 for cell in group if cell.left)
            rows.append(f"| {mode} | {fault} | {ended} of {len(group)} | {'; '.join(statuses)} "
                        f"| {tracebacks} | {left} |")
            continue
        seconds = [cell.seconds for cell in group if cell.seconds is not None]
        good = sum(1 for cell in group if not check(cell))
        rows.append(f"| {mode} | {fault} | {good} of {len(group)} | {'; '.join(statuses)} | "
                    f"{max(seconds) if seconds else ''} |")
    return rows


def bounds(plain):
    if plain:
        return (f"the plain commands, torch alone; a cell still running {PLAIN_END_SECONDS} s "
                "after its fault was ended, its terminals shown as `running`")
    return (f"rpcrun `--join_timeout {JOIN_TIMEOUT} --lost_timeout {LOST_TIMEOUT}` (Monarch: "
            f"`--call_timeout {CALL_TIMEOUT}`); torchrun's cells are torchrun's own way, "
            f"without rpcrun, given {PLAIN_END_SECONDS} s after the fault")


def write(record, plain):
    """The page of every recorded cell (bench/FAULTS-*.md), and docs/failures.md's table;
    nothing while no cell is recorded (the pages keep what they say)."""
    cells, commits = recorded_cells(record, plain)
    if not cells:
        return
    matrix = len(whole_matrix(plain))
    flags = " --plain" if plain else ""
    missing = "" if len(cells) == matrix else f" ({matrix - len(cells)} not run yet)"
    lines = [
        f"# What each terminal shows when something fails ({CORES} cores"
        f"{', the plain commands' if plain else ''})",
        "",
        f"`python bench/faults.py{flags}` on {machine()}: {len(cells)} of the matrix's {matrix} "
        f"cells{missing}, {record['seconds'] / 60:.1f} minutes of runs in all, on commit(s) "
        f"{', '.join(commits) or '?'}; {bounds(plain)}. A cell: an entry point, a launch mode, a "
        "fault (bench/faults.py's docstring says what each does). For each terminal: its last "
        "line, its exit status and the seconds from the fault until it ended; then the seconds "
        "until the last process of the cell was gone, and the processes left "
        f"{LEFT_SECONDS:g} s after the terminals ended. Per-rank terminals are listed by rank; "
        "the order they were started in is given.",
        "",
    ]
    broken = [] if plain else [cell for cell in cells if check(cell)]
    if not plain:
        lines += [f"Cells where something did not happen as it should: {len(broken)}."]
        for cell in broken:
            lines.append(f"- {cell.program} {cell.mode} {cell.fault}: {check(cell)}")
    lines += ["", "## By launch mode and fault", "", "Over every entry point.", ""]
    table = summary_table(cells, plain)
    lines += [*table, ""]
    write_failures_page(table, len(cells), matrix, len(broken), commits, plain)
    for program in dict.fromkeys(cell.program for cell in cells):
        lines += [f"## {program}", "",
                  "| mode | fault | terminal: last line (status, seconds) | all gone (s) | "
                  "left |", "|---|---|---|---:|---:|"]
        for cell in (cell for cell in cells if cell.program == program):
            shown = []
            for name, line, status, ended in cell.terminals:
                line = line.replace("|", "\\|")
                if len(line) > 240:
                    line = line[:237] + "..."
                when = "running" if ended is None else f"{ended:g} s"
                shown.append(f"**{name}**: `{line}` ({status_shown(status)}, {when})")
            mode = cell.mode
            if cell.order:
                mode += f" (started {', '.join(map(str, cell.order))})"
            lines.append(f"| {mode} | {cell.fault} | {'<br>'.join(shown)} | "
                         f"{'' if cell.seconds is None else cell.seconds} | {cell.left} |")
        lines.append("")
    write_whole(results_path(plain), "\n".join(lines))


def write_failures_page(table, cells, matrix, broken, commits, plain):
    """docs/failures.md's measured part, between its markers (one pair for each kind of run):
    the table "By launch mode and fault" of this run, so that the page's statuses and seconds
    are the ones measured."""
    page = ROOT / "docs" / "failures.md"
    kind = "make faults PLAIN=1" if plain else "make faults"
    marker = f"{kind}, torch {TORCH_MINOR}" if plain else kind
    begin, end = f"<!-- {marker}: begin -->", f"<!-- {marker}: end -->"
    text = page.read_text()
    if begin not in text or end not in text:
        print(f"{page.relative_to(ROOT)} has no table for this run (no {begin} and {end}): "
              f"only {results_path(plain).relative_to(ROOT)} is written", flush=True)
        return
    before, _, rest = text.partition(begin)
    _, _, after = rest.partition(end)
    results = results_path(plain).relative_to(ROOT)
    counted = (f"Cells: {cells} of {matrix}" + ("" if cells == matrix else " (the others not "
               "run yet)") + ("" if plain else f"; as they should be: {cells - broken}"))
    measured = [begin,
                f"Measured by `{kind}` on {machine()}, commit(s) {', '.join(commits) or '?'}. "
                f"Bounds: {bounds(plain)}. {counted}. Each cell is in [{results}](../{results}).",
                "",
                *table, end]
    write_whole(page, before + "\n".join(measured) + after)


def cells_to_run(programs, modes, faults, plain):
    """The cells of these programs, modes and faults (None: every one), in the matrix's order."""
    for program in (BY_PATH[path] for path in (programs or BY_PATH)):
        for mode in program.modes:
            if modes and mode not in modes:
                continue
            if plain and mode == "torchrun":
                continue  # torchrun's cells are plain already
            for fault in FAULTS:
                if faults and fault not in faults:
                    continue
                if fault in PER_RANK_ONLY and mode != "per-rank":
                    continue
                yield program, mode, fault


def whole_matrix(plain):
    return list(cells_to_run(None, None, None, plain))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plain", action="store_true",
                        help="the plain commands (torch alone, no rpcrun), into "
                             f"{results_path(True).name}")
    parser.add_argument("--quick", action="store_true",
                        help=f"only {' and '.join(QUICK)}, every mode and fault")
    parser.add_argument("--program", action="append", choices=list(BY_PATH),
                        help="only this entry point (again for more)")
    parser.add_argument("--mode", action="append",
                        choices=["spawn-all", "per-rank", "torchrun", "monarch"])
    parser.add_argument("--fault", action="append", choices=FAULTS)
    parser.add_argument("--one_at_a_time", "--one-at-a-time", action="store_true",
                        help="no cell beside another (by default the cells that mostly wait "
                             "for a bound run beside the others, one of each at a time)")
    parser.add_argument("--again", action="store_true",
                        help="run the chosen cells even where they are recorded, replacing "
                             "their records (by default a run skips them)")
    parser.add_argument("--no_write", "--no-write", action="store_true",
                        help="print the cells; record nothing, write no page")
    args = parser.parse_args(argv)
    # Each terminal gets Ctrl-C (SIGINT) as a terminal's command does. Started in the background
    # of a non-interactive shell (`make faults &`, nohup), this process inherits SIGINT ignored,
    # and so would every command it starts: the Monarch programs, which keep Python's handling of
    # SIGINT, then ran on past their Ctrl-C. Python's own handler here: a command started from
    # this process gets SIGINT's default, as exec resets a handled signal.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    started = time.monotonic()
    record = load_record(args.plain)
    chosen = list(cells_to_run(args.program or (QUICK if args.quick else None), args.mode,
                               args.fault, args.plain))
    todo = [(program, mode, fault) for program, mode, fault in chosen
            if args.again or args.no_write
            or cell_key(program.path, mode, fault) not in record["cells"]]
    print(f"{len(todo)} cell(s) to run, {len(chosen) - len(todo)} recorded already "
          f"({record_path(args.plain).relative_to(ROOT)}; --again runs them again)", flush=True)
    printing = threading.Lock()
    cells = [None] * len(todo)

    # Two lanes: the cells that spend most of their time waiting for a bound (--join_timeout,
    # --lost_timeout) run beside the others, one of each at a time; the waiting lane, its own
    # cells done, takes the others' from the end of their list. One cell at a time, a matrix of
    # 212 cells took 36 minutes on 2 cores; with the waiting cells beside the others, 31, the
    # waiting lane idle for its last 13. Where cells overlap, a cell's seconds include the
    # other's load.
    waiting = deque(number for number, (_, _, fault) in enumerate(todo)
                    if fault in WAITING_FAULTS)
    busy = deque(number for number in range(len(todo)) if number not in waiting)
    taking = threading.Lock()

    def next_cell(lane):
        """The next cell's number for `lane` (None: none left)."""
        with taking:
            if args.one_at_a_time:
                queue = busy if busy else waiting
                return queue.popleft() if queue else None
            if lane == "waiting" and waiting:
                return waiting.popleft()
            if lane == "waiting":
                return busy.pop() if busy else None
            return busy.popleft() if busy else None

    def run(lane):
        while not _ending.is_set() and (number := next_cell(lane)) is not None:
            program, mode, fault = todo[number]
            folder = Path(scratch) / str(number)
            folder.mkdir()
            try:
                cell = run_cell(program, mode, fault, folder, args.plain)
            except _Ended:  # the main thread ends every terminal, and this program
                return
            except OSError:
                if _ending.is_set():  # its logs removed as this program ends: no cell's doing
                    return
                raise
            with printing:
                if _ending.is_set():
                    # This program was stopped and ended the cell's terminals: they did not end
                    # by the cell's fault, so the cell is not recorded (the next run runs it).
                    return
                cells[number] = cell
                if not args.no_write:
                    record_cell(record, cell, commit())
                    save_record(record, args.plain)
                verdict = what_plain_did(cell) if args.plain else (check(cell) or "ok")
                print(f"{program.path} {mode} {fault}: {verdict}; gone in "
                      f"{cell.seconds} s; the cell took {cell.wall} s", flush=True)
                for name, line, status, ended in cell.terminals:
                    print(f"    {name}: {line[:160]!r} ({status_shown(status)}, {ended} s)",
                          flush=True)

    lanes = ["busy"] if args.one_at_a_time else ["busy", "waiting"]
    signal.signal(signal.SIGTERM, _raise_ended)
    scratch = tempfile.mkdtemp(prefix="faults-")
    try:
        # Daemons: on Ctrl-C or SIGTERM this thread ends their terminals, and the program.
        threads = [threading.Thread(target=run, args=(lane,), daemon=True) for lane in lanes]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    except (KeyboardInterrupt, _Ended) as ended:
        # A second Ctrl-C or SIGTERM must not cut this short: every terminal ends, and the
        # record and the pages are written whole.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        count = end_every_terminal()
        shutil.rmtree(scratch, ignore_errors=True)
        with printing:  # no lane records a cell from now on: the record is whole
            done = sum(1 for cell in cells if cell is not None)
            if not args.no_write:
                record["seconds"] += time.monotonic() - started
                save_record(record, args.plain)
                write(record, args.plain)
        kept = ("nothing recorded (--no_write)" if args.no_write else
                "each recorded, and the pages written from the record; the next run picks up "
                "here")
        print(f"interrupted: ended the {count} terminal(s) of the cells under way; {done} "
              f"cell(s) of this run had ended, {kept}", file=sys.stderr, flush=True)
        os._exit(130 if isinstance(ended, KeyboardInterrupt) else 143)
    shutil.rmtree(scratch, ignore_errors=True)
    seconds = time.monotonic() - started
    ran = [cell for cell in cells if cell is not None]
    if args.no_write:
        judged = ran
    else:
        record["seconds"] += seconds
        save_record(record, args.plain)
        write(record, args.plain)
        print(f"wrote {results_path(args.plain).relative_to(ROOT)} from "
              f"{len(record['cells'])} recorded cells; {len(ran)} ran in {seconds / 60:.1f} min")
        judged = recorded_cells(record, args.plain)[0]  # the status says what the page says
    return 0 if args.plain or not any(check(cell) for cell in judged) else 1


if __name__ == "__main__":
    sys.exit(main())
