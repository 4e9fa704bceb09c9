"""The supervised command, as a process supervisor sees it from outside: started as a child in a
session of its own, its standard output on a pty (its controlling terminal: Python writes each
line whole to a terminal, and closing the pty hangs up every process of the session), its
standard error on a pipe; its processes found through /proc; and stopped, every one of them.

Linux only: PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER and /proc."""

import contextlib
import ctypes
import fcntl
import os
import pty
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def _prctl(option, value):
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def become_subreaper():
    """Ask Linux to make this process the parent of any of its descendants whose own parent
    ends, so that none of them can slip out of sight (PR_SET_CHILD_SUBREAPER)."""
    if sys.platform.startswith("linux"):
        _prctl(PR_SET_CHILD_SUBREAPER, 1)


def _in_the_child(supervisor):
    """Run in the child between fork and exec: the pty on its standard output becomes the
    session's controlling terminal, and the child gets SIGKILL when the supervisor dies."""
    with contextlib.suppress(OSError):
        fcntl.ioctl(1, termios.TIOCSCTTY, 0)
    if sys.platform.startswith("linux"):
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != supervisor:  # it died before the request
        os._exit(137)


class Child:
    """One command run under the supervisor. `out` and `err` are the file descriptors that its
    standard output and standard error come from."""

    def __init__(self, argv, env):
        self.out, terminal = pty.openpty()
        attributes = termios.tcgetattr(terminal)
        attributes[1] &= ~termios.OPOST  # each "\n" as it is, not "\r\n"
        attributes[3] &= ~(termios.ECHO | termios.ICANON)
        termios.tcsetattr(terminal, termios.TCSANOW, attributes)
        with contextlib.suppress(OSError):  # the terminal's width, for --help's lines
            size = fcntl.ioctl(sys.stdout.fileno(), termios.TIOCGWINSZ, b"\0" * 8)
            if struct.unpack("HHHH", size)[1]:
                fcntl.ioctl(terminal, termios.TIOCSWINSZ, size)
        self.err, err_write = os.pipe()
        supervisor = os.getpid()
        try:
            self.process = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=terminal, stderr=err_write, env=env,
                start_new_session=True, preexec_fn=lambda: _in_the_child(supervisor))
        finally:
            os.close(terminal)
            os.close(err_write)
        self.pid = self.process.pid
        self.status = None  # its exit status once it ended, as a shell shows it

    @property
    def running(self):
        return self.status is None

    def reap(self):
        """Collect every child of this process that has ended (the command, and descendants
        that came to this subreaper); record the command's status. Returns whether the command
        ended now."""
        ended = False
        while True:
            try:
                pid, wait_status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return ended
            if pid == 0:
                return ended
            if pid == self.pid:
                code = os.waitstatus_to_exitcode(wait_status)
                self.status = 128 - code if code < 0 else code
                self.process.returncode = code  # so that Popen does not wait for it again
                ended = True

    def processes(self):
        """The pids of every process of the command still alive: its session's and, where
        one left the session, this supervisor's descendants."""
        table = process_table()
        found = {pid for pid, (_, _, session) in table.items() if session == self.pid}
        found |= descendants(os.getpid(), table)
        return sorted(found)

    def stopped(self):
        """Whether a process of the command is stopped (SIGSTOP, SIGTSTP, a debugger)."""
        return any(state in "Tt" for state, _, _ in process_table(self.processes()).values())

    def stop(self, grace):
        """End every process of the command: SIGCONT (a stopped process acts on nothing else)
        and SIGTERM, `grace` seconds to end, then SIGKILL; bounded, whatever they do."""
        self._signal_all(signal.SIGCONT)
        self._signal_all(signal.SIGTERM)
        if not self._wait_until_gone(grace):
            self._signal_all(signal.SIGKILL)
            self._wait_until_gone(2.0)

    def _signal_all(self, number):
        for pid in self.processes():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, number)

    def _wait_until_gone(self, seconds):
        deadline = time.monotonic() + seconds
        while True:
            self.reap()
            if not self.processes():
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)


def process_table(pids=None):
    """{pid: (state, parent pid, session id)} of the live processes (zombies left out), from
    /proc: of `pids` where given, else of every process."""
    if pids is None:
        pids = [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]
    table = {}
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z":
            table[pid] = (fields[0], int(fields[1]), int(fields[3]))
    return table


def descendants(root, table):
    """The pids below process `root` in `table` (process_table())."""
    children = {}
    for pid, (_, parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


class Lines:
    """Whole lines from a stream of bytes that arrives in pieces."""

    def __init__(self):
        self.unfinished = b""

    def feed(self, data):
        """The lines that `data` completes, each with its b"\\n"."""
        *lines, self.unfinished = (self.unfinished + data).split(b"\n")
        return [line + b"\n" for line in lines]

    def rest(self):
        """What is left without a b"\\n" (the stream ended), as a line of its own."""
        rest, self.unfinished = self.unfinished, b""
        return [rest + b"\n"] if rest else []
