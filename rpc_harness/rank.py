"""A rank's life, from the start of its function to its end (docs/harness.md tells the story).

@watched runs the rank's function: it sets the rank up (Rank.start), runs the function, whose
init_rpc() or init_process_group() joins the ranks (rendezvous.py), and ends the rank, never
returning: finish() once the function returned, fail() if it raised.

The loop is one thread that acts for the rank: a `selectors` loop over the wake pipe (Ctrl-C
and SIGTERM, which Python's C handler writes there even while the main thread waits in torch's
C++ code, and the main thread's requests) and one TCP connection to each peer (rank 0 holds one
to each rank, the others one to rank 0), on which each side says "." every HEARTBEAT_SECONDS.
Only the loop writes to the peers. A peer whose connection closes before it said "bye" (or
before this rank is done), that failed, or that stays silent for --rpc_timeout is lost: rank 0
tells the others, and each rank ends (Rank.end), wherever its main thread waits."""

import argparse
import contextlib
import enum
import functools
import json
import multiprocessing
import os
import queue
import selectors
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from . import ending
from .cli import CORES
from .command import signal_when_the_parent_dies
from .profiling import write_timeline
from .state import state
from .summary import NotWritten, peak_memory_mb, write_summary

HEARTBEAT_SECONDS = 1.0
# How long rank 0 waits, once it is done, for the others to say "bye" with their figures.
BYE_SECONDS = 10.0
# How long a rank whose function failed waits for a lost peer to show itself as the cause.
CAUSE_SECONDS = 2 * HEARTBEAT_SECONDS
# A turn of the loop this much later than its timeout: the process was stopped (SIGSTOP, a
# suspended laptop), and the peers' silence meanwhile is its own.
STOPPED_SECONDS = 2 * HEARTBEAT_SECONDS
# How long an ending rank stays once its connections are closed: its peers read the closed
# connections while RPC's are still up. Under mp.spawn, longer: mp.spawn names the first rank
# that it sees end, which must be a killed peer, not this rank that lost it.
LINGER_SECONDS = 0.25
LINGER_UNDER_MP_SPAWN_SECONDS = 1.0
# Ctrl-C, SIGTERM, and the signal that says that the command has died.
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)



class Phase(enum.Enum):
    STARTING = "starting"  # before the join: no peers yet
    WATCHING = "watching"  # joined: a peer that closes or goes silent is lost
    DONE = "done"  # this rank's function is done: connections that close now are expected


@dataclass(eq=False)
class Rank:
    """What the harness holds for one rank. The main thread runs the rank's function and writes
    the fields marked "main"; the loop owns the others. They talk through `requests` (the main
    thread's, each with a byte on the wake pipe) and `byes_done` (the loop's answer)."""

    args: argparse.Namespace
    rank: int
    phase: Phase = Phase.STARTING
    peers: dict = field(default_factory=dict)  # rank -> its connection
    heard: dict = field(default_factory=dict)  # rank -> when it last spoke (time.monotonic())
    unread: dict = field(default_factory=dict)  # rank -> the start of a line not yet whole
    byes: dict = field(default_factory=dict)  # rank -> the figures of its "bye" (rank 0's)
    claims: dict = field(default_factory=dict)  # main: rank -> its claim at the join
    store: object = None  # main: the store where the ranks met, from the join
    recorder: object = None  # main: --profile's profiling.Recorder, from the join
    figures: dict = field(default_factory=dict)  # main: report()'s, for the summary
    finishing: bool = False  # main: the function returned, and finish() ends the rank
    requests: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    byes_done: threading.Event = field(default_factory=threading.Event)
    selector: selectors.BaseSelector = field(default_factory=selectors.DefaultSelector)
    wake_read: int = None  # the wake pipe, from start()
    wake_write: int = None

    @property
    def names(self):
        return self.args.harness.names

    @property
    def name(self):
        return self.names[self.rank]

    # --------- The main thread's side --------------------

    def start(self):
        """Set the rank up, on its main thread (docs/harness.md lists what it changes): the loop,
        with signals down the wake pipe; SIGHUP when the command that started it dies (in place
        of mp.spawn's SIGINT); torch's seed, --seed; its share of the cores; whole lines, and
        a pipe closed under its output ends it quietly; two warnings left out."""
        self.wake_read, self.wake_write = os.pipe()
        os.set_blocking(self.wake_write, False)
        self.selector.register(self.wake_read, selectors.EVENT_READ, self._on_wake)
        signal.set_wakeup_fd(self.wake_write)
        for number in SIGNALS:  # the C handler writes their numbers to the pipe
            signal.signal(number, lambda number, frame: None)
        threading.Thread(target=self._loop, daemon=True, name="rpc_harness loop").start()
        parent = multiprocessing.parent_process()
        if parent is not None:
            # A signal of its own, not the SIGINT or SIGTERM that the command passes on: Linux
            # sends it as the command's main thread ends, before the command's other threads
            # are gone, so that nothing else can tell the rank yet that its command has died.
            signal_when_the_parent_dies(signal.SIGHUP, parent.pid)
        torch.manual_seed(self.args.seed)
        if not os.environ.get("OMP_NUM_THREADS"):
            torch.set_num_threads(self.args.harness.threads[self.rank])
        ending.whole_lines()
        ending.quiet_when_closed(lambda: self._ask("output_closed", None))
        leave_out_known_warnings()

    def watch(self, peers):
        """Hand the loop the connections to the peers (rank -> socket), once the rank joined."""
        self._ask("peers", peers)

    def _ask(self, *request):
        self.requests.put(request)
        with contextlib.suppress(BlockingIOError):  # the pipe is full: the loop is waking
            os.write(self.wake_write, b"\0")

    def finish(self) -> NoReturn:
        """The rank's function returned: write its trace, say "bye" with its figures; rank 0
        waits for every other rank's (BYE_SECONDS at most), merges the traces and writes the
        summary. Then the process ends, status 0, without Python's and torch's teardown (1.3 s
        of a 2-rank run on 2 cores)."""
        if _rpc_running() or dist.is_initialized():
            self.fail(None)
        self.finishing = True
        if self.recorder:
            self.recorder.stop()
        self.figures["peak_memory_mb"] = peak_memory_mb()
        self._ask("bye", json.dumps(self.figures))
        self.byes_done.wait(BYE_SECONDS)
        if self.rank == 0:
            try:
                self._write_summary()
            except NotWritten as error:
                self.end(f"{self.name}: {error}", 1)
            if ending.output_closed():  # its last lines had nobody to read them: quietly
                self.end("", ending.PIPE_CLOSED)
        ending.end(None, 0)

    def _write_summary(self):
        figures_by_rank = {0: dict(self.figures), **self.byes}
        missing = [f"{self.names[rank]} (rank {rank})" for rank in range(len(self.names))
                   if rank not in figures_by_rank]
        if missing:
            print(f"Summary: not written: no figures from {', '.join(missing)}, which did not "
                  f"say it was done within {BYE_SECONDS:g} s", file=sys.stderr)
            return
        if self.recorder:
            timeline = write_timeline(self.recorder.folder, self.names, self.recorder.run)
            print(f"{self.name}: {timeline}")
        memory = {}
        reports = {}
        for rank, figures in sorted(figures_by_rank.items()):
            memory[self.names[rank]] = figures.pop("peak_memory_mb", None)
            if figures:
                reports[self.names[rank]] = figures
        if self.args.harness.summary is not None:
            summary, line = self.args.harness.summary(self.args, reports)
            write_summary(self.args, summary, line, memory)

    def fail(self, error) -> NoReturn:
        """The rank's function raised `error` (None: it returned with RPC or its process group
        still up). Unless a lost peer shows itself as the cause within CAUSE_SECONDS: print
        the traceback, and ask the loop to tell the peers and end the rank, status 1. Where
        the rank's output is a pipe that nobody reads any more (`| head` has its lines), what
        it raised is only that: the rank ends quietly, PIPE_CLOSED, and so does the run."""
        if ending.output_closed():
            self._ask("output_closed", None)
            ending.wait_forever()
        ending.wait_for_a_cause(CAUSE_SECONDS)
        if error is not None:
            traceback.print_exception(type(error), error, error.__traceback__)
        self._ask("fail", one_line(error))
        ending.wait_forever()

    # --------- The loop --------------------

    def _loop(self):
        try:
            next_beat = 0.0
            while True:
                next_beat = self._turn(next_beat)
        except Exception:  # noqa: BLE001 - a defect of the harness: said, never hidden
            self.end(f"{self.name}: rpc_harness's loop failed, so this rank cannot watch its "
                     f"peers\n{traceback.format_exc().rstrip()}", 1)

    def _turn(self, next_beat):
        """Beat if it is time (and end the rank if its output is a pipe that nobody reads any
        more), wait for what comes (HEARTBEAT_SECONDS at most), act on it. Returns when to beat
        next."""
        if time.monotonic() >= next_beat:
            self._send_to_all(b".\n")
            next_beat = time.monotonic() + HEARTBEAT_SECONDS
            # A print that meets the closed pipe may run in a call another rank made by RPC,
            # which carries the error back there, or this rank may print nothing more: either
            # way, this rank's own output tells it, and it ends as its reader asked.
            if ending.output_closed():
                self._on_output_closed(None)
        timeout = max(0.0, next_beat - time.monotonic())
        before = time.monotonic()
        events = self.selector.select(timeout)
        if time.monotonic() - before > timeout + STOPPED_SECONDS:
            self.heard = dict.fromkeys(self.heard, time.monotonic())
        for key, _ in events:
            key.data(key.fileobj)
        for peer, when in list(self.heard.items()):
            if peer not in self.byes and time.monotonic() - when > self.args.rpc_timeout:
                self._peer_lost(peer, f"silent for {self.args.rpc_timeout:g} s (--rpc_timeout)")
        return next_beat

    def _on_wake(self, pipe):
        for byte in os.read(pipe, 512):
            if byte in SIGNALS:
                self._on_signal(byte)
        handlers = {"peers": self._on_peers, "bye": self._on_bye, "fail": self._on_fail,
                    "output_closed": self._on_output_closed}
        while not self.requests.empty():
            kind, payload = self.requests.get()
            handlers[kind](payload)

    def _on_signal(self, number):
        """Ctrl-C or SIGTERM: the rank ends at once, with 128 + the signal's number. SIGHUP: the
        command that started the rank has died (or its terminal has closed), so nobody reads
        the rank's record: the rank removes the command's folder instead, and ends silently."""
        if number == signal.SIGHUP:
            ending.claim()
            shutil.rmtree(self.args.harness.records, ignore_errors=True)
            self.end(None, 128 + number)
        suffix = "" if number == signal.SIGINT else " (SIGTERM)"
        self.end(f"{self.name}: interrupted{suffix}", 128 + number)

    def _on_peers(self, peers):
        self.phase = Phase.WATCHING
        for peer, sock in peers.items():
            sock.settimeout(5.0)  # a send to a peer that reads nothing fails, not hangs
            self.peers[peer] = sock
            self.heard[peer] = time.monotonic()
            self.unread[peer] = b""
            self.selector.register(sock, selectors.EVENT_READ,
                                   functools.partial(self._on_data, peer))

    def _on_bye(self, figures):
        self.phase = Phase.DONE
        if self.rank != 0:
            self._send_to_all(f"bye {figures}\n".encode())
            self.byes_done.set()
        elif len(self.byes) == len(self.peers):
            self.byes_done.set()

    def _on_fail(self, what):
        self.end(f"{self.name}: failed ({what})", 1, tell=f"failed {self.rank} {what}")

    def _on_output_closed(self, _):
        """The rank's output is a pipe that nobody reads: a record with nothing to say, which
        the command follows quietly; the peers learn why this rank stopped. Once the rank's
        function is done, finish() ends it instead, with the run's summary written first."""
        if self.finishing:
            return
        self.end("", ending.PIPE_CLOSED,
                 tell=f"failed {self.rank} its output was closed, a pipe that nobody reads")

    def _on_data(self, peer, sock):
        try:
            data = sock.recv(65536)
        except OSError:  # reset: counts as closed
            data = b""
        if not data:
            self.selector.unregister(sock)
            del self.heard[peer]
            if peer not in self.byes and self.phase is Phase.WATCHING:
                self._peer_lost(peer, "its connection closed")
            return
        self.heard[peer] = time.monotonic()
        lines = (self.unread[peer] + data).split(b"\n")
        self.unread[peer] = lines.pop()
        for line in lines:
            self._read(peer, line.decode(errors="replace"))

    def _read(self, peer, line):
        """One line from a peer: ".", "bye <figures>", and from rank 0 "gone <rank> <how>" or
        "failed <rank> <what>" (a rank's own failure, which rank 0 passes on). A line that is
        none of these is left alone."""
        kind, _, rest = line.partition(" ")
        if kind == "bye":
            with contextlib.suppress(ValueError):
                self.byes[peer] = json.loads(rest)
            self.byes.setdefault(peer, {})
            if self.phase is Phase.DONE and len(self.byes) == len(self.peers):
                self.byes_done.set()
            return
        number, _, how = rest.partition(" ")
        if kind not in ("gone", "failed") or not number.isdigit():
            return
        other = int(number)
        if other >= len(self.names):
            return
        if kind == "failed":
            self._peer_failed(other, how)
        elif other == self.rank:  # this rank was stopped for longer than rank 0 waits
            self.end(f"{self.name}: {self.names[0]} (rank 0) gave up on this rank, which it had "
                     f"not heard from for {self.args.rpc_timeout:g} s (--rpc_timeout)", 1)
        else:
            self._peer_lost(other, f"{how}, as {self.names[0]} (rank 0) saw")

    def _send_to_all(self, message):
        for sock in list(self.peers.values()):
            with contextlib.suppress(OSError):  # a peer that is gone, which the loop finds
                sock.sendall(message)

    def _peer_lost(self, peer, how):
        """A peer is gone: this rank ends, and rank 0 tells the others. Under mp.spawn, whose
        SIGTERM a stopped (SIGSTOP) rank would act on only once resumed (mp.spawn waits 30 s),
        a silent peer is resumed: every rank of mp.spawn is on this machine."""
        silent = peer in self.heard and self.args.harness.spawn_all
        self.end(f"{self.name}: lost contact with {self.names[peer]} (rank {peer}, {how})", 1,
                 tell=f"gone {peer} {how}" if self.rank == 0 else None,
                 resume=self.claims.get(peer, {}).get("pid") if silent else None)

    def _peer_failed(self, peer, what):
        """A peer's own code failed: this rank ends, and rank 0 tells the others."""
        self.end(f"{self.name}: {self.names[peer]} (rank {peer}) failed ({what})", 1,
                 tell=f"failed {peer} {what}" if self.rank == 0 else None)

    # --------- The end --------------------

    def end(self, line, status, tell=None, resume=None) -> NoReturn:
        """End this rank now, with `line` as its record (None: no record; "": a record with
        nothing to say) and `status`. The rank goes quiet: what its threads print from now on
        (RPC's errors of the calls that meet a lost peer, a line of the program's loop) goes
        nowhere. The record comes next, so that the records of the peers that end because of
        this rank come later; then `tell` goes to the peers, and SIGCONT to the process
        `resume`. The connections to the peers close, so that they learn from them, not from a
        failed RPC, that this rank has gone; then its --profile trace is written (3 s at
        most)."""
        ending.claim()
        ending.quiet()
        if line is not None:
            ending.write_record(self.args.harness.records, self.rank, self.name, line, status)
        if tell:
            self._send_to_all(f"{tell}\n".encode())
        if resume:
            with contextlib.suppress(OSError):
                os.kill(resume, signal.SIGCONT)
        for sock in self.peers.values():
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        if self.recorder:
            self.recorder.stop(seconds=3.0)
        if self.peers and self.args.harness.spawn_all:
            time.sleep(LINGER_UNDER_MP_SPAWN_SECONDS)
        elif self.peers:
            time.sleep(LINGER_SECONDS)
        ending.end(None, status)


def watched(function):
    """Not in the tutorials: the rank's function, run under the harness (the module's docstring
    says what it does). Its arguments: the rank first, as mp.spawn and mp.Process pass it, and
    the command line (args, with args.harness) among the others."""

    @functools.wraps(function)
    def rank_process(rank, *arguments):
        if state.rank is not None:  # a function of the rank, called by another that is watched
            return function(rank, *arguments)
        args = next(value for value in arguments if hasattr(value, "harness"))
        state.rank = Rank(args, rank)
        state.rank.start()
        try:
            function(rank, *arguments)
        except BaseException as error:  # noqa: BLE001 - SystemExit and KeyboardInterrupt too
            state.rank.fail(error)
        state.rank.finish()

    return rank_process


def current():
    """This process's Rank, or None outside a rank."""
    return state.rank


def one_line(error):
    """An exception in one line, for the peers and the rank's last line: its type and the first
    line of its message; for an error that RPC carried from another worker ("On WorkerInfo(id=0,
    name=trainer0):", then the error there), that line and the next. None: no exception."""
    if error is None:
        return "it returned with RPC or its process group still up"
    kind = type(error).__name__
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    message = " ".join(lines[:2] if lines and lines[0].endswith(":") else lines[:1])
    if not message:
        return kind
    return message if message.startswith(f"{kind}: ") else f"{kind}: {message}"


def _rpc_running():
    try:
        rpc.get_worker_info()
    except RuntimeError:  # "RPC has not been initialized", or it has been shut down
        return False
    return True


def threads_line():
    """How many threads this rank computes with, and why."""
    threads = torch.get_num_threads()
    if os.environ.get("OMP_NUM_THREADS"):
        return f"{threads} thread(s), as OMP_NUM_THREADS says"
    if state.rank.rank in state.rank.args.harness.computes:
        return f"{threads} thread(s), its share of {CORES} core(s) (OMP_NUM_THREADS to change)"
    return f"{threads} thread, as it computes little (OMP_NUM_THREADS to change)"


def leave_out_known_warnings():
    """Two deprecation warnings from inside torch's RPC stack, not from the program's code: its
    agent's process group used as a ProcessGroup, and DistributedOptimizer's TorchScript
    optimizers. torch shows the second under simplefilter("always"), which no filter can stop,
    so warnings.showwarning (Python's documented hook) leaves that one message out."""
    warnings.filterwarnings("ignore", message=r".*as a ProcessGroup\. This usage is deprecated")
    show = warnings.showwarning

    def show_unless_torchscript_optimizer(message, *args, **kwargs):
        if not str(message).startswith("`TorchScript` support for functional optimizers"):
            show(message, *args, **kwargs)

    warnings.showwarning = show_unless_torchscript_optimizer


# --------- What the programs call --------------------

def profile_step():
    """Not in the tutorials: one step of a looping rank, for --profile's window."""
    if state.rank is not None and state.rank.recorder:
        state.rank.recorder.step()


def report(**figures):
    """Not in the tutorials: figures for the run's summary, which rank 0 writes at the end."""
    if state.rank is not None:
        state.rank.figures.update(figures)
