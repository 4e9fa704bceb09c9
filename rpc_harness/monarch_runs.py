"""What the Monarch programs share (param_server/actors.py, rl_cartpole/actors.py): their
command line, the import of Monarch, where their processes run, and how a run ends in one line
when an actor's process fails, on Ctrl-C and on SIGTERM. The rest they share with the RPC
programs: the parser and its types, the threads (share_of_the_cores), the summary and the
profiler (Recorder, write_timeline).

Imported by the Monarch programs only (`from rpc_harness import monarch_runs`); importing it
changes nothing in the process: each change comes with the call that makes it
(docs/harness.md lists them)."""

import asyncio
import contextlib
import os
import re
import signal
import sys
import traceback
from pathlib import Path

from . import ending
from .cli import (
    ArgumentParser,
    add_shared_arguments,
    address_towards,
    check_file,
    check_folder,
    int_at_least,
    omp_num_threads,
    positive_float,
    share_of_the_cores,
    unit_interval,
)
from .ending import whole_lines
from .profiling import WARMUP_STEPS, Recorder, write_timeline
from .summary import NotWritten, peak_memory_mb, write_summary

__all__ = ["ArgumentParser", "int_at_least", "positive_float", "unit_interval",
           "share_of_the_cores", "Recorder", "write_timeline", "peak_memory_mb",
           "write_summary", "whole_lines", "import_monarch", "monarch_missing", "get", "answer",
           "add_arguments", "check_args", "spawn_procs", "one_line_on_failure", "describe",
           "stop_the_processes_started_here", "WORKER", "WARMUP_STEPS"]

# How often Monarch's controller asks whether the processes it started are alive. Monarch's
# default, 10 s, leaves a run that lost a process waiting that long; 500 ms ends it within 2 s.
SUPERVISION_POLL = "500ms"

# How long the processes on other hosts (--workers) outlive a controller that went away. At
# Monarch's default, a SIGKILLed controller's processes trained on for more than 160 s; at 5 s
# they were gone within 10.
ORPHAN_TIMEOUT = "5s"

# A Monarch worker's address, as --workers and monarch_worker take it.
WORKER = re.compile(r"tcp://([^:/*]+):(\d+)")


def import_monarch():
    """Monarch's package, or, where it is not installed, one line saying why and what to do
    (status 2, before anything starts). Sets how often Monarch's controller checks on the
    processes it started (SUPERVISION_POLL), and how long processes on other hosts outlive it
    (ORPHAN_TIMEOUT), unless the environment says otherwise."""
    # Set before Monarch loads its configuration.
    os.environ.setdefault("HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY", SUPERVISION_POLL)
    os.environ.setdefault("HYPERACTOR_MESH_ORPHAN_TIMEOUT", ORPHAN_TIMEOUT)
    try:
        import monarch.actor
    except ModuleNotFoundError as err:
        if err.name is None or not err.name.startswith("monarch"):
            raise
        print(f"{Path(sys.argv[0]).name}: error: {monarch_missing()}", file=sys.stderr)
        sys.exit(2)
    return monarch


def monarch_missing():
    """Why Monarch is not here, and what to do: its package, torchmonarch, has wheels for Linux
    and Python 3.10 to 3.13 only (requirements.txt installs it there)."""
    python = "{}.{}".format(*sys.version_info[:2])
    if not sys.platform.startswith("linux"):
        return (f"Monarch (torchmonarch) runs on Linux only, not {sys.platform}; the RPC "
                "programs beside this one run here")
    if not (3, 10) <= sys.version_info[:2] <= (3, 13):
        return (f"Monarch (torchmonarch) has no release for Python {python} (its wheels are "
                "for 3.10 to 3.13): run this program with one of those; the RPC programs "
                "beside it run here")
    return ("Monarch is missing: `pip install torchmonarch`, or `make run` in the repository's "
            "folder")


def get(future, timeout, what, flag="--call_timeout"):
    """future.get(timeout), or TimeoutError saying whose answer did not come and which flag
    set the bound: every wait of the Monarch programs is bounded by --call_timeout, or by
    --init_timeout while processes start or stop."""
    try:
        return future.get(timeout=timeout)
    except TimeoutError:
        raise TimeoutError(f"no answer from {what} within {timeout:g} s ({flag})") from None


async def answer(future, timeout, what, flag="--call_timeout"):
    """The answer of `future`, awaited in an actor's endpoint (`async def`), bounded as get()."""
    try:
        return await asyncio.wait_for(future, timeout)
    except asyncio.TimeoutError:  # TimeoutError from Python 3.11, its own class in 3.10
        raise TimeoutError(f"no answer from {what} within {timeout:g} s ({flag})") from None


# --------- The command line --------------------

def add_arguments(parser):
    """The flags of every program that apply to a Monarch program, the bound on every wait,
    and where the processes run."""
    add_shared_arguments(parser, "longest wait for the actors' processes to start, or to stop")
    parser.add_argument("--call_timeout", "--call-timeout", type=positive_float, default=60.0,
                        metavar="SECONDS", help="longest wait for any one answer of an actor")
    parser.add_argument("--workers", default=None, metavar="tcp://HOST:PORT[,...]",
                        help="run the actors' processes on these Monarch workers (other hosts, "
                             "each started with `python -m rpc_harness.monarch_worker "
                             "tcp://HOST:PORT`), shared equally, instead of on this host")


def check_args(parser, args, count, what):
    """What argparse cannot check: OMP_NUM_THREADS, if set; --profile's folder, made if missing;
    --summary_json's folder, which must take the file; --workers, each tcp://HOST:PORT, sharing
    `count` processes (of `what`) equally. Bad input: one line, status 2. With --profile,
    KINETO_LOG_LEVEL=6 unless set, in this process's environment, which Monarch's processes
    inherit: the profiler's library logs each start and stop."""
    omp_num_threads(parser)
    if args.profile:
        check_folder(parser, "--profile", args.profile)
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    if args.summary_json:
        check_file(parser, "--summary_json", args.summary_json)
    if not args.workers:
        return
    workers = args.workers.split(",")
    for worker in workers:
        if not WORKER.fullmatch(worker):
            parser.error(f"--workers: {worker}: expected tcp://HOST:PORT")
    if count % len(workers):
        parser.error(f"--workers: {count} {what} cannot be shared equally by "
                     f"{len(workers)} workers")


def spawn_procs(args, count, bootstrap):
    """`count` processes for the actors, each starting with `bootstrap`: on this host
    (`this_host()`), or shared equally by the hosts of --workers, which the controller attaches
    to (Monarch's `attach_to_workers`), within --init_timeout. Then this command talks to them
    over TCP from its address on the way to the first worker."""
    from monarch.actor import attach_to_workers, enable_transport, this_host

    if not args.workers:
        return this_host().spawn_procs(per_host={"procs": count}, bootstrap=bootstrap)
    workers = args.workers.split(",")
    host, port = WORKER.fullmatch(workers[0]).groups()
    # Monarch's "tcp" takes the address of this host's name, and panics where that is a
    # loopback one (a container's): the address that reaches the first worker, given.
    enable_transport(f"tcp://{address_towards(host, int(port))}:0")
    hosts = attach_to_workers(workers=workers, ca="trust_all_connections")
    get(hosts.initialized, args.init_timeout, f"the workers ({args.workers})",
        "--init_timeout")
    return hosts.spawn_procs(per_host={"procs": count // len(workers)}, bootstrap=bootstrap)


# --------- Failures and Ctrl-C --------------------

def describe(failure, role):
    """One line from Monarch's MeshFailure, whose text is all it offers: which process (its rank
    in the mesh of `role` processes, from 1, as the RPC programs number their ranks) and why
    (killed by a signal, an exit status, or the last line of the error)."""
    text = repr(failure)
    ranks = re.search(r"crashed_ranks=\[(\d+)", text)
    who = f"{role}{int(ranks.group(1)) + 1}" if ranks else f"a process of the {role}s"
    killed = re.search(r"Killed\(sig=(\d+)\)", text)
    exited = re.search(r"exited with non-zero code (-?\d+)", text)
    if killed:
        return f"{who} was killed by {ending.signal_name(int(killed.group(1)))}"
    if exited:
        return f"{who} exited with status {exited.group(1)}"
    return f"{who} failed: {failure.report().strip().splitlines()[-1].strip()}"


@contextlib.contextmanager
def one_line_on_failure(role):
    """Run the program's body so that it ends the command in one line, its terminal's last,
    every process it started stopped first:

    - an actor's process killed or failed (Monarch's supervision reports it through
      monarch.actor.unhandled_fault_hook, Monarch's hook for it): "trainer2 was killed by
      SIGKILL; stopped every process", status 1 (`role` names the processes, numbered from 1);
    - no answer within --call_timeout (a hung process): one line, status 1;
    - an error raised in an endpoint: the actor's traceback, then one line, status 1;
    - Ctrl-C: "interrupted; stopped every process", 130; SIGTERM, 143;
    - its output a pipe that nobody reads any more (`| head`): nothing more, status 141;
    - --summary_json not written at the end: one line, status 1, after the Summary line;
    - done: the body has printed the run's last line; status 0, without Python's exit, at which
      Monarch's threads aborted the process ("FATAL: exception not rethrown", 1 run in 2)."""
    import monarch.actor

    def on_fault(failure):
        # Runs on a Monarch thread; it must not raise (Monarch would print its own report).
        end_quietly_if_the_output_is_closed()
        try:
            line = describe(failure, role)
        except Exception as err:  # noqa: BLE001 - the line, whatever the failure's text
            line = f"a process failed ({err})"
        end(f"{line}; stopped every process", 1)

    def on_signal(number):
        suffix = "" if number == signal.SIGINT else " (SIGTERM)"
        end(f"interrupted{suffix}; stopped every process", 128 + number)

    monarch.actor.unhandled_fault_hook = on_fault
    ending.on_signals(on_signal)
    try:
        yield
    except NotWritten as err:  # the Summary line is printed: the file alone is lost
        end(str(err), 1)
    except TimeoutError as err:
        end(f"{err}; stopped every process", 1)
    except monarch.actor.ActorError as err:  # raised in an endpoint, which goes on serving
        end_quietly_if_the_output_is_closed()
        # An endpoint that awaited another actor's endpoint passes its error on, wrapped:
        # the innermost is the one that says what went wrong.
        while isinstance(err.exception, monarch.actor.ActorError):
            err = err.exception
        if isinstance(err.exception, TimeoutError):  # says whose answer did not come
            end(f"{err.exception}; stopped every process", 1)
        ending.wait_for_a_cause(2)  # a killed process: on_fault names it
        what = traceback.format_exception_only(type(err.exception), err.exception)[-1].strip()
        end(f"{err.message.rstrip('.')} ({what}); stopped every process", 1,
            before=err.exception_formatted)
    except Exception:  # noqa: BLE001 - any other error: its traceback, then the end
        end_quietly_if_the_output_is_closed()
        # A call to an actor whose process failed raises here (Monarch's SupervisionError) as
        # the same failure reaches on_fault, which names the process. Otherwise the error is
        # not one of those expected: printed whole.
        ending.wait_for_a_cause(2)
        end(None, 1, before=traceback.format_exc())
    end(None, 0)


def end_quietly_if_the_output_is_closed():
    """Where this command's output is a pipe that nobody reads any more (`| head` has its
    lines), whatever failed, failed of that: end quietly, with the status a shell expects."""
    if ending.output_closed():
        end(None, ending.PIPE_CLOSED)


def end(line, status, before=None):
    """End the command: stop every process it started, then print `before` (an actor's
    traceback) and `line` (ending.end)."""
    ending.claim()
    stop_the_processes_started_here()
    if before:
        ending.say(ending.quiet(), before.rstrip())
    ending.end(line, status)


def stop_the_processes_started_here():
    """SIGKILL every process this one started, and theirs, until none is left (a process may
    start another meanwhile; three rounds at most): none prints after the run's last line
    (Monarch's would die with this one a moment later)."""
    for _ in range(3):
        ours = _descendants()
        if not ours:
            return
        for pid in ours:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _descendants():
    """The processes that this one started, and theirs, from /proc."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                if stat[stat.rindex(")") + 2] != "Z":  # a zombie is gone already
                    parents[int(entry)] = int(stat[stat.rindex(")") + 2:].split()[1])
    ours = {os.getpid()}
    grew = True
    while grew:
        found = {pid for pid, parent in parents.items() if parent in ours} - ours
        grew = bool(found)
        ours |= found
    return ours - {os.getpid()}
