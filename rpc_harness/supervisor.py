"""rpcrun: one supervisor in front of one command, in every terminal of a run, as torchrun's
agent is in front of its workers. Its state is one Supervisor (with its Phase); one loop acts on
it (`selectors`, over the signals, the command's output and the other supervisors); the run ends
in one place, Supervisor.end, with one line and a status. docs/rpcrun.md tells the story.

A command that starts every rank (no --rank) is supervised alone. One rank a command (--rank R):
the supervisors meet first, at rpcrun's port on --master_addr. Rank 0's starts its command at
once and admits the others (same program, world and flags; a rank taken once); each other
supervisor starts its command once admitted. From then on they beat every second. When a rank
ends for any reason but success, its supervisor tells rank 0's, which decides why the run ends
(the verdict: a cause that came from outside, such as a kill, Ctrl-C or a lost peer, before a
failure that may follow from it; then the first) and tells every supervisor; each ends its
command and says the verdict in one line, its terminal's last."""

import collections
import contextlib
import enum
import json
import os
import re
import select
import selectors
import signal
import socket
import stat
import sys
import time
from dataclasses import dataclass, field

from .child import Child, Lines, become_subreaper
from .command import Command, child_environment, parse, threads_line
from .meeting import HEARTBEAT_SECONDS, Link, connect, differences, listen
from .timeline import write_timeline

# How long a line on the command's standard error is held before it is shown (and every line
# after it, so that the lines keep their order), so that a traceback that follows from another
# rank's end (which rank 0's verdict names soon after) can be left out; a traceback is held
# until its process ends, or TRACEBACK_HOLD_SECONDS without a new line. A rank's process takes
# seconds to end after its traceback (torch's teardown: 2.4 s for pipelining.py on 2 idle
# cores, over 5 s on busy ones), and the verdict comes CAUSE_SECONDS after that.
HOLD_SECONDS = 1.0
TRACEBACK_HOLD_SECONDS = 15.0
# How long rank 0 waits, after a rank failed, for a cause from outside from another rank (a
# rank killed ends its command a moment after its peers lose it); how much longer it waits for
# the ending of a rank whose traceback came before that of every failure reported (the rank
# whose error ended the others' runs, but whose process was slower to end); and how long a
# rank whose command failed waits for rank 0's verdict (more than the two waits together).
CAUSE_SECONDS = 1.5
FIRST_FAILURE_SECONDS = 2.5
VERDICT_SECONDS = 6.0
# SIGTERM, then this long, then SIGKILL: Ctrl-C ends a rank within 2 s.
GRACE_SECONDS = 1.0
# How often the command's processes are looked at for one that is stopped.
STOPPED_POLL_SECONDS = 2.0
# Rank 0, its own command done, waits this long for the others to end theirs.
DONE_SECONDS = 30.0
# A turn of the loop this much later than the last (it waits 0.5 s at most): the supervisor
# itself was stopped, or starved of the CPU.
STOPPED_SELF_SECONDS = 1.5
# How long the output of a command that ended may take to drain.
DRAIN_SECONDS = 1.0

PIPE_CLOSED = 141  # 128 + SIGPIPE, as a shell shows `git log | head`
SIGNAL_STATUS = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}
SIGNAL_WORDS = {signal.SIGINT: "interrupted (Ctrl-C)", signal.SIGTERM: "interrupted (SIGTERM)",
                signal.SIGHUP: "interrupted: its terminal closed (SIGHUP)"}

# mp.spawn's report of the rank that ended first (torch.multiprocessing.spawn, 2.4 to 2.15).
SPAWN_SIGNAL = re.compile(r"process (\d+) terminated with signal (\w+)")
SPAWN_EXIT = re.compile(r"process (\d+) terminated with exit code (\d+)")
SPAWN_RAISED = re.compile(r"^-- Process (\d+) terminated with the following error:")
# mp.spawn's warning as it ends the other ranks (2.4 to 2.15).
SPAWN_TERMINATING = re.compile(r"Terminating process \d+ via signal")
TRACEBACK = "Traceback (most recent call last):"
# An exception that torch's RPC carried back from the worker whose code raised it: the caller's
# traceback ends with "On WorkerInfo(id=N, name=NAME):", the exception's repr, the callee's own
# traceback, and after its exception torch's "At:" and the frames where the caller re-raised it
# (torch.distributed.rpc.internal, 2.4 to 2.15).
REMOTE_WORKER = re.compile(r"On WorkerInfo\(id=\d+, name=([^)]+)\):")
REMOTE_FRAMES = "At:"


class Phase(enum.Enum):
    ADMISSION = "admission"  # rank R: waiting for rank 0's welcome; its command not started
    RUNNING = "running"  # the command runs
    DECIDING = "deciding"  # this rank's command ended badly: waiting for rank 0's verdict
    DONE = "done"  # rank 0: its command succeeded; waiting for the other ranks to end theirs


@dataclass
class Held:
    """A line of the command's, held until `until` (time.monotonic()), for `stream`."""

    until: float
    stream: object
    line: bytes

    @property
    def text(self):
        return self.line.decode(errors="replace").rstrip("\n")


@dataclass
class Ending:
    """Why a rank ends: the line for its own terminal and the line for the others', its
    status, and whether the cause came from outside the program (a kill, a signal, a lost or
    stopped rank: first in the verdict) or is a failure that may follow from another's end."""

    rank: int | None
    line: str | None
    others: str
    status: int
    cause: bool
    # A failure: when its command's first traceback began (time.time(), as its supervisor read
    # it), which orders failures by their start rather than by their commands' ends.
    traceback_at: float | None = None

    def message(self):
        return {"rank": self.rank, "line": self.line, "others": self.others,
                "status": self.status, "cause": self.cause, "traceback_at": self.traceback_at}


@dataclass(eq=False)
class Supervisor:
    """What the supervisor holds. Only the loop changes it."""

    command: Command
    phase: Phase = Phase.RUNNING
    child: Child | None = None
    selector: selectors.BaseSelector = field(default_factory=selectors.DefaultSelector)
    wake: int | None = None  # the read end of the signals' wake-up pipe
    out_lines: Lines = field(default_factory=Lines)
    err_lines: Lines = field(default_factory=Lines)
    held: list = field(default_factory=list)  # Held lines of the command, not yet shown
    traceback_at: float | None = None  # when the last line of a held traceback came
    first_traceback_wall: float | None = None  # when the command's first traceback began
    tracebacks: dict = field(default_factory=dict)  # rank 0: rank -> its first traceback's time
    waited_for_first: bool = False  # rank 0: it waited FIRST_FAILURE_SECONDS once already
    recent_errors: collections.deque = field(  # the last lines of standard error, shown or not
        default_factory=lambda: collections.deque(maxlen=400))
    listener: socket.socket | None = None  # rank 0's
    links: dict = field(default_factory=dict)  # rank -> Link (rank 0: every admitted rank)
    admitted: set = field(default_factory=set)  # rank 0: every rank it ever admitted
    newcomers: list = field(default_factory=list)  # rank 0: links not yet said hello
    to_rank_0: Link | None = None  # rank R's link
    joined: bool = False  # every rank has come
    done: set = field(default_factory=set)  # rank 0: the ranks whose command succeeded
    endings: list = field(default_factory=list)  # rank 0: Endings reported, the first first
    deciding_until: float | None = None  # rank 0: when the verdict is due; rank R: the wait
    own_ending: Ending | None = None  # rank R in DECIDING: its own, used if no verdict comes
    started: float = field(default_factory=time.monotonic)
    started_wall: float = field(default_factory=time.time)
    join_deadline: float = 0.0
    next_beat: float = 0.0
    next_look: float = 0.0
    stopped_since: float | None = None
    done_deadline: float | None = None
    waiting_said: bool = False
    last_turn: float = field(default_factory=time.monotonic)

    # --------- Start --------------------

    def start(self):
        """Set up the signals and the meeting, and start the command (rank R: once admitted).
        May end the supervisor (a port that cannot be listened on)."""
        become_subreaper()
        self.wake, wake_write = os.pipe()
        os.set_blocking(wake_write, False)
        os.set_blocking(self.wake, False)
        signal.set_wakeup_fd(wake_write)
        for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(number, lambda number, frame: None)  # the number goes down the pipe
        self.selector.register(self.wake, selectors.EVENT_READ, self.on_signals)
        self.join_deadline = self.started + self.command.join_timeout
        command = self.command
        if not command.meets:
            self.start_child()
        elif command.rank == 0:
            try:
                self.listener = listen(command.master_addr, command.port)
            except OSError as error:
                self.end(Ending(0, f"cannot listen on {command.master_addr}:"
                                   f"{command.port} ({error.strerror or error}): rank 0 of this "
                                   "run is taken, or another run uses the port; choose another "
                                   "--master_port (or rpcrun --port)", "", 2, True))
            self.listener.setblocking(False)
            self.selector.register(self.listener, selectors.EVENT_READ, self.on_newcomer)
            self.say(f"rank 0 of {command.world_size}: waiting for "
                     f"{self.missing_text()} at {command.master_addr}:{command.port}")
            self.start_child()
        else:
            self.phase = Phase.ADMISSION

    def start_child(self):
        env, set_here = child_environment(self.command)
        line = threads_line(self.command, env, set_here)
        if line:
            self.say(line)
        self.child = Child([sys.executable, str(self.command.script), *self.command.argv], env)
        self.selector.register(self.child.out, selectors.EVENT_READ, self.on_output)
        self.selector.register(self.child.err, selectors.EVENT_READ, self.on_errors)
        self.phase = Phase.RUNNING

    # --------- The loop --------------------

    def run(self):
        """The loop: never returns (Supervisor.end exits)."""
        while True:
            for key, _ in self.selector.select(self.timeout()):
                key.data(key.fileobj)
            self.turn()

    def timeout(self):
        now = time.monotonic()
        due = [self.next_beat, now + 0.5]
        if self.traceback_at is not None:
            due.append(self.traceback_at + TRACEBACK_HOLD_SECONDS)
        elif self.held:
            due.append(self.held[0].until)
        if self.deciding_until is not None:
            due.append(self.deciding_until)
        return max(0.0, min(due) - now)

    def turn(self):
        """What time brings: admission retries, heartbeats and silences, the verdict when due,
        held lines when old enough, a stopped process, the deadlines."""
        now = time.monotonic()
        if now - self.last_turn > STOPPED_SELF_SECONDS:
            # This supervisor was stopped (SIGSTOP, a suspended machine): the silence of its
            # peers meanwhile is its own; what became of them, it reads next.
            for link in self.all_links():
                link.heard = now
        self.last_turn = now
        if self.child is not None and self.child.running and self.child.reap():
            self.on_child_ended()
        if self.phase is Phase.ADMISSION:
            self.try_admission(now)
        if now >= self.next_beat:
            self.next_beat = now + HEARTBEAT_SECONDS
            for link in self.all_links():
                link.send("beat")
        for link in list(self.newcomers):
            if now - link.heard > self.command.lost_timeout:
                self.on_lost(link, "it said nothing")  # not a supervisor of ours
        for link in self.all_links():
            if now - link.heard > self.command.lost_timeout:
                self.on_lost(link, f"its rpcrun was silent for {self.command.lost_timeout:g} s "
                                   "(--lost_timeout)")
        self.release_held(now)
        if self.deciding_until is not None and now >= self.deciding_until:
            self.on_decision_due()
        if self.command.meets and self.command.rank == 0 and not self.joined \
                and now > self.join_deadline:
            self.on_join_late()
        if self.phase is Phase.DONE and now > self.done_deadline:
            self.on_done_late()
        if self.child is not None and self.child.running and now >= self.next_look:
            self.next_look = now + STOPPED_POLL_SECONDS
            self.look_for_a_stop(now)
        if self.child is not None and self.child.running and output_closed():
            self.on_output_closed()

    def all_links(self):
        links = list(self.links.values())
        if self.to_rank_0 is not None:
            links.append(self.to_rank_0)
        return [link for link in links if not link.closed]

    # --------- Signals --------------------

    def on_signals(self, _):
        try:
            numbers = os.read(self.wake, 64)
        except BlockingIOError:
            return
        for number in numbers:
            if number == signal.SIGCHLD:
                continue  # turn() reaps
            rank = self.command.rank
            if self.command.meets:
                line = f"rank {rank} {SIGNAL_WORDS[number]}"
            else:
                line = f"{SIGNAL_WORDS[number]}; ended every rank"
            self.end_here(Ending(rank, line, f"rank {rank} was {SIGNAL_WORDS[number]}",
                                 SIGNAL_STATUS[number], True))

    # --------- The command's output --------------------

    def on_output(self, fd):
        data = self.read(fd)
        lines = self.out_lines.feed(data) if data else self.out_lines.rest()
        now = time.monotonic()
        for line in lines:
            self.held.append(Held(now, sys.stdout, line))
        self.release_held(now)

    def on_errors(self, fd):
        data = self.read(fd)
        lines = self.err_lines.feed(data) if data else self.err_lines.rest()
        for line in lines:
            self.hold_error(line)

    def hold_error(self, line):
        """Hold a line of the command's standard error: HOLD_SECONDS, or, in a traceback, until
        TRACEBACK_HOLD_SECONDS after its last line. Rank 0 hears when the command's first
        traceback began."""
        now = time.monotonic()
        if line.startswith(TRACEBACK.encode()):
            if self.first_traceback_wall is None:
                self.first_traceback_wall = time.time()
                self.on_first_traceback()
            self.traceback_at = now
        elif self.traceback_at is not None:
            self.traceback_at = now
        self.held.append(Held(now + HOLD_SECONDS, sys.stderr, line))
        self.recent_errors.append(self.held[-1].text)

    def on_first_traceback(self):
        if not self.command.meets:
            return
        if self.command.rank == 0:
            self.tracebacks[0] = self.first_traceback_wall
        elif self.to_rank_0 is not None:
            self.to_rank_0.send("traceback", at=self.first_traceback_wall)

    def read(self, fd):
        """What the command wrote; b"" at its end (a pty's end reads as an error, EIO)."""
        try:
            data = os.read(fd, 65536)
        except OSError:
            data = b""
        if not data:
            self.selector.unregister(fd)
        return data

    def release_held(self, now):
        """Show the held lines that are due, in the order they came: standard output at once,
        unless a line of standard error before it is held; standard error HOLD_SECONDS late,
        and a traceback TRACEBACK_HOLD_SECONDS after its last line."""
        if self.traceback_at is not None:
            if now - self.traceback_at < TRACEBACK_HOLD_SECONDS:
                return
            self.traceback_at = None
        while self.held and self.held[0].until <= now:
            held = self.held.pop(0)
            self.show(held.line, held.stream)

    def show(self, line, stream):
        """Write a line of the command's to this supervisor's own output; a pipe that nobody
        reads any more ends the run quietly."""
        try:
            stream.buffer.write(line)
            stream.buffer.flush()
        except BrokenPipeError:
            self.on_output_closed()

    def drain(self):
        """The rest of the command's output, once it ended (its processes may still be closing
        their ends), DRAIN_SECONDS at most."""
        deadline = time.monotonic() + DRAIN_SECONDS
        for fd, lines, stream in ((self.child.out, self.out_lines, sys.stdout),
                                  (self.child.err, self.err_lines, sys.stderr)):
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(fd)
            os.set_blocking(fd, False)
            while time.monotonic() < deadline:
                try:
                    data = os.read(fd, 65536)
                except BlockingIOError:
                    time.sleep(0.01)
                    continue
                except OSError:
                    data = b""
                for line in lines.feed(data) if data else lines.rest():
                    if stream is sys.stderr:
                        self.hold_error(line)  # a traceback here may follow another's end
                    else:
                        self.held.append(Held(0.0, stream, line))
                if not data:
                    break

    def on_output_closed(self):
        rank = self.command.rank
        self.end_here(Ending(rank, None, f"rank {rank}'s output was closed (a pipe that nobody "
                                         "reads)", PIPE_CLOSED, True))

    # --------- The command's end --------------------

    def on_child_ended(self):
        """The command ended by itself: success, or why it failed."""
        self.drain()
        status = self.child.status
        if status == 0:
            self.release_all()
            self.child.stop(GRACE_SECONDS)  # what the command left behind, if anything
            self.on_success()
            return
        ending = self.failure_of_the_command(status)
        if not self.command.meets:
            self.end(ending)
        self.report(ending)

    def failure_of_the_command(self, status):
        """Why the command ended with `status`: a rank killed by a signal (its status 128 + N,
        or mp.spawn's report of it), a rank whose code raised (its traceback's last line), bad
        input (status 2: the command's own line says it), or another status."""
        rank = self.command.rank
        lines = list(self.recent_errors)
        if rank is None:
            return self.spawn_failure(lines, status)
        signal_name = signal_of(status)
        if signal_name:
            return Ending(rank, f"rank {rank} was killed by {signal_name}",
                          f"rank {rank} was killed by {signal_name}", status, True)
        last = last_error(lines)
        if status == 2 and not any(line.startswith(TRACEBACK) for line in lines):
            return Ending(rank, None, f"rank {rank} refused its command line "
                                      f"({last or 'status 2'})", 2, False)
        why = last or f"status {status}"
        return Ending(rank, f"rank {rank} failed ({why})", f"rank {rank} failed ({why})",
                      status, False, self.first_traceback_wall)

    def spawn_failure(self, lines, status):
        """A command that started every rank (mp.spawn) ended with `status`: mp.spawn's report
        of the first rank that ended says which and how; its traceback is left out, but for
        a rank's own traceback, which it carries."""
        for number, line in enumerate(lines):
            raised = SPAWN_RAISED.match(line)
            if raised:
                if any(held.text == line for held in self.held):  # not shown yet
                    self.leave_out_the_last_traceback(before=line)
                    self.held += [Held(0.0, sys.stderr, (text + "\n").encode())
                                  for text in lines[number + 1:]]
                why = last_error(lines) or "it raised"
                return Ending(None, f"rank {raised.group(1)} failed ({why}); ended the "
                                    "other ranks", "", 1, False)
        for line in reversed(lines):
            killed = SPAWN_SIGNAL.search(line)
            exited = SPAWN_EXIT.search(line)
            if killed or exited:
                self.leave_out_what_followed()
            if killed:
                number = getattr(signal, killed.group(2), None)
                status = 128 + int(number) if number else 1
                return Ending(None, f"rank {killed.group(1)} was killed by "
                                    f"{killed.group(2)}; ended the other ranks", "", status, True)
            if exited:
                return Ending(None, f"rank {exited.group(1)} exited with status "
                                    f"{exited.group(2)}; ended the other ranks", "", 1, False)
        signal_name = signal_of(status)
        if signal_name:
            return Ending(None, f"{self.command.script.name} was killed by "
                                f"{signal_name}", "", status, True)
        if any(line.startswith(TRACEBACK) for line in lines[-200:]):
            why = last_error(lines) or f"status {status}"
            return Ending(None, f"{self.command.script.name} failed ({why})", "",
                          status, False)
        return Ending(None, None, "", status, False)  # its own last line says why

    def on_success(self):
        rank = self.command.rank
        if not self.command.meets:
            self.finish()
        if rank == 0:
            self.done.add(0)
            self.phase = Phase.DONE
            self.done_deadline = time.monotonic() + DONE_SECONDS
            self.check_all_done()
            return
        if self.to_rank_0 is not None:
            self.to_rank_0.send("done")
        self.finish()

    def check_all_done(self):
        if self.phase is Phase.DONE and len(self.done) == self.command.world_size:
            self.finish()

    def finish(self):
        """Every rank of this supervisor's is done: the timeline, and status 0."""
        if self.command.profile and self.command.rank in (None, 0):
            with contextlib.suppress(OSError):
                line = write_timeline(self.command.profile, newer_than=self.started_wall)
                if line:
                    self.say(line)
        self.exit(0)

    def look_for_a_stop(self, now):
        """A process of the command stopped (SIGSTOP) for --lost_timeout is lost: it ends."""
        if not self.child.stopped():
            self.stopped_since = None
            return
        if self.stopped_since is None:
            self.stopped_since = now
            return
        if now - self.stopped_since >= self.command.lost_timeout:
            rank = self.command.rank
            seconds = f"{self.command.lost_timeout:g} s (--lost_timeout)"
            who = f"rank {rank}" if rank is not None else "a rank"
            self.end_here(Ending(rank, f"{who} was stopped (SIGSTOP) for {seconds}; "
                                       "ended it" + ("" if rank is not None else
                                                     " and every other rank"),
                                 f"rank {rank} was stopped (SIGSTOP) for {seconds}", 1, True))

    # --------- Endings and the verdict --------------------

    def end_here(self, ending):
        """This rank ends for a cause of its own (a signal, a closed output, a process stopped
        too long): rank 0 hears why first, then the command is ended. A cause from outside
        needs no verdict."""
        self.report(ending, wait=False)
        self.end(ending)

    def report(self, ending, wait=True):
        """Tell rank 0 why this rank ends; rank 0 itself decides. With wait, a failure (not a
        cause from outside) waits for rank 0's verdict, VERDICT_SECONDS at most, as another
        rank's end may have caused it; otherwise, or where rank 0 cannot be told, this rank
        ends by its own reason."""
        if not self.command.meets:
            return
        if self.command.rank == 0:
            self.consider(ending)
            return
        told = self.to_rank_0 is not None and self.to_rank_0.send("ending", **ending.message())
        if not wait:
            return
        if told and not ending.cause:
            self.phase = Phase.DECIDING
            self.own_ending = ending
            self.deciding_until = time.monotonic() + VERDICT_SECONDS
            return
        self.end(ending)

    def consider(self, ending):
        """Rank 0: an Ending reported (its own, or another rank's). A cause from outside decides
        at once; a failure waits CAUSE_SECONDS for a cause that came before it."""
        if self.endings and self.deciding_until is None:
            return  # decided already
        self.endings.append(ending)
        if ending.cause or self.waited_for_first:  # the cause, or the failure waited for
            self.decide()
        elif self.deciding_until is None:
            self.deciding_until = time.monotonic() + CAUSE_SECONDS

    def on_decision_due(self):
        self.deciding_until = None
        if self.command.rank == 0:
            self.decide()
        else:  # no verdict came: rank 0 is gone; this rank's own reason
            self.end(self.own_ending)

    def decide(self):
        """Rank 0: the verdict, from the endings reported so far (a cause before a failure,
        then the failure whose traceback began first), to every rank; then this rank ends by
        it. Where a rank not yet ended began a traceback before every failure reported, its
        ending is waited for, FIRST_FAILURE_SECONDS once."""
        self.deciding_until = None
        verdict = next((e for e in self.endings if e.cause), None)
        if verdict is None:
            verdict = min(self.endings, key=self.failure_order)
            ended = {ending.rank for ending in self.endings}
            earlier = [rank for rank, at in self.tracebacks.items() if rank not in ended
                       and at < (verdict.traceback_at or float("inf"))]
            if earlier and not self.waited_for_first:
                self.waited_for_first = True
                self.deciding_until = time.monotonic() + FIRST_FAILURE_SECONDS
                return
        for link in self.all_links():
            link.send("verdict", **verdict.message())
        self.end_by(verdict)

    def failure_order(self, ending):
        """Failures in the order their tracebacks began (as the supervisors read them), those
        without one after, each in the order rank 0 heard of it."""
        began = ending.traceback_at
        return (began is None, began or 0.0, self.endings.index(ending))

    def end_by(self, verdict):
        """End by the verdict: this rank's own line where it is the rank that ended the run,
        else the other ranks' line."""
        if verdict.rank == self.command.rank:
            self.end(verdict)
        rank = self.command.rank
        self.held = []  # what followed from the other rank's end
        self.end(Ending(rank, f"rank {rank} ended: {verdict.others}", verdict.others,
                        1, verdict.cause))

    def on_lost(self, link, how):
        """A supervisor is gone or silent: rank 0 loses that rank; a rank loses rank 0."""
        rank = link.rank
        link.close()
        if rank is None:
            self.newcomers = [other for other in self.newcomers if other is not link]
            return
        if self.command.rank == 0:
            self.links.pop(rank, None)
            if rank in self.done:
                return
            self.consider(Ending(rank, None, f"lost contact with rank {rank} ({how})",
                                 1, True))
            return
        if self.phase is Phase.DECIDING:
            self.end(self.own_ending)
        self.end(Ending(self.command.rank,
                        f"rank {self.command.rank} ended: lost contact with rank 0 "
                        f"({how})", "", 1, True))

    def on_join_late(self):
        """Rank 0: a rank did not come within --join_timeout."""
        self.joined = True  # decided once
        self.consider(Ending(None, None,
                             f"{self.missing_text()} did not join at {self.command.master_addr}:"
                             f"{self.command.port} within {self.command.join_timeout:g} s "
                             "(--join_timeout); start every rank with the same flags", 1, True))

    def on_done_late(self):
        """Rank 0: its command is done, but another rank's has not ended in DONE_SECONDS."""
        late = sorted(set(range(self.command.world_size)) - self.done)
        self.phase = Phase.RUNNING  # so that the verdict ends this rank like the others
        self.consider(Ending(None, None, f"rank {late[0]} did not end within {DONE_SECONDS:g} s "
                                         "of rank 0", 1, True))

    # --------- The meeting --------------------

    def try_admission(self, now):
        """Rank R: ask rank 0's supervisor to admit this rank, until --join_timeout."""
        command = self.command
        if now > self.join_deadline:
            what = "nothing answered" if self.to_rank_0 is None else "no answer came"
            self.end(Ending(command.rank, f"rank 0 did not come: {what} at "
                                          f"{command.master_addr}:{command.port} within "
                                          f"{command.join_timeout:g} s (--join_timeout); start "
                                          "it with the same flags", "", 1, True))
        if self.to_rank_0 is None:
            sock = connect(self.command.master_addr, self.command.port)
            if sock is None:
                if not self.waiting_said:
                    self.waiting_said = True
                    self.say(f"rank {self.command.rank} of {self.command.world_size}: waiting "
                             f"for rank 0 at {self.command.master_addr}:{self.command.port}")
                time.sleep(min(0.2, max(0.0, self.join_deadline - now)))
                return
            self.to_rank_0 = Link(sock, rank=0)
            self.selector.register(self.to_rank_0, selectors.EVENT_READ, self.on_message)
            self.to_rank_0.send("hello", rank=command.rank, world_size=command.world_size,
                                program=command.program, flags=command.flags,
                                master_port=command.master_port, host=socket.gethostname(),
                                pid=os.getpid())

    def on_newcomer(self, listener):
        """Rank 0: a supervisor connects; it says hello next."""
        with contextlib.suppress(BlockingIOError):
            sock, _ = listener.accept()
            link = Link(sock)
            self.newcomers.append(link)
            self.selector.register(link, selectors.EVENT_READ, self.on_message)

    def on_message(self, link):
        messages = link.receive()
        if messages is None:
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(link)
            self.on_lost(link, "its rpcrun's connection closed")
            return
        for message in messages:
            handler = getattr(self, f"on_{message['kind']}", None)
            if handler is not None and message["kind"] in MESSAGES:
                handler(link, message)

    def on_hello(self, link, message):
        """Rank 0: admit a rank, or refuse it in one line."""
        if self.command.rank != 0 or link.rank is not None:
            return
        self.newcomers = [other for other in self.newcomers if other is not link]
        why = self.refusal(message)
        if why:
            self.say(f"refused a rank: {why}")
            link.send("refused", line=why)
            link.close()
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(link)
            return
        link.rank = message["rank"]
        self.links[link.rank] = link
        self.admitted.add(link.rank)
        everyone = len(self.admitted) == self.command.world_size - 1
        link.send("welcome", missing="" if everyone else self.missing_text())
        if len(self.links) == self.command.world_size - 1 and not self.joined:
            self.joined = True
            for other in self.all_links():
                other.send("joined")
            self.say(f"all {self.command.world_size} ranks have joined")
        elif self.endings:  # the run is ending already: tell the newcomer why
            verdict = next((e for e in self.endings if e.cause),
                           min(self.endings, key=self.failure_order))
            link.send("verdict", **verdict.message())

    def refusal(self, hello):
        """Rank 0: why a rank's hello cannot be admitted, or None."""
        command = self.command
        rank = hello.get("rank")
        if hello.get("program") != command.program:
            return (f"rank 0 runs {command.program}, but rank {rank} runs "
                    f"{hello.get('program')}: start every rank with the same program")
        if hello.get("world_size") != command.world_size:
            return (f"rank 0 has a world of {command.world_size}, but rank {rank} one of "
                    f"{hello.get('world_size')}: start every rank with the same --world_size")
        if hello.get("master_port") != command.master_port:
            return (f"rank 0 has --master_port {command.master_port}, but rank {rank} "
                    f"{hello.get('master_port')}: start every rank with the same --master_port")
        if not isinstance(rank, int) or not 0 < rank < command.world_size:
            return f"rank {rank} is outside a world of {command.world_size}"
        if rank in self.admitted or self.joined:
            return f"rank {rank} is taken: another command of this run has it already"
        ours = json.loads(json.dumps(command.flags))
        different = differences(ours, hello.get("flags") or {}, 0, rank)
        if different:
            return f"{different}: start every rank with the same flags"
        return None

    def on_welcome(self, link, message):
        if self.phase is not Phase.ADMISSION:
            return
        missing = message.get("missing")
        if missing:
            self.say(f"rank {self.command.rank} of {self.command.world_size} joined; waiting "
                     f"for {missing}")
        self.start_child()

    def on_refused(self, link, message):
        self.end(Ending(self.command.rank, message.get("line"), "", 2, False))

    def on_joined(self, link, message):
        self.joined = True
        self.say(f"all {self.command.world_size} ranks have joined")

    def on_beat(self, link, message):
        pass

    def on_done(self, link, message):
        if self.command.rank == 0 and link.rank is not None:
            self.done.add(link.rank)
            self.check_all_done()

    def on_ending(self, link, message):
        if self.command.rank == 0 and link.rank is not None:
            self.consider(ending_from(message))

    def on_traceback(self, link, message):
        if self.command.rank == 0 and link.rank is not None:
            self.tracebacks.setdefault(link.rank, float(message.get("at") or 0.0))

    def on_verdict(self, link, message):
        if self.command.rank != 0:
            self.end_by(ending_from(message))

    def missing_text(self):
        """The ranks that rank 0 has not admitted yet, as text ("rank 2", "ranks 1, 3")."""
        missing = [str(rank) for rank in range(1, self.command.world_size)
                   if rank not in self.admitted]
        return ("ranks " if len(missing) > 1 else "rank ") + ", ".join(missing)

    # --------- The end --------------------

    def release_all(self):
        while self.held:
            held = self.held.pop(0)
            self.show(held.line, held.stream)

    def leave_out_the_last_traceback(self, before=None):
        """Leave out the held lines of standard error from the last traceback's first on (the
        last before the held line `before`, where given)."""
        end = len(self.held)
        if before is not None:
            end = next(number for number, held in enumerate(self.held) if held.text == before)
        starts = [number for number, held in enumerate(self.held[:end])
                  if held.stream is sys.stderr and held.text.startswith(TRACEBACK)]
        if starts:
            self.held = self.held[:starts[-1]] + [
                held for held in self.held[starts[-1]:] if held.stream is sys.stdout]

    def leave_out_what_followed(self):
        """A rank of one command was killed or exited without a traceback: leave out the held
        lines of standard error (the other ranks' errors at losing it, tracebacks that torch's
        RPC carried, mp.spawn's own), but for mp.spawn's word that it ends the other ranks."""
        self.held = [held for held in self.held if held.stream is sys.stdout
                     or SPAWN_TERMINATING.search(held.text)]

    def end(self, ending):
        """The one way a run ends but for success: the command and every process of it ended,
        the held lines shown where they are this rank's own, the line last, the status."""
        if self.child is not None:
            for fd in (self.child.out, self.child.err):  # nothing more of it is shown
                with contextlib.suppress(KeyError, ValueError):
                    self.selector.unregister(fd)
            self.child.stop(GRACE_SECONDS)  # a no-op where nothing of it is left
        if ending.status != PIPE_CLOSED:
            self.release_all()
        for link in self.all_links():
            link.close()
        if ending.line:
            self.say(ending.line)
        self.exit(ending.status)

    def say(self, text):
        """A line of rpcrun's own, on its standard error."""
        with contextlib.suppress(OSError):
            sys.stderr.write(f"rpcrun: {text}\n")
            sys.stderr.flush()

    def exit(self, status):
        with contextlib.suppress(OSError):
            sys.stdout.flush()
        os._exit(status)


# The kinds of message that on_message hands to a handler.
MESSAGES = {"hello", "welcome", "refused", "joined", "beat", "done", "ending", "traceback",
            "verdict"}


def ending_from(message):
    began = message.get("traceback_at")
    return Ending(message.get("rank"), message.get("line"), str(message.get("others", "")),
                  int(message.get("status", 1)), bool(message.get("cause")),
                  float(began) if began is not None else None)


def output_closed():
    """Whether this process's standard output is a pipe that nobody reads any more, though
    nothing was written since (`| head` that had its lines): poll() says so (POLLERR)."""
    try:
        if not stat.S_ISFIFO(os.fstat(1).st_mode):
            return False
    except OSError:
        return False
    poller = select.poll()
    poller.register(1, 0)  # no event asked for: POLLERR and POLLHUP come anyway
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def signal_of(status):
    """The name of the signal that a status of 128 + N says killed a process, or None."""
    if 128 < status < 128 + 65:
        with contextlib.suppress(ValueError):
            return signal.Signals(status - 128).name
    return None


def last_error(lines):
    """The exception and message that end the last traceback in lines, or None. Where torch's
    RPC carried it from another worker's code, which worker raised it, after the message."""
    start = None
    for number, line in enumerate(lines):
        if line.startswith(TRACEBACK):
            start = number
    if start is None:
        return None
    tail = [line for line in lines[start:]
            if line.strip() and not line.startswith(" ") and line.strip() != REMOTE_FRAMES]
    if len(tail) < 2:
        return None
    error = tail[-1].strip()
    # the callee's traceback follows its worker's name and the exception's repr
    for line in lines[max(0, start - 3):start]:
        remote = REMOTE_WORKER.search(line)
        if remote:
            return f"{error}, raised on {remote.group(1)} in an RPC"
    return error


def main(argv=None):
    """rpcrun SCRIPT ARGS...: bad input of rpcrun's own ends here (one line, status 2)."""
    command = parse(argv)
    supervisor = Supervisor(command)
    supervisor.start()
    supervisor.run()
