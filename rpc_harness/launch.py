"""The command that starts the ranks (main.py's __main__, with mp.spawn or mp.Process) ends in
one line when a rank fails or is killed, on Ctrl-C and on SIGTERM, with the rank's status, and
leaves no rank behind. torch's mp.spawn already stops the other ranks when one fails and gives
each rank a death signal for when the command dies; what it lacks is the line and the status.
main.py installs the entry points: sys.excepthook = excepthook and on_sigterm for SIGTERM (every
rank here), and sys.exit(exit_status(p)) (the rank that --rank names).

Under mp.spawn the command speaks for every rank: a rank ends silently, and the command names
the rank that mp.spawn saw end first and why: killed by a signal (its exit code), failed (the
traceback that mp.spawn carried here), or a reason that the rank left for it (leave_reason: a
peer gone silent, which mp.spawn cannot see)."""

import contextlib
import json
import multiprocessing
import os
import signal
import sys
import time

import torch.multiprocessing as mp

from . import cli
from .cli import signal_name

# How long the ranks may take to end on their own, then after SIGTERM (a rank writes its
# --profile trace first: 3 s at most), before they are killed.
GRACE_SECONDS = 5.0


def excepthook(kind, value, traceback):
    """sys.excepthook for the command that starts the ranks: mp.spawn's report of a failed rank
    and Ctrl-C (KeyboardInterrupt) end the command in one line; anything else is printed as
    Python prints it."""
    names = cli.launched.names if cli.launched else None
    if issubclass(kind, KeyboardInterrupt):
        _interrupt_ranks()
        _stop_ranks(wait_first=True)
        _end("interrupted; stopped every rank" if _spawned_all() else None, 130)
    if isinstance(value, mp.ProcessExitedException):
        rank = value.error_index
        code = value.exit_code
        if code in (130, 143):  # a rank's own Ctrl-C or SIGTERM came first
            _stop_ranks(wait_first=True)
            suffix = "" if code == 130 else " (SIGTERM)"
            _end(f"{_name(names, rank)} was interrupted{suffix}; stopped every rank", code)
        if code < 0:  # killed by a signal: the status a shell gives a killed command
            _stop_ranks(wait_first=False)
            _end(f"{_name(names, rank)} was killed by {signal_name(-code)}; stopped the other "
                 "ranks", 128 - code)
        how = _reason_left_by(rank) or f"exited with status {code}"
        _stop_ranks(wait_first=False)
        _end(f"{_name(names, rank)} {how}; stopped the other ranks", 2 if code == 2 else 1)
    if isinstance(value, mp.ProcessRaisedException):
        if str(value).strip().endswith("KeyboardInterrupt"):  # Ctrl-C before the rank joined
            _stop_ranks(wait_first=True)
            _end("interrupted; stopped every rank", 130)
        # The rank's own traceback, which mp.spawn carried here: an unexpected failure; then
        # the error in one line, which the rank left (leave_reason).
        print(str(value).strip(), file=sys.stderr)
        how = _reason_left_by(value.error_index) or "failed"
        _stop_ranks(wait_first=False)
        _end(f"{_name(names, value.error_index)} {how}; stopped the other ranks", 1)
    sys.__excepthook__(kind, value, traceback)


def exit_status(process):
    """Not in the tutorials: the command's exit status, from the rank that `process` ran (the
    rank that --rank names). A rank says why it ends, in one line, unless a signal killed it
    (kill -9 of its process): then the command says so, and ends with 128 + the signal's
    number, as a shell reports a killed command."""
    code = process.exitcode
    if code is None or code >= 0:
        return code
    launched = cli.launched
    who = "its rank" if launched is None else _name(launched.names, launched.rank)
    sys.stdout.flush()
    print(f"{who} was killed by {signal_name(-code)}", file=sys.stderr, flush=True)
    return 128 - code


def leave_reason(args, rank, reason):
    """A rank under mp.spawn: leave the command the reason why this rank ends (it ends silently,
    and the command says the line). One line a rank, appended whole."""
    line = json.dumps({"rank": rank, "reason": reason}) + "\n"
    with contextlib.suppress(OSError):
        descriptor = os.open(args.harness.reasons, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.write(descriptor, line.encode())
        os.close(descriptor)


def _reason_left_by(rank):
    """The reason that `rank` left (leave_reason), or None."""
    launched = cli.launched
    if launched is None or not launched.reasons:
        return None
    try:
        lines = open(launched.reasons).read().splitlines()
    except OSError:
        return None
    for line in lines:
        with contextlib.suppress(ValueError, KeyError, TypeError):
            left = json.loads(line)
            if left["rank"] == rank:
                return left["reason"]
    return None


def on_sigterm(number, frame):
    """The SIGTERM handler of the command that starts the ranks: stop them, then end with 143
    (the rank that --rank names says so itself)."""
    _stop_ranks(wait_first=False)
    _end("interrupted (SIGTERM); stopped every rank" if _spawned_all() else None, 143)


def _spawned_all():
    return cli.launched is None or cli.launched.spawn_all


def _name(names, rank):
    if names is None:
        return f"rank {rank}"
    return f"{names[rank]} (rank {rank})"


def _interrupt_ranks():
    """Pass Ctrl-C on to the ranks: a terminal sends it to every process of its foreground
    group, `kill -INT` to this command alone. A rank ends at its first SIGINT."""
    for process in multiprocessing.active_children():
        if process.is_alive() and process.pid:
            os.kill(process.pid, signal.SIGINT)


def _stop_ranks(wait_first):
    """End every rank this command started: wait_first, give them GRACE_SECONDS to end on their
    own (a terminal's Ctrl-C reached them too); then SIGTERM, GRACE_SECONDS more, and SIGKILL."""
    ranks = multiprocessing.active_children()
    if wait_first:
        _join_all(ranks, GRACE_SECONDS)
    for process in ranks:
        if process.is_alive():
            process.terminate()
            with contextlib.suppress(OSError):  # a stopped rank (SIGSTOP) acts on it too
                os.kill(process.pid, signal.SIGCONT)
    _join_all(ranks, GRACE_SECONDS)
    for process in ranks:
        if process.is_alive():
            process.kill()
        process.join()


def _join_all(processes, seconds):
    """Wait for every process to end, `seconds` at most in all."""
    deadline = time.monotonic() + seconds
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))


def _end(line, status):
    """End this command now, with `line` on stderr if any. os._exit: the interpreter's own exit
    would join the rank processes again, and run Python's exit status for Ctrl-C (a death by
    SIGINT) rather than 130."""
    sys.stdout.flush()
    if line:
        print(line, file=sys.stderr, flush=True)
    launched = cli.launched
    if launched is not None and launched.reasons:
        with contextlib.suppress(OSError):
            os.remove(launched.reasons)
    os._exit(status)
