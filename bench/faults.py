"""`make faults`: every failure a user can cause, in every entry point and launch mode, and what
each terminal showed. Writes bench/FAULTS-<N>-cores.md (N: this machine's cores), the evidence
behind the README's "When something fails".

A cell is an entry point (10 RPC programs, 2 Monarch programs), a launch mode (every rank from
one command, `spawn-all`; a rank a terminal, `per-rank`, started in a changing order; `torchrun`;
the Monarch programs' own, `monarch`) and a fault:

    kill-rank      SIGKILL of a rank's own process (an actor's process, for Monarch)
    kill-command   SIGKILL of the command a user started (one rank's command, per-rank)
    ctrl-c         SIGINT to every process of a terminal, as Ctrl-C sends it
    ctrl-c-again   Ctrl-C pressed 2 or 3 times, 0.1 to 0.5 s apart (the counts and gaps change
                   from cell to cell)
    sigterm        SIGTERM to the command (`kill PID`)
    sigterm-again  SIGTERM sent to the command 2 or 3 times, 0.1 to 0.5 s apart
    stop           SIGSTOP of a rank's process, past --rpc_timeout (--call_timeout), then SIGCONT
    never-comes    one rank never started (per-rank)
    other-flags    one rank started with a flag that differs (per-rank)
    raise          the rank's own code raises (bench/fault_injection/sitecustomize.py)
    pipe-closed    the output of a terminal (per-rank: a rank that prints) piped into a program that
                   stops reading, as `| head` does: its standard output is a pipe, closed once
                   the run is under way
    bad-path       --summary_json in a folder that does not exist, for every rank

Each terminal is a command in a session of its own, its standard output and error in one file,
in the order a terminal shows them. For each cell: each terminal's last line and exit status,
the seconds from the fault until the last process of the cell is gone, and the processes left
10 s after the terminals ended (then killed).

    python bench/faults.py              # the whole matrix (about 45 minutes on 2 cores)
    python bench/faults.py --quick      # param_server/main.py and actors.py, every mode and fault
    python bench/faults.py --program rl_cartpole/main.py --mode per-rank --fault stop
"""

import argparse
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
from dataclasses import dataclass, field
from pathlib import Path

import torch
from ports import free_port

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
PY = sys.executable
CORES = len(os.sched_getaffinity(0))
RESULTS = BENCH / f"FAULTS-{CORES}-cores.md"
INJECTION = BENCH / "fault_injection"
# The bounds the cells run with: short, so that the waits they bound end soon (the programs'
# own: 60 s each). With 4 s, two of 340 cells lost a rank that was only slow: on 2 cores, with
# another cell beside it, a rank's loop went 4 s without a turn as the ranks started.
INIT_TIMEOUT = 8
RPC_TIMEOUT = 6
# How long a cell may take to get under way, and then to end after its fault.
START_SECONDS = 150
END_SECONDS = 90
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
    raises: tuple = ("profile_step", 1, 4)  # where the injected error goes: function, rank, call
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
PROGRAMS = [
    Program("param_server/main.py", 2, [*SYNTHETIC, "--epochs", 1000, "--log_interval", 2],
            r"^Rank \d training batch 2 "),
    Program("param_server/batch.py", 3, [*SYNTHETIC, "--epochs", 1000, "--log_interval", 2],
            r"^Rank \d training batch 2 "),
    Program("param_server/actors.py", 2, [*SYNTHETIC, "--max_batches", 100000,
                                          "--log_interval", 2],
            r"^Rank \d training batch 2 ", raises=("Recorder.step", 6), monarch=True),
    Program("rl_cartpole/main.py", 2, ["--max_episodes", 100000, "--log_interval", 1],
            r"^Episode 2\t", raises=("profile_step", 0, 4), printer=0),
    Program("rl_cartpole/batch.py", 3, ["--max_episodes", 100000, "--log_interval", 1],
            r"^Episode 2\t", raises=("profile_step", 0, 4), printer=0),
    Program("rl_cartpole/actors.py", 3, ["--max_episodes", 100000, "--log_interval", 1],
            r"^Episode 2\t", raises=("gymnasium.wrappers.common:TimeLimit.step", 40), monarch=True),
    Program("rnn_model_parallel/main.py", 2, ["--epochs", 100000],
            r"^Training epoch 1$", raises=("profile_step", 1, 30)),
    Program("ddp_rpc_hybrid/main.py", 4, ["--epochs", 100000],
            r"^Training done for epoch 0$", victim=0, raises=("profile_step", 0, 15)),
    Program("ddp_rpc_hybrid/remote_module.py", 4, ["--epochs", 100000],
            r"^Training done for epoch 0$", victim=0, raises=("profile_step", 0, 15)),
    Program("pipeline_parallel/main.py", 3, ["--num_split", 2, "--num_batches", 100000,
                                             "--batch_size", 4],
            r"^Processing batch 1$", raises=("profile_step", 0, 3), printer=0),
    Program("pipeline_parallel/pipelining.py", 2, ["--num_split", 2, "--num_batches", 100000,
                                                   "--batch_size", 4, "--schedule", "GPipe"],
            r"^GPipe, n_microbatches 2, batch 1:", raises=("profile_step", 1, 3)),
    Program("rpc_profiling/main.py", 2, [],
            r"joined the other 1 rank|^-{20,}", raises=("report", 1, 1)),
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


def start_terminals(program, mode, fault, port, env, folder):
    """The cell's terminals (for per-rank, in a start order that changes from program to
    program) and the start order."""
    endless = [*program.endless, *(["--summary_json", BAD_PATH] if fault == "bad-path" else [])]
    common = [*endless, "--master_port", port, "--init_timeout", INIT_TIMEOUT,
              "--rpc_timeout", RPC_TIMEOUT]
    script = ROOT / program.path
    piped = fault == "pipe-closed"
    if mode == "monarch":
        flags = [*endless, "--init_timeout", 60, "--call_timeout", RPC_TIMEOUT]
        return [Terminal("controller", [PY, script, *flags], env, folder, piped)], []
    if mode == "spawn-all":
        cmd = [PY, script, "--world_size", program.world_size, *common]
        return [Terminal("command", cmd, env, folder, piped)], []
    if mode == "torchrun":
        flags = [*endless, "--init_timeout", INIT_TIMEOUT, "--rpc_timeout", RPC_TIMEOUT]
        cmd = [PY, "-m", "torch.distributed.run", "--nproc_per_node", program.world_size,
               "--master_port", port, script, *flags]
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
        cmd = [PY, script, "--world_size", program.world_size, "--rank", rank, *common, *flags]
        terminals[rank] = Terminal(f"rank {rank}", cmd, env, folder,
                                   piped and rank == program.piped)
        time.sleep(0.2)  # one terminal after another, in this order
    return [terminals[rank] for rank in sorted(terminals)], order


def rank_process(program, mode, terminals, rank):
    """The pid of a rank's own process (an actor's, for Monarch)."""
    if mode == "spawn-all":
        return children(terminals[0].proc.pid)[rank]
    if mode == "per-rank":
        terminal = next(t for t in terminals if t.name == f"rank {rank}")
        return children(terminal.proc.pid)[0]
    if mode == "torchrun":
        for command in children(terminals[0].proc.pid):
            if _environ(command).get("RANK") == str(rank):
                return children(command)[0]
        raise RuntimeError(f"torchrun has no rank {rank}")
    actors = [pid for pid in terminals[0].session() if "bootstrap_main" in _cmdline(pid)]
    return sorted(actors, key=lambda pid: _stat(pid)[3])[0]


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


def run_cell(program, mode, fault, folder):
    """Run one cell: start, fault, wait for the end; what each terminal showed."""
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
        if program.monarch:
            env["FAULTS_RAISE"] = "actor " + " ".join(map(str, program.raises))
        else:
            env["FAULTS_RAISE"] = "rank " + " ".join(map(str, program.raises))
    terminals, cell.order = start_terminals(program, mode, fault, free_port(), env, folder)
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
                stopped = act(program, mode, fault, terminals)
        ended = wait_for_the_end(terminals, END_SECONDS, stopped)
        watching.stop()
        if not ended:
            cell.problem = cell.problem or f"a terminal was still running {END_SECONDS} s on"
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


def act(program, mode, fault, terminals):
    """Apply `fault`; for stop, (the stopped pid, its terminal)."""
    if fault == "kill-rank":
        os.kill(rank_process(program, mode, terminals, program.victim), signal.SIGKILL)
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
        pid = rank_process(program, mode, terminals, program.victim)
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

# The harness's last lines (rpc_harness: the records of rank.py and rendezvous.py, which
# command.py says; monarch_runs.py's): how they end.
HARNESS_LINE = re.compile(
    r"(: interrupted( \(SIGTERM\))?|; stopped (the other ranks|every rank|every process)"
    r"|was killed by \S+|: lost contact with .*\)|failed \(.*\)|gave up on this rank, .*\)"
    r"|with the same (flags|values|program)|give every rank its own --rank"
    r"|exited with status \d+|(did not come|went away|cannot reach|lost a rank while) .*"
    r"|: error: --summary_json .*)$")


def check(cell):
    """What in a cell breaks the promise, or "": a terminal without our line last (but where
    the fault killed the terminal's own command: there the shell says "Killed"; and torchrun's,
    whose agent reports the failure its own way, last), a status of 0 after a fault, a process
    left, a terminal still running."""
    if cell.problem:
        return cell.problem
    if cell.fault in ("pipe-closed", "bad-path") and cell.mode != "torchrun" and cell.tracebacks:
        return f"{cell.tracebacks[0]}: a traceback"
    for name, line, status, _ in cell.terminals:
        killed = cell.fault == "kill-command" and status == -signal.SIGKILL and (
            cell.mode != "per-rank" or name == f"rank {BY_PATH[cell.program].victim}")
        piped = cell.fault == "pipe-closed" and (
            cell.mode != "per-rank" or name == f"rank {BY_PATH[cell.program].piped}")
        if status == 0:
            return f"{name}: status 0"
        if piped and cell.mode != "torchrun":
            # quiet: what it printed before the pipe closed is its last line
            if status != PIPE_CLOSED:
                return f"{name}: status {status} after its pipe closed, not {PIPE_CLOSED}"
            continue
        if killed or cell.mode == "torchrun":
            continue
        if not HARNESS_LINE.search(line):
            return f"{name}: its last line is not the harness's"
    if cell.left:
        return f"{cell.left} process(es) left"
    return ""


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


def write(cells, seconds, quick):
    lines = [
        f"# What each terminal shows when something fails ({CORES} cores)",
        "",
        f"`python bench/faults.py{' --quick' if quick else ''}` on {machine()}: "
        f"{len(cells)} cells in {seconds / 60:.1f} minutes. A cell: an entry point, a launch "
        "mode, a fault (bench/faults.py's docstring says what each does). For each terminal: "
        "its last line, its exit status and the seconds from the fault until it ended; then the "
        f"seconds until the last process of the cell was gone, and the processes left "
        f"{LEFT_SECONDS:g} s after the terminals ended. Bounds: `--init_timeout {INIT_TIMEOUT}`, "
        f"`--rpc_timeout {RPC_TIMEOUT}` (Monarch: `--call_timeout {RPC_TIMEOUT}`). "
        "Per-rank terminals are listed by rank; the order they were started in is given.",
        "",
    ]
    broken = [cell for cell in cells if check(cell)]
    lines += [f"Cells where something did not happen as it should: {len(broken)}."]
    for cell in broken:
        lines.append(f"- {cell.program} {cell.mode} {cell.fault}: {check(cell)}")
    lines += ["", "## By launch mode and fault", "",
              "Over every entry point: the cells as they should be, the exit statuses seen (as "
              "a shell shows them), and the most seconds from the fault until the last process "
              "was gone.", "",
              SUMMARY_HEADER, "|---|---|---:|---|---:|"]
    groups = {}
    for cell in cells:
        groups.setdefault((cell.mode, cell.fault), []).append(cell)
    for (mode, fault), group in groups.items():
        statuses = sorted({status_shown(status) for cell in group
                           for _, _, status, _ in cell.terminals}, key=str)
        seconds = [cell.seconds for cell in group if cell.seconds is not None]
        good = sum(1 for cell in group if not check(cell))
        lines.append(f"| {mode} | {fault} | {good} of {len(group)} | {'; '.join(statuses)} | "
                     f"{max(seconds) if seconds else ''} |")
    lines.append("")
    if not quick:
        table = lines[lines.index(SUMMARY_HEADER):]
        write_failures_page(table, len(cells), len(broken))
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
    RESULTS.write_text("\n".join(lines))


def write_failures_page(table, cells, broken):
    """docs/failures.md's measured part, between its markers: the table "By launch mode and
    fault" of this run, so that the page's statuses and seconds are the ones measured."""
    page = ROOT / "docs" / "failures.md"
    begin, end = "<!-- make faults: begin -->", "<!-- make faults: end -->"
    text = page.read_text()
    before, _, rest = text.partition(begin)
    _, _, after = rest.partition(end)
    results = f"bench/FAULTS-{CORES}-cores.md"
    measured = [begin,
                f"Measured by `make faults` on {machine()}. Cells: {cells}; as they should be: "
                f"{cells - broken}. Bounds: `--init_timeout {INIT_TIMEOUT}`, `--rpc_timeout "
                f"{RPC_TIMEOUT}` (Monarch: `--call_timeout {RPC_TIMEOUT}`). Each cell is in "
                f"[{results}](../{results}).", "", *table, end]
    page.write_text(before + "\n".join(measured) + after)


def cells_to_run(args):
    programs = [BY_PATH[path] for path in (args.program or (QUICK if args.quick else BY_PATH))]
    for program in programs:
        for mode in program.modes:
            if args.mode and mode not in args.mode:
                continue
            for fault in FAULTS:
                if args.fault and fault not in args.fault:
                    continue
                if fault in PER_RANK_ONLY and mode != "per-rank":
                    continue
                yield program, mode, fault


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
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
    parser.add_argument("--no_write", "--no-write", action="store_true",
                        help=f"print the cells, do not write {RESULTS.name}")
    args = parser.parse_args()
    # Each terminal gets Ctrl-C (SIGINT) as a terminal's command does. Started in the background
    # of a non-interactive shell (`make faults &`, nohup), this process inherits SIGINT ignored,
    # and so would every command it starts: the Monarch programs, which keep Python's handling of
    # SIGINT, then ran on past their Ctrl-C. Python's own handler here: a command started from
    # this process gets SIGINT's default, as exec resets a handled signal.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    started = time.monotonic()
    todo = list(cells_to_run(args))
    printing = threading.Lock()
    cells = [None] * len(todo)

    # Two lanes: the cells that spend most of their time waiting for a bound (--init_timeout,
    # --rpc_timeout) run beside the others, one of each at a time; the waiting lane, its own
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
                cell = run_cell(program, mode, fault, folder)
            except _Ended:  # the main thread ends every terminal, and this program
                return
            cells[number] = cell
            with printing:
                print(f"{program.path} {mode} {fault}: {check(cell) or 'ok'}; gone in "
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
        count = end_every_terminal()
        shutil.rmtree(scratch, ignore_errors=True)
        print(f"interrupted: ended the {count} terminal(s) of the cells under way; "
              f"{RESULTS.name} not written", file=sys.stderr, flush=True)
        os._exit(130 if isinstance(ended, KeyboardInterrupt) else 143)
    shutil.rmtree(scratch, ignore_errors=True)
    seconds = time.monotonic() - started
    if not args.no_write:
        write(cells, seconds, args.quick)
        print(f"wrote {RESULTS.relative_to(ROOT)}: {len(cells)} cells in {seconds / 60:.1f} min")
    return 1 if any(check(cell) for cell in cells) else 0


if __name__ == "__main__":
    sys.exit(main())
