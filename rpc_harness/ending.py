"""The one way that every process of this project ends when something goes wrong: a rank, the
command that started it, a Monarch controller and a Monarch worker.

end(line, status) ends the process at once. The first thread to call it wins; another thread
that calls it later waits there until the process is gone. From then on a signal changes
nothing: the handlers that on_signals() installs return at once. The line is written straight
to the terminal's file descriptor, never through sys.stdout, whose lock another thread may hold
while it waits on a full pipe, and within WRITE_SECONDS (a terminal paused with Ctrl-S takes
nothing). Then os._exit: Python's own exit would wait for torch's threads, which may wait for
peers that are gone.

A rank does not say its own last line. It leaves a record of why it ended (write_record): its
rank, its name, the time, the line and the status, in a folder that the command made. The
command reads the records (read_records) and says the earliest in its terminal."""

import contextlib
import json
import logging
import os
import select
import signal
import sys
import threading
import time
from pathlib import Path
from typing import NoReturn

from .state import state

# How long the last line may take to reach the terminal before the process ends anyway.
WRITE_SECONDS = 2.0

# The status that a shell gives a program whose output pipe closed under it (`git log | head`:
# the reader stopped reading, and SIGPIPE ended the writer): 128 + SIGPIPE.
PIPE_CLOSED = 128 + signal.SIGPIPE



def claim():
    """Make this thread the one that ends the process. Returns in the first thread to call it
    (and again in that thread); in any other thread it waits until the process is gone."""
    if state.ending_thread == threading.get_ident():
        return
    if not state.end_claim.acquire(blocking=False):
        wait_forever()
    state.ending_thread = threading.get_ident()


def ending():
    """Whether a thread has claimed the end of this process."""
    return state.end_claim.locked()


def end(line, status) -> NoReturn:
    """End this process now, with `line` (None: nothing to say) as its terminal's last line and
    `status` as its exit status. What the process's other threads print from here on goes
    nowhere."""
    claim()
    terminal = quiet()
    if line:
        say(terminal, line)
    os._exit(status)


def quiet():
    """From now on, what this process writes on its standard output and error goes nowhere.
    Returns a file descriptor of the terminal (the standard error before the first call)."""
    if state.terminal is None:
        state.terminal = os.dup(2)
        nowhere = os.open(os.devnull, os.O_WRONLY)
        os.dup2(nowhere, 1)
        os.dup2(nowhere, 2)
        os.close(nowhere)
    return state.terminal


def output_closed():
    """Whether this process's standard output or error is a pipe that nobody reads any more: the
    program it fed has stopped reading (`| head` has its lines, `less` has quit). Linux reports
    an error (POLLERR) on the writing end of such a pipe, and nothing on a file or an open
    terminal (a terminal that closed sends SIGHUP first, which ends a rank)."""
    poller = select.poll()
    for descriptor in (1, 2) if state.terminal is None else (state.terminal,):
        poller.register(descriptor, 0)  # POLLERR is reported whatever is asked for
    return any(events & select.POLLERR for _, events in poller.poll(0))


class QuietWhenClosed:
    """A rank's sys.stdout or sys.stderr (Python lets a program replace them with any object
    that writes text): a write that meets a pipe that nobody reads any more (BrokenPipeError)
    goes nowhere and calls `on_closed`, in whatever thread it runs. Without it, the error
    surfaces where the print ran; inside a call that another rank made by RPC, torch prints
    its traceback on this rank's standard error and the caller fails with it. Everything else
    is the stream's own."""

    def __init__(self, stream, on_closed):
        self.stream = stream
        self.on_closed = on_closed

    def write(self, text):
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            self.on_closed()
            return len(text)

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def flush(self):
        try:
            self.stream.flush()
        except BrokenPipeError:
            self.on_closed()

    def __getattr__(self, name):
        if name == "stream":  # a copy made without __init__ has none: no endless recursion
            raise AttributeError(name)
        return getattr(self.stream, name)


def quiet_when_closed(on_closed):
    """From now on, this process's prints and the logging handlers that write to its standard
    output or error (logging.basicConfig's, say) go through QuietWhenClosed."""
    guarded = {}
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        guarded[id(stream)] = QuietWhenClosed(stream, on_closed)
        setattr(sys, name, guarded[id(stream)])
    known = list(logging.Logger.manager.loggerDict.values())
    loggers = [logging.getLogger()] + [item for item in known if isinstance(item, logging.Logger)]
    for logger in loggers:
        for handler in list(logger.handlers):
            stream = getattr(handler, "stream", None)
            if isinstance(handler, logging.StreamHandler) and id(stream) in guarded:
                handler.setStream(guarded[id(stream)])


def say(terminal, text):
    """Write text and a newline on the terminal's file descriptor, within WRITE_SECONDS; a
    terminal that is gone (EPIPE) or takes nothing is given up on."""

    def write():
        with contextlib.suppress(OSError):
            os.write(terminal, (text + "\n").encode(errors="replace"))

    writing = threading.Thread(target=write, daemon=True, name="rpc_harness last line")
    writing.start()
    writing.join(WRITE_SECONDS)


def whole_lines():
    """Each line written whole, in one write: under python -u (PYTHONUNBUFFERED), print("a", 1)
    writes "a", " ", "1" and the newline separately, and two processes' lines run into each
    other."""
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=False)


def wait_forever() -> NoReturn:
    """Wait until another thread ends the process."""
    while True:
        threading.Event().wait()


def wait_for_a_cause(seconds):
    """A failure is often the echo of another (a call fails because its peer died): wait up to
    `seconds` for another thread to find the cause and claim the end, and then wait for that end
    (never returning). Returns if no other thread claimed it meanwhile."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if ending() and state.ending_thread != threading.get_ident():
            wait_forever()
        time.sleep(0.05)


def on_signals(handler):
    """Call handler(signal number) on Ctrl-C (SIGINT) and on SIGTERM, in the main thread, until
    the end of the process is claimed; after that, signals change nothing."""

    def unless_ending(number, frame):
        if not ending():
            handler(number)

    signal.signal(signal.SIGINT, unless_ending)
    signal.signal(signal.SIGTERM, unless_ending)


def signal_name(number):
    """A signal's name ("SIGKILL"), or its number where Python has none (a real-time signal)."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


# --------- Each rank's record of why it ended --------------------

def write_record(folder, rank, name, line, status):
    """Leave the command the record of why this rank ends: written whole (a temporary file, then
    renamed), one file a rank, in the command's private folder."""
    record = {"rank": rank, "name": name, "time": time.time(), "line": line, "status": status}
    path = Path(folder) / f"rank{rank}.json"
    part = Path(folder) / f".rank{rank}.json"
    with contextlib.suppress(OSError):  # the command has gone, and its folder with it
        part.write_text(json.dumps(record))
        part.replace(path)


def read_records(folder):
    """The records that the ranks left in `folder`, earliest first."""
    records = []
    for path in Path(folder).glob("rank*.json"):
        with contextlib.suppress(OSError, ValueError):
            records.append(json.loads(path.read_text()))
    return sorted(records, key=lambda record: record["time"])
