"""The command that starts the ranks: main.py's __main__, with the tutorial's mp.spawn (every
rank) or mp.Process (the rank that --rank names). Its terminal's last line says why the run
ended, with the status, and no rank is left behind.

How a failure travels from its cause to each terminal's last line:

1. A rank learns why it must end, in rank.py: its code raised (Rank.fail, then the loop's
   _on_fail); a peer's connection closed or went silent (_on_data, _turn: _peer_lost); rank 0
   said a peer was lost or failed (_read); Ctrl-C or SIGTERM (_on_signal); or the join failed
   (rendezvous.py). Each calls Rank.end, which writes the rank's record (ending.write_record:
   its rank, name, time, line and status, in the folder that supervise() made), tells the
   peers, closes its connections and exits: 1 for a failure, 2 for bad input, 128 + N for
   signal N. A rank killed by a signal writes nothing. A rank whose command died gets SIGHUP
   (_on_signal): it removes the folder, which nobody will read, and ends without a record.
2. Its command learns that the rank ended. Under mp.spawn, mp.spawn stops the other ranks
   (SIGTERM) and raises in the command: excepthook. Under mp.Process, p.join() returns:
   exit_status. Ctrl-C or SIGTERM to the command itself: on_signal, which passes the signal
   on to the ranks.
3. The command stops what is left of its ranks (_stop_ranks) and says one line (_end_for):
   that the rank was killed by a signal, else the earliest record. Then it removes the folder
   and exits with that status (ending.end)."""

import atexit
import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import time

import torch.multiprocessing as mp

from . import ending
from .ending import signal_name
from .state import state

# How long the ranks may take to end on their own, then after SIGTERM (a rank writes its
# --profile trace first: 3 s at most), before they are killed.
GRACE_SECONDS = 5.0



def supervise(args):
    """Not in the tutorials: make this command end in one line when a rank fails or is killed,
    and on Ctrl-C or SIGTERM, stopping every rank it started first. It changes, in this process
    (docs/harness.md says why): a private folder for the ranks' records, removed as the command
    ends; handlers of SIGINT and SIGTERM; sys.excepthook, for mp.spawn's report of a failed
    rank; torch.multiprocessing's log level (ERROR); TORCH_CPP_LOG_LEVEL=FATAL and, with
    --profile, KINETO_LOG_LEVEL=6, unless set, which the ranks inherit; under torchrun, SIGTERM
    when torchrun's agent dies."""
    state.plan = args.harness
    state.plan.records = tempfile.mkdtemp(prefix="rpc_harness-")
    atexit.register(shutil.rmtree, state.plan.records, ignore_errors=True)
    ending.on_signals(on_signal)
    sys.excepthook = excepthook
    logging.getLogger("torch.multiprocessing").setLevel(logging.ERROR)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    if getattr(args, "profile", None):
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    if args.torchrun:
        signal_when_the_parent_dies(signal.SIGTERM, args.harness.parent)


def on_signal(number):
    """Ctrl-C or SIGTERM to this command: pass it on to the ranks, stop them, end with
    128 + the signal's number."""
    ending.claim()
    for process in multiprocessing.active_children():
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, number)
    _stop_ranks()
    status = 128 + number
    suffix = "" if number == signal.SIGINT else " (SIGTERM)"
    if state.plan.spawn_all:
        _end(f"interrupted{suffix}; stopped every rank", status)
    records = ending.read_records(state.plan.records)
    if records:
        _end(records[0]["line"], status)
    _end(f"{state.plan.names[state.plan.rank]}: interrupted{suffix}", status)


def excepthook(kind, value, traceback):
    """sys.excepthook of the command: mp.spawn's report that a rank ended with an error ends
    the command in one line; any other error is printed as Python prints it, and the command
    ends, status 1. Either way the ranks are stopped first (mp.spawn has stopped them already
    when it reports one)."""
    ending.claim()
    if isinstance(value, BrokenPipeError) and ending.output_closed():
        # The command's own output is a pipe that nobody reads any more: end quietly.
        _stop_ranks()
        _end(None, ending.PIPE_CLOSED)
    if isinstance(value, mp.ProcessExitedException):
        _stop_ranks()
        _end_for(value.error_index, value.exit_code, "; stopped the other ranks")
    if isinstance(value, mp.ProcessRaisedException):
        # Raised before the rank's own code ran (the harness catches what that raises): the
        # rank's traceback, which mp.spawn carried here, then the line.
        print(str(value).strip(), file=sys.stderr, flush=True)
        _stop_ranks()
        _end(f"{state.plan.names[value.error_index]} (rank {value.error_index}) failed; stopped "
             "the other ranks", 1)
    # Any other error of the command's own: its traceback, as Python prints it.
    sys.__excepthook__(kind, value, traceback)
    _stop_ranks()
    _end(None, 1)


def exit_status(process):
    """Not in the tutorials: the command's exit status, from the rank that `process` ran (the
    rank that --rank names): 0 if it succeeded; otherwise, in one line, why it ended."""
    code = process.exitcode
    if code == 0:
        shutil.rmtree(state.plan.records, ignore_errors=True)
        return 0
    ending.claim()
    _end_for(state.plan.rank, code, "")


def _end_for(rank, code, suffix):
    """End the command for rank `rank`, which ended with exit code `code` (negative: killed by
    that signal): the earliest record of the ranks, or how the rank ended."""
    who = f"{state.plan.names[rank]} (rank {rank})"
    if code < 0:  # killed by a signal: a status as a shell gives a killed command
        _end(f"{who} was killed by {signal_name(-code)}{suffix}", 128 - code)
    records = ending.read_records(state.plan.records)
    if records and records[0]["status"] == ending.PIPE_CLOSED:
        _end(None, ending.PIPE_CLOSED)  # the output that `| head` stopped reading: quietly
    if records:
        _end(records[0]["line"] + suffix, records[0]["status"])
    _end(f"{who} exited with status {code}{suffix}", code)


def _end(line, status):
    shutil.rmtree(state.plan.records, ignore_errors=True)
    ending.end(line, status)


def _stop_ranks():
    """End every rank this command started: GRACE_SECONDS to end on their own (Ctrl-C reached
    them too); then SIGCONT (a stopped rank acts on nothing else) and SIGTERM, GRACE_SECONDS
    more, and SIGKILL."""
    ranks = multiprocessing.active_children()
    _join_all(ranks, GRACE_SECONDS)
    for process in ranks:
        if process.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGCONT)
                process.terminate()
    _join_all(ranks, GRACE_SECONDS)
    for process in ranks:
        if process.is_alive():
            process.kill()
    _join_all(ranks, GRACE_SECONDS)


def _join_all(processes, seconds):
    """Wait for every process to end, `seconds` at most in all."""
    deadline = time.monotonic() + seconds
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))


def signal_when_the_parent_dies(number, parent):
    """Ask Linux for signal `number` when this process's parent, process `parent`, dies
    (PR_SET_PDEATHSIG, as torch's mp.spawn asks for its ranks); if it is gone already, send it
    now."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None).prctl(pr_set_pdeathsig, number)
    if os.getppid() != parent:  # it died before the request
        os.kill(os.getpid(), number)
