"""A rank's life after it joins: the handlers it installs at the join, the watch over its
peers, and how it ends.

At the join (rendezvous.py calls install()), on the rank's main thread, the rank:
- ends on Ctrl-C and SIGTERM within a moment, in one line, even while torch's C++ code waits;
- ends when the command that started it ends (a rank started by mp.Process; mp.spawn already
  gives its ranks a death signal);
- sizes its intra-op thread pool to its share of the cores (torch.set_num_threads);
- writes each line of its output whole, in one write (ranks share a terminal or a log);
- leaves out two deprecation warnings that torch prints from inside its own RPC stack;
- runs at_the_end() when its function returns or raises (before a traceback is printed).

Then each rank holds a TCP connection to rank 0 (rank 0, one to each), which a process closes
however it ends. Every second each side says "." on it; a rank that finishes says "bye" with
its figures for the summary. A connection that closes without "bye", or stays silent for
--rpc_timeout, is a lost peer: rank 0 tells the others which rank went, and each ends in one
line wherever it waits (rpc.shutdown() would wait for ever)."""

import contextlib
import json
import multiprocessing
import multiprocessing.util
import os
import resource
import select
import signal
import socket
import sys
import threading
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from . import profiling
from .cli import CORES

HEARTBEAT_SECONDS = 1.0
# How long rank 0 waits, once it is done, for the others to say "bye" with their figures.
BYE_SECONDS = 10.0

_args = _rank = _name = None  # this rank's command line, rank and name
_peers = {}  # rank -> its connection: rank 0's to each rank, the others' to rank 0
_byes = {}  # rank -> the figures that it sent with its "bye"
_byes_changed = threading.Condition()
_lost = threading.Event()  # a peer is gone
_ending = threading.Lock()  # held by the one thread that ends this rank
_said_bye = threading.Event()  # this rank is done: connections that close now are expected
_figures = {}  # this rank's figures for the summary (report())
_stderr = None  # a copy of this rank's stderr, where its last line goes once the rank is quiet


def install(args, rank):
    """The handlers this rank installs at the join (the module's docstring lists them)."""
    global _args, _rank, _name, _stderr
    _args, _rank, _name = args, rank, args.harness.names[rank]
    _stderr = os.dup(sys.stderr.fileno())
    _end_on_signals()
    if not args.harness.spawn_all:
        _end_with_the_command()
    if not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(args.harness.threads[rank])
    _whole_lines()
    _leave_out_known_warnings()
    # Called by multiprocessing in the rank's process as soon as the rank's function returns or
    # raises (and before the traceback of an exception is printed); at exit otherwise.
    multiprocessing.util.Finalize(None, at_the_end, exitpriority=10)


def threads_line():
    """How many threads this rank computes with, and why."""
    threads = torch.get_num_threads()
    if os.environ.get("OMP_NUM_THREADS"):
        return f"{threads} thread(s), as OMP_NUM_THREADS says"
    if _rank in _args.harness.computes:
        return f"{threads} thread(s), its share of {CORES} core(s) (OMP_NUM_THREADS to change)"
    return f"{threads} thread, as it computes little (OMP_NUM_THREADS to change)"


def _whole_lines():
    """Each line written whole, in one write: under python -u (PYTHONUNBUFFERED), print("a", 1)
    writes "a", " ", "1" and the newline separately, and two ranks' lines run into each other."""
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=False)


def _end_on_signals():
    """SIGINT (Ctrl-C) and SIGTERM end the rank at once, with 128 + the signal's number, its
    --profile trace written first; one line, unless mp.spawn started every rank (then the
    command says it). A Python handler would run only once the main thread is back from torch's
    C++ code: the signal's number goes down a pipe to a thread instead."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end)
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, _do_nothing)
    thread = threading.Thread(target=_wait_for_a_signal, args=(read_end,), daemon=True,
                              name="rpc_harness signals")
    thread.start()


def _do_nothing(number, frame):
    pass


def _wait_for_a_signal(pipe):
    while True:
        number = os.read(pipe, 1)[0]
        if number in (signal.SIGINT, signal.SIGTERM):
            break
    line = f"{_name}: interrupted"
    if number == signal.SIGTERM:
        line += " (SIGTERM)"
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # the death signal of _end_with_...
        line = f"{_name}: the command that started this rank has ended; stopping"
    end(None if _args.harness.spawn_all else line, 128 + number)


def _end_with_the_command():
    """A rank that mp.Process started gets SIGTERM when the command that started it dies, as
    mp.spawn's ranks get SIGINT (Linux's PR_SET_PDEATHSIG): no rank runs on, unseen."""
    parent = multiprocessing.parent_process()
    if parent is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != parent.pid:  # the command was gone before that
        end(f"{_name}: the command that started this rank is gone", 1)


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


# --------- The watch over the peers --------------------

def watch(peers):
    """Start watching `peers` (rank -> connection) from a thread of its own."""
    _peers.update(peers)
    thread = threading.Thread(target=_watch, daemon=True, name="rpc_harness watch")
    thread.start()


def _watch():
    """Say "." to every peer every second, and read what they say: ".", "bye <figures>",
    "gone <rank>" (from rank 0), or a closed connection."""
    connections = {sock: rank for rank, sock in _peers.items()}
    heard = dict.fromkeys(_peers, time.monotonic())
    unread = dict.fromkeys(connections, b"")
    next_beat = 0.0
    last_turn = time.monotonic()
    while connections:
        if time.monotonic() - last_turn > 3 * HEARTBEAT_SECONDS:
            # This process was stopped (SIGSTOP, a suspended laptop): the peers' silence is its
            # own. What they said meanwhile is read first.
            heard = dict.fromkeys(heard, time.monotonic())
        last_turn = time.monotonic()
        if time.monotonic() >= next_beat:
            profiling.beat()
            _send_to_all(b".\n")
            next_beat = time.monotonic() + HEARTBEAT_SECONDS
        readable = select.select(list(connections), [], [], HEARTBEAT_SECONDS)[0]
        for sock in readable:
            rank = connections[sock]
            data = b""
            with contextlib.suppress(OSError):  # a reset connection counts as closed
                data = sock.recv(65536)
            if not data:
                del connections[sock]
                if rank not in _byes and not _said_bye.is_set():
                    _peer_lost(rank, "its connection closed")
                continue
            heard[rank] = time.monotonic()
            lines = (unread[sock] + data).split(b"\n")
            unread[sock] = lines.pop()
            for line in lines:
                _read(rank, line)
        for rank in connections.values():
            silent = time.monotonic() - heard[rank]
            if rank not in _byes and silent > _args.rpc_timeout:
                _peer_lost(rank, f"silent for {_args.rpc_timeout:g} s (--rpc_timeout)")


def _read(rank, line):
    """One line from a peer."""
    if line.startswith(b"bye"):
        with _byes_changed:
            _byes[rank] = json.loads(line[4:] or b"{}")
            _byes_changed.notify_all()
    elif line.startswith(b"gone "):
        gone = int(line[5:])
        rank_0 = f"{_args.harness.names[0]} (rank 0)"
        if gone == _rank:  # this rank was stopped (SIGSTOP, say) for longer than rank 0 waits
            end(f"{_name}: {rank_0} gave up on this rank, which it had not heard from for "
                f"{_args.rpc_timeout:g} s (--rpc_timeout); stopping", 1)
        _peer_lost(gone, f"as {rank_0} saw")


def _send_to_all(message):
    for sock in list(_peers.values()):
        with contextlib.suppress(OSError):  # a peer that is gone, which the watch finds
            sock.sendall(message)


def _peer_lost(rank, how):
    """Tell the others (rank 0) and end this rank in one line. When mp.spawn started every
    rank and the peer's process is gone, end at once without a word and with status 0: mp.spawn
    names the rank that went first, in one line, and a status of 0 keeps this rank from passing
    for it."""
    if _lost.is_set() or _ending.locked():
        return
    _quiet()  # first: RPC's threads print the errors of the calls that met the peer
    _lost.set()
    _send_to_all(f"gone {rank}\n".encode())
    if _args.harness.spawn_all and not how.startswith("silent"):
        end(None, 0)
    end(f"{_name}: lost contact with {_args.harness.names[rank]} (rank {rank}, {how}); "
        "stopping", 1)


# --------- The end --------------------

def report(**figures):
    """Not in the tutorials: figures for the run's summary, which rank 0 writes at the end."""
    _figures.update(figures)


def at_the_end():
    """Run when the rank's function has returned or raised. Done (RPC shut down, no process
    group left): finish, and end the process at once (os._exit(0)): Python's and torch's
    teardown of a rank took 1.3 s of a 2-rank run on 2 cores. Failed: if a peer is gone, or
    goes within two heartbeats, that is the cause, and the watch ends the rank with its line;
    otherwise the failure is printed as Python prints it."""
    if _args is None:
        return
    if not _rpc_running() and not dist.is_initialized():
        _finish()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    elif _peers and _lost.wait(2 * HEARTBEAT_SECONDS):
        threading.Event().wait()  # the watch thread ends the process


def _rpc_running():
    try:
        rpc.get_worker_info()
    except RuntimeError:  # "RPC has not been initialized", or it has been shut down
        return False
    return True


def _finish():
    """Write the trace, say "bye" with this rank's figures; rank 0 waits for every other rank's
    (BYE_SECONDS at most), then merges the traces and writes the summary."""
    profiling.end()
    report(peak_memory_mb=_peak_memory_mb())
    if _rank != 0:
        _said_bye.set()
        _send_to_all(b"bye " + json.dumps(_figures).encode() + b"\n")
        return
    with _byes_changed:
        _byes_changed.wait_for(lambda: len(_byes) == len(_peers), timeout=BYE_SECONDS)
        figures_by_rank = {0: dict(_figures), **_byes}
    _said_bye.set()
    profiling.write_timeline_of_every_rank(_args.harness.names)
    _write_summary(figures_by_rank)


def _write_summary(figures_by_rank):
    """Print the summary line and write --summary_json; if a rank's figures never came, say
    whose, instead."""
    names = _args.harness.names
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
    if _args.harness.summary is None:
        return
    summary, line = _args.harness.summary(_args, reports)
    summary["peak_memory_mb"] = memory
    summary["wall_seconds"] = round(time.time() - _args.harness.started, 3)
    print(f"Summary: {line}; {summary['wall_seconds']:.1f} s in all")
    if _args.summary_json:
        Path(_args.summary_json).write_text(json.dumps(summary, indent=2) + "\n")


def _peak_memory_mb():
    """This rank's most resident memory (ru_maxrss: kB on Linux, bytes on macOS), and its
    GPU's, where it used one."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = {"rss": rss // (2**20 if sys.platform == "darwin" else 2**10)}
    if torch.cuda.is_initialized():
        peak["cuda"] = torch.cuda.max_memory_allocated() // 2**20
    return peak


def end(line, status):
    """End this rank now, with `line` on stderr if any, and quiet after it: RPC's threads print
    the errors of calls that meet a lost peer meanwhile. The connections to the peers close
    first, so that they learn from them, not from a failed RPC, that this rank has gone; then
    its --profile trace is written (3 s at most). os._exit: a normal exit would wait for torch's
    RPC threads, which wait for peers that are gone. A second caller (another thread ending it
    for another reason meanwhile) waits for the first to end the process."""
    if not _ending.acquire(blocking=False):
        threading.Event().wait()
    sys.stdout.flush()
    if line:
        _say(line)
    _quiet()
    for sock in _peers.values():
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
    if _peers:
        time.sleep(0.25)  # the peers read the closed connections while RPC's are still up
    profiling.end(seconds=3.0)
    sys.stdout.flush()
    os._exit(status)


def _say(line):
    """One line on this rank's stderr, even once it is quiet."""
    if _stderr is None:
        print(line, file=sys.stderr, flush=True)
    else:
        sys.stderr.flush()
        os.write(_stderr, (line + "\n").encode())


def _quiet():
    """From now on, what this process writes to stderr goes nowhere."""
    sys.stderr.flush()
    with open(os.devnull, "w") as nowhere:
        os.dup2(nowhere.fileno(), sys.stderr.fileno())
