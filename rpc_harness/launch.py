"""The command that starts the ranks (main.py's __main__, with mp.spawn or mp.Process) ends in
one line when a rank fails or is killed, on Ctrl-C and on SIGTERM, with the rank's status, and
leaves no rank behind. torch's mp.spawn already stops the other ranks when one fails and gives
each rank a death signal for when the command dies; what it lacks is the line and the status.
main.py installs the two entry points: sys.excepthook = excepthook, and on_sigterm for SIGTERM."""

import multiprocessing
import os
import signal
import sys
import time

import torch.multiprocessing as mp

from . import cli

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
        if value.exit_code in (130, 143):  # a rank's own Ctrl-C or SIGTERM came first
            _stop_ranks(wait_first=True)
            suffix = "" if value.exit_code == 130 else " (SIGTERM)"
            _end(f"interrupted{suffix}; stopped every rank", value.exit_code)
        if value.exit_code < 0:
            how = f"was killed by {signal.Signals(-value.exit_code).name}"
        else:
            how = f"exited with status {value.exit_code}"
        _stop_ranks(wait_first=False)
        _end(f"{_name(names, rank)} {how}; stopped the other ranks",
             2 if value.exit_code == 2 else 1)
    if isinstance(value, mp.ProcessRaisedException):
        if str(value).strip().endswith("KeyboardInterrupt"):  # Ctrl-C before the rank joined
            _stop_ranks(wait_first=True)
            _end("interrupted; stopped every rank", 130)
        # The rank's own traceback, which mp.spawn carried here: an unexpected failure.
        print(str(value).strip(), file=sys.stderr)
        _stop_ranks(wait_first=False)
        _end(f"{_name(names, value.error_index)} failed; stopped the other ranks", 1)
    sys.__excepthook__(kind, value, traceback)


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
    os._exit(status)
