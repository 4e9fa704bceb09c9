"""A rank's life from the join on: its state, the one thread that acts for it, and how it ends.

Everything the harness holds for a rank is one object, a Rank, made at the join
(rendezvous.py calls install()). Two threads use it: the rank's main thread, which runs the
example's code, and the rank's loop, a thread of the harness that runs one `selectors` loop over

- the signal pipe: Ctrl-C (SIGINT) and SIGTERM end the rank at once, in one line, even while
  the main thread waits in torch's C++ code (a Python handler would run only once it is back);
- the main thread's requests: "bye" when the rank's function is done, "fail" when it raised;
- one TCP connection to each peer (rank 0 holds one to each rank, the others one to rank 0),
  on which each side says "." every HEARTBEAT_SECONDS (the loop's timeout), and which a
  process closes however it ends.

Only the loop writes to the peers, and once the rank has joined, only the loop ends it. A peer
whose connection closes without "bye", that says it failed, or that stays silent for
--rpc_timeout, is lost: rank 0 tells the others which rank went, and each ends in one line
wherever its main thread waits (rpc.shutdown() would wait for ever). Under mp.spawn the command
says that line for every rank (launch.py), so a rank ends silently.

The rank's line is always its terminal's last: the rank goes quiet first (its standard output
and error lead nowhere), and the line is written on a copy of its error stream."""

import contextlib
import json
import multiprocessing
import multiprocessing.util
import os
import queue
import resource
import selectors
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from .cli import CORES, signal_when_the_parent_dies

HEARTBEAT_SECONDS = 1.0
# How long rank 0 waits, once it is done, for the others to say "bye" with their figures.
BYE_SECONDS = 10.0
# How long a rank whose function failed waits for a lost peer to show itself as the cause.
CAUSE_SECONDS = 2 * HEARTBEAT_SECONDS
# How long a rank that gets SIGTERM waits to see whether its command is ending too.
PARENT_SECONDS = 0.3
# A turn of the loop this much later than its timeout: the process was stopped (SIGSTOP, a
# suspended laptop), and the peers' silence meanwhile is its own.
STOPPED_SECONDS = 2 * HEARTBEAT_SECONDS

_this = None  # this process's Rank, from the join on


class Rank:
    """What the harness holds for one rank (the module's docstring says who uses what)."""

    def __init__(self, args, rank):
        self.args = args
        self.rank = rank
        self.names = args.harness.names
        self.name = self.names[rank]
        self.spawn_all = args.harness.spawn_all
        self.store = None  # the rendezvous's store, once this rank has joined
        self.claims = {}  # rank -> its claim at the join: its host and process, among others
        self.profile = None  # --profile's profiling.Profile, once this rank has joined
        self.figures = {}  # report()'s, for the summary (the main thread's)
        # The rank's terminal: its error stream, which stays open once the rank is quiet.
        self.terminal = os.dup(sys.stderr.fileno())
        self.ending = threading.Lock()  # held by the one thread that ends this rank
        # The main thread and the loop: requests one way, events the other.
        self.requests = queue.SimpleQueue()
        self.lost = threading.Event()  # a peer is lost: the cause of a failure meanwhile
        self.byes_in = threading.Event()  # rank 0: every peer's "bye"; the others: theirs sent
        self.finished = threading.Event()  # done: connections that close now are expected
        # The loop's own: the peers, what they said, and when.
        self.peers = {}  # rank -> its connection
        self.heard = {}  # rank -> when it last spoke (time.monotonic())
        self.unread = {}  # rank -> the start of a line not yet whole
        self.byes = {}  # rank -> the figures of its "bye" (rank 0's)
        self.selector = selectors.DefaultSelector()
        self.wake_read, self.wake_write = os.pipe()
        os.set_blocking(self.wake_write, False)
        self.selector.register(self.wake_read, selectors.EVENT_READ, self._on_wake)
        self.next_beat = 0.0

    # --------- The main thread's side --------------------

    def start(self):
        """Start the loop. Signals go down the wake pipe from now on (signal.set_wakeup_fd: the
        C handler writes the signal's number there, whatever the main thread is doing)."""
        signal.set_wakeup_fd(self.wake_write)
        for number in (signal.SIGINT, signal.SIGTERM):
            signal.signal(number, _do_nothing)
        threading.Thread(target=self._loop, daemon=True, name="rpc_harness loop").start()

    def watch(self, peers):
        """Hand the loop the connections to the peers (rank -> socket), once the rank joined."""
        self._ask("peers", peers)

    def _ask(self, *request):
        self.requests.put(request)
        with contextlib.suppress(BlockingIOError):  # the pipe is full: the loop is waking
            os.write(self.wake_write, b"\0")

    def finish(self):
        """The rank's function is done: write its trace, say "bye" with its figures; rank 0
        waits for every other rank's (BYE_SECONDS at most), then merges the traces and writes
        the summary."""
        if self.profile:
            self._print(self.profile.end())
        self.figures["peak_memory_mb"] = _peak_memory_mb()
        if self.rank != 0:
            self._ask("bye", json.dumps(self.figures))
            self.byes_in.wait(BYE_SECONDS)
            return
        self.byes_in.wait(BYE_SECONDS)
        self.finished.set()
        figures_by_rank = {0: dict(self.figures), **self.byes}
        if self.profile:
            from .profiling import write_timeline_of_every_rank
            write_timeline_of_every_rank(self.profile, self.names)
        write_summary(self.args, figures_by_rank)

    def fail(self, error):
        """The rank's function raised `error` (None: it returned with RPC still up): unless a
        lost peer is the cause, print the traceback (mp.spawn's command prints it for its ranks),
        tell the peers, and end, status 1. Never returns."""
        if self.lost.wait(CAUSE_SECONDS):
            threading.Event().wait()  # the loop ends the rank, naming the peer
        what = _one_line(error)
        if not self.spawn_all and error is not None:
            traceback.print_exception(type(error), error, error.__traceback__)
        self._ask("fail", what)
        threading.Event().wait()

    def _print(self, line):
        if line:
            print(line, flush=True)

    # --------- The loop --------------------

    def _loop(self):
        try:
            while True:
                self._turn()
        except Exception:  # noqa: BLE001 - a defect of the harness: said, never hidden
            self.end(f"{self.name}: rpc_harness's loop failed, so this rank cannot watch its "
                     f"peers; stopping\n{traceback.format_exc().rstrip()}", 1)

    def _turn(self):
        """Beat if it is time, wait for what comes (HEARTBEAT_SECONDS at most), act on it."""
        if time.monotonic() >= self.next_beat:
            self._send_to_all(b".\n")
            if self.profile:
                self.profile.beat()
            self.next_beat = time.monotonic() + HEARTBEAT_SECONDS
        timeout = max(0.0, self.next_beat - time.monotonic())
        before = time.monotonic()
        events = self.selector.select(timeout)
        if time.monotonic() - before > timeout + STOPPED_SECONDS:
            self.heard = dict.fromkeys(self.heard, time.monotonic())
        for key, _ in events:
            key.data(key.fileobj)
        for peer, when in list(self.heard.items()):
            silent = time.monotonic() - when
            if peer not in self.byes and silent > self.args.rpc_timeout:
                self._peer_lost(peer, f"silent for {self.args.rpc_timeout:g} s (--rpc_timeout)",
                                seen_by_mp_spawn=False)

    def _on_wake(self, pipe):
        for byte in os.read(pipe, 512):
            if byte in (signal.SIGINT, signal.SIGTERM):
                self._on_signal(byte)
        while not self.requests.empty():
            kind, payload = self.requests.get()
            getattr(self, f"_on_{kind}")(payload)

    def _on_signal(self, number):
        """Ctrl-C or SIGTERM: the rank ends at once, with 128 + the signal's number."""
        line = f"{self.name}: interrupted"
        if number == signal.SIGTERM:
            line += " (SIGTERM)"
        if number == signal.SIGTERM and self._the_command_has_ended():  # the death signal
            line = f"{self.name}: the command that started this rank has ended; stopping"
        self.stop(line, 128 + number)

    def _the_command_has_ended(self):
        """Whether the process that started this rank (mp.Process's command) has ended. Linux
        sends the death signal as the command's thread that started the rank ends, a moment
        before the process is gone (its other threads, its files): PARENT_SECONDS to see it."""
        parent = multiprocessing.parent_process()
        if parent is None or self.spawn_all:
            return False
        if os.getppid() != parent.pid:
            return True
        parent.join(PARENT_SECONDS)  # its end of multiprocessing's pipe closes as it ends
        return not parent.is_alive()

    def _on_peers(self, peers):
        now = time.monotonic()
        for peer, sock in peers.items():
            sock.settimeout(5.0)  # a send to a peer that reads nothing fails, not hangs
            self.peers[peer] = sock
            self.heard[peer] = now
            self.unread[peer] = b""
            self.selector.register(sock, selectors.EVENT_READ,
                                   lambda sock, peer=peer: self._on_data(peer, sock))

    def _on_bye(self, figures):
        self.finished.set()
        self._send_to_all(f"bye {figures}\n".encode())
        self.byes_in.set()

    def _on_fail(self, what):
        self._send_to_all(f"failed {self.rank} {what}\n".encode())
        if self.spawn_all:
            self._leave_reason(f"failed ({what})")
        self.stop(f"{self.name}: failed ({what}); the other ranks stop too", 1)

    def _on_data(self, peer, sock):
        try:
            data = sock.recv(65536)
        except OSError:  # reset: counts as closed
            data = b""
        if not data:
            self.selector.unregister(sock)
            del self.heard[peer]
            if peer not in self.byes and not self.finished.is_set():
                self._peer_lost(peer, "its connection closed", seen_by_mp_spawn=True)
            return
        self.heard[peer] = time.monotonic()
        lines = (self.unread[peer] + data).split(b"\n")
        self.unread[peer] = lines.pop()
        for line in lines:
            self._read(peer, line.decode(errors="replace"))

    def _read(self, peer, line):
        """One line from a peer: ".", "bye <figures>", and from rank 0 "gone <rank> <how>" or
        "failed <rank> <what>" (a rank's own failure, which rank 0 passes on)."""
        kind, _, rest = line.partition(" ")
        if kind == "bye":
            try:
                figures = json.loads(rest or "{}")
            except ValueError:
                figures = {}
            self.byes[peer] = figures
            if len(self.byes) == len(self.peers):
                self.byes_in.set()
        elif kind in ("gone", "failed"):
            number, _, how = rest.partition(" ")
            if not number.isdigit() or int(number) >= len(self.names):
                return  # not a line of this harness
            other = int(number)
            if kind == "failed":
                self._peer_failed(other, how)
            elif other == self.rank:  # this rank was stopped for longer than rank 0 waits
                self._gave_up_on_this_rank()
            else:
                self._peer_lost(other, f"{how}, as {self.names[0]} (rank 0) saw",
                                seen_by_mp_spawn=True)

    def _send_to_all(self, message):
        for sock in list(self.peers.values()):
            with contextlib.suppress(OSError):  # a peer that is gone, which the loop finds
                sock.sendall(message)

    def _peer_lost(self, peer, how, seen_by_mp_spawn):
        """A peer is gone: rank 0 tells the others, then this rank ends in one line. Under
        mp.spawn, where the command says the line, a rank ends silently with status 0 when the
        command sees the cause itself (a rank that ended: mp.spawn names it), and otherwise
        leaves the line for the command (launch.leave_reason) and ends with 1."""
        self.lost.set()
        if self.rank == 0:
            self._send_to_all(f"gone {peer} {how}\n".encode())
        reason = f"lost contact with {self.names[peer]} (rank {peer}, {how})"
        self._end_for_a_peer(reason, seen_by_mp_spawn,
                             silent_peer=None if seen_by_mp_spawn else peer)

    def _peer_failed(self, peer, what):
        """A peer's own code failed: rank 0 tells the others; this rank ends in one line."""
        self.lost.set()
        if self.rank == 0:
            self._send_to_all(f"failed {peer} {what}\n".encode())
        self._end_for_a_peer(f"{self.names[peer]} (rank {peer}) failed ({what})", True)

    def _gave_up_on_this_rank(self):
        """Rank 0 gave up on this rank, which was stopped (SIGSTOP) for longer than it waits."""
        reason = (f"was not heard from for {self.args.rpc_timeout:g} s (--rpc_timeout): "
                  f"{self.names[0]} (rank 0) gave up on it")
        if self.spawn_all:
            self._leave_reason(reason)
        self.stop(f"{self.name}: {self.names[0]} (rank 0) gave up on this rank, which it had not "
                  f"heard from for {self.args.rpc_timeout:g} s (--rpc_timeout); stopping", 1)

    def _end_for_a_peer(self, reason, seen_by_mp_spawn, silent_peer=None):
        if not self.spawn_all:
            self.end(f"{self.name}: {reason}; stopping", 1)
        if seen_by_mp_spawn:
            self.end(None, 0)
        self._leave_reason(reason)
        if silent_peer is not None:
            # mp.spawn ends the others with SIGTERM, and waits 30 s for them before SIGKILL: a
            # stopped process (SIGSTOP) acts on SIGTERM once it runs again. Every rank of
            # mp.spawn is on this machine.
            with contextlib.suppress(OSError, KeyError):
                os.kill(self.claims[silent_peer]["pid"], signal.SIGCONT)
        self.end(None, 1)

    def _leave_reason(self, reason):
        from .launch import leave_reason
        leave_reason(self.args, self.rank, reason)

    # --------- The end --------------------

    def stop(self, line, status):
        """End this rank with `line`, but silently where mp.spawn started every rank: there the
        command says the run's last line (launch.py)."""
        self.end(None if self.spawn_all else line, status)

    def end(self, line, status):
        """End this rank now, `line` its terminal's last (None: nothing to say). The rank goes
        quiet first: what its threads print from now on (RPC's errors of the calls that meet a
        lost peer, a line of the example's loop) goes nowhere. The connections to the peers
        close next, so that they learn from them, not from a failed RPC, that this rank has
        gone; then its --profile trace is written (3 s at most). os._exit: a normal exit would
        wait for torch's RPC threads, which wait for peers that are gone. A second caller
        (another thread ending it for another reason meanwhile) waits for the first to end
        the process."""
        if not self.ending.acquire(blocking=False):
            threading.Event().wait()
        _quiet()
        for sock in self.peers.values():
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        if self.profile:
            self._say(self.profile.end(seconds=3.0))
        self._say(line)
        if self.peers:
            time.sleep(0.25)  # the peers read the closed connections while RPC's are still up
        os._exit(status)

    def _say(self, line):
        if line:
            os.write(self.terminal, (line + "\n").encode())


def _do_nothing(number, frame):
    pass


def _one_line(error):
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


def _quiet():
    """What this process has printed reaches its terminal; from now on, what it prints goes
    nowhere."""
    with contextlib.suppress(ValueError, OSError):  # a stream closed or broken meanwhile
        sys.stdout.flush()
        sys.stderr.flush()
    nowhere = os.open(os.devnull, os.O_WRONLY)
    os.dup2(nowhere, 1)
    os.dup2(nowhere, 2)
    os.close(nowhere)


def current():
    """This process's Rank, or None before the join."""
    return _this


def end(line, status):
    """End this rank now (Rank.end), `line` its last."""
    _this.end(line, status)


def say(line):
    """A line on this rank's terminal now, ahead of its end."""
    sys.stdout.flush()
    _this._say(line)


# --------- At the join --------------------

def install(args, rank):
    """What this rank sets up at the join, on its main thread (README: "What the harness
    changes"): its state and its loop; the end of the rank with the command that started it;
    its share of the cores; whole lines; two warnings of torch's left out; and at_the_end()."""
    global _this
    _this = Rank(args, rank)
    _this.start()
    if not args.harness.spawn_all:
        _end_with_the_command()
    if not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(args.harness.threads[rank])
    whole_lines()
    _leave_out_known_warnings()
    # Called by multiprocessing in the rank's process as soon as the rank's function returns or
    # raises (and before the traceback of an exception is printed); at exit otherwise.
    multiprocessing.util.Finalize(None, at_the_end, exitpriority=10)
    return _this


def joined(store, claims, profile, peers):
    """The join is done: the store, every rank's claim, --profile's recorder (or None), and the
    peers' connections."""
    _this.store = store
    _this.claims = claims
    _this.profile = profile
    _this.watch(peers)


def threads_line():
    """How many threads this rank computes with, and why."""
    threads = torch.get_num_threads()
    if os.environ.get("OMP_NUM_THREADS"):
        return f"{threads} thread(s), as OMP_NUM_THREADS says"
    if _this.rank in _this.args.harness.computes:
        return f"{threads} thread(s), its share of {CORES} core(s) (OMP_NUM_THREADS to change)"
    return f"{threads} thread, as it computes little (OMP_NUM_THREADS to change)"


def whole_lines():
    """Each line written whole, in one write: under python -u (PYTHONUNBUFFERED), print("a", 1)
    writes "a", " ", "1" and the newline separately, and two processes' lines run into each
    other."""
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=False)


def _end_with_the_command():
    """A rank that mp.Process started gets SIGTERM when the command that started it dies, as
    mp.spawn's ranks get SIGINT (Linux's PR_SET_PDEATHSIG): no rank runs on, unseen."""
    if multiprocessing.parent_process() is not None:
        signal_when_the_parent_dies(signal.SIGTERM)


def _leave_out_known_warnings():
    """Two deprecation warnings from inside torch's RPC stack, not from the example's code: its
    agent's process group used as a ProcessGroup, and DistributedOptimizer's TorchScript
    optimizers. torch shows the second under simplefilter("always"), which no filter can stop,
    so warnings.showwarning (Python's documented hook) leaves that one message out."""
    warnings.filterwarnings("ignore", message=r".*as a ProcessGroup\. This usage is deprecated")
    show = warnings.showwarning

    def show_unless_torchscript_optimizer(message, *args, **kwargs):
        if not str(message).startswith("`TorchScript` support for functional optimizers"):
            show(message, *args, **kwargs)

    warnings.showwarning = show_unless_torchscript_optimizer


# --------- What the example calls --------------------

def profile_step():
    """Not in the tutorials: one step of a looping rank, for --profile's window."""
    if _this is not None and _this.profile:
        _this.profile.step()


def report(**figures):
    """Not in the tutorials: figures for the run's summary, which rank 0 writes at the end."""
    if _this is not None:
        _this.figures.update(figures)


def at_the_end():
    """Run when the rank's function has returned or raised. Done (it returned, RPC shut down,
    no process group left): finish, and end the process at once (os._exit(0)): Python's and
    torch's teardown of a rank took 1.3 s of a 2-rank run on 2 cores. Failed: Rank.fail."""
    if _this is None:
        return
    error = sys.exc_info()[1]  # the exception on its way out of the rank's function, if any
    if isinstance(error, SystemExit):
        # mp.spawn's ranks: it catches the function's exception, sends its traceback to the
        # command, and exits with 1 in its place (the exception is the exit's context).
        error = error.__context__ if error.code not in (None, 0) else None
    if error is None and not _rpc_running() and not dist.is_initialized():
        _this.finish()
        with contextlib.suppress(ValueError, OSError):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(0)
    _this.fail(error)


def _rpc_running():
    try:
        rpc.get_worker_info()
    except RuntimeError:  # "RPC has not been initialized", or it has been shut down
        return False
    return True


def write_summary(args, figures_by_rank):
    """Print the summary line and write --summary_json; if a rank's figures never came, say
    whose, instead."""
    names = args.harness.names
    missing = [f"{names[rank]} (rank {rank})" for rank in range(len(names))
               if rank not in figures_by_rank]
    if missing:
        print(f"Summary: not written: no figures from {', '.join(missing)}, which did not say "
              f"it was done within {BYE_SECONDS:g} s", file=sys.stderr)
        return
    memory = {}
    reports = {}
    for rank, figures in sorted(figures_by_rank.items()):
        figures = dict(figures)
        memory[names[rank]] = figures.pop("peak_memory_mb", None)
        if figures:
            reports[names[rank]] = figures
    if args.harness.summary is None:
        return
    summary, line = args.harness.summary(args, reports)
    summary["peak_memory_mb"] = memory
    summary["wall_seconds"] = round(time.time() - args.harness.started, 3)
    print(f"Summary: {line}; {summary['wall_seconds']:.1f} s in all")
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps(summary, indent=2) + "\n")


def _peak_memory_mb():
    """This rank's most resident memory (ru_maxrss: kB on Linux, bytes on macOS), and its
    GPU's, where it used one."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = {"rss": rss // (2**20 if sys.platform == "darwin" else 2**10)}
    if torch.cuda.is_initialized():
        peak["cuda"] = torch.cuda.max_memory_allocated() // 2**20
    return peak

