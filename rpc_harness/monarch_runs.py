"""What the Monarch programs share (param_server/actors.py, rl_cartpole/actors.py): their
command line, the import of Monarch, how a run ends in one line when an actor's process fails
or on Ctrl-C, the threads of each process, and the summary.

Imported by the Monarch programs only (`from rpc_harness import monarch_runs`); importing it
changes nothing in the process: each change comes with the call that makes it (the README's
table lists them)."""

import asyncio
import contextlib
import json
import os
import re
import resource
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

from . import profiling
from .cli import (
    CORES,
    ArgumentParser,
    check_folder,
    int_at_least,
    omp_num_threads,
    positive_float,
    signal_name,
    unit_interval,
)
from .compat import profiler_options
from .rank import whole_lines

__all__ = ["ArgumentParser", "int_at_least", "positive_float", "unit_interval",
           "import_monarch", "get", "answer", "add_arguments", "check_args", "spawn_procs",
           "check_workers", "threads_each", "peak_memory_mb", "write_summary", "Recorder",
           "write_timeline", "one_line_on_failure", "whole_lines"]

# The summary's seconds count from here, as the program imports this module (after torch).
STARTED = time.time()

# How often Monarch's controller asks whether the processes it started are alive. Monarch's
# default, 10 s, leaves a run that lost a process waiting that long; 500 ms ends it within 2 s.
SUPERVISION_POLL = "500ms"

# How long the processes on other hosts (--workers) outlive a controller that went away. At
# Monarch's default, a SIGKILLed controller's processes trained on for more than 160 s; at 5 s
# they were gone within 10.
ORPHAN_TIMEOUT = "5s"


def import_monarch():
    """Monarch's package, or, where it is not installed, one line saying how to install it
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


def get(future, timeout, what):
    """future.get(timeout), or TimeoutError saying whose answer did not come: every wait of
    the Monarch programs is bounded by --call_timeout."""
    try:
        return future.get(timeout=timeout)
    except TimeoutError:
        raise TimeoutError(f"no answer from {what} within {timeout:g} s "
                           "(--call_timeout)") from None


async def answer(future, timeout, what):
    """The answer of `future`, awaited in an actor's endpoint (`async def`), or TimeoutError
    saying whose answer did not come: get()'s bound, for the actors' own waits."""
    try:
        return await asyncio.wait_for(future, timeout)
    except asyncio.TimeoutError:  # TimeoutError from Python 3.11, its own class in 3.10
        raise TimeoutError(f"no answer from {what} within {timeout:g} s "
                           "(--call_timeout)") from None


def add_arguments(parser):
    """The flags of every example that apply to a Monarch program (--seed, --summary_json),
    and the bound on every wait."""
    parser.add_argument("--seed", type=int_at_least(0), default=1, metavar="N",
                        help="seed of the model's initial weights, the data and the episodes")
    parser.add_argument("--summary_json", "--summary-json", default=None, metavar="PATH",
                        help="write the run's figures to this JSON file at the end")
    parser.add_argument("--init_timeout", "--init-timeout", type=positive_float, default=60.0,
                        metavar="SECONDS",
                        help="longest wait for the actors' processes to start, or to stop")
    parser.add_argument("--call_timeout", "--call-timeout", type=positive_float, default=60.0,
                        metavar="SECONDS",
                        help="longest wait for any one answer of an actor")
    parser.add_argument("--workers", default=None, metavar="tcp://HOST:PORT[,...]",
                        help="run the actors' processes on these Monarch workers (other hosts, "
                             "each started with `python -m rpc_harness.monarch_worker "
                             "tcp://HOST:PORT`), shared equally, instead of on this host")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="profile every process into DIR/<its name>.json, merged into "
                             "DIR/timeline.json (https://ui.perfetto.dev): --profile_steps "
                             "steps after two warm-up steps")
    parser.add_argument("--profile_steps", "--profile-steps", type=int_at_least(1), default=3,
                        metavar="N", help="how many steps --profile records")


def check_args(parser, args):
    """What argparse cannot check: OMP_NUM_THREADS, if set; --profile's folder, made if
    missing (one line, status 2, if it cannot be). With --profile, KINETO_LOG_LEVEL=6 unless
    set, in this process's environment, which Monarch's processes inherit: the profiler's
    library logs each start and stop."""
    omp_num_threads(parser)
    if args.profile:
        check_folder(parser, "--profile", args.profile)
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")


def spawn_procs(args, count, bootstrap):
    """`count` processes for the actors, each starting with `bootstrap`: on this host
    (`this_host()`), or shared equally by the hosts of --workers, which the controller attaches
    to (Monarch's `attach_to_workers`), within --init_timeout. Then this command talks to them
    over TCP from its address on the way to the first worker."""
    from monarch.actor import attach_to_workers, enable_transport, this_host

    if not args.workers:
        return this_host().spawn_procs(per_host={"procs": count}, bootstrap=bootstrap)
    workers = args.workers.split(",")
    # Monarch's "tcp" takes the address of this host's name, and panics where that is a
    # loopback one (a container's): the address that reaches the first worker, given.
    enable_transport(f"tcp://{_address_towards(workers[0])}:0")
    hosts = attach_to_workers(workers=workers, ca="trust_all_connections")
    get(hosts.initialized, args.init_timeout, f"the workers ({args.workers})")
    return hosts.spawn_procs(per_host={"procs": count // len(workers)}, bootstrap=bootstrap)


def _address_towards(worker):
    """This host's address on the route to `worker` (tcp://HOST:PORT): what it sees us as."""
    import socket

    host, port = worker.removeprefix("tcp://").rsplit(":", 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, int(port)))  # UDP: picks the route, sends nothing
        return probe.getsockname()[0]


def check_workers(parser, args, count, what):
    """--workers: each tcp://HOST:PORT, and `count` processes (of `what`) shared equally."""
    if not args.workers:
        return
    workers = args.workers.split(",")
    for worker in workers:
        if not re.fullmatch(r"tcp://[^:/*]+:\d+", worker):
            parser.error(f"--workers: {worker}: expected tcp://HOST:PORT")
    if count % len(workers):
        parser.error(f"--workers: {count} {what} cannot be shared equally by "
                     f"{len(workers)} workers")


def threads_each(computing):
    """Intra-op threads for each of `computing` processes that share this machine's cores:
    OMP_NUM_THREADS if set, else their share (at least one)."""
    fixed = os.environ.get("OMP_NUM_THREADS")
    if fixed:
        return int(fixed.split(",")[0])  # a list: one number a level (check_args checked it)
    return max(1, CORES // computing)


def peak_memory_mb():
    """This process's most resident memory so far, in MB (ru_maxrss: kB on Linux), as the RPC
    programs report theirs: {"rss": MB}."""
    return {"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}


def write_summary(args, summary, line, memory):
    """Print the summary line and write --summary_json, as the RPC programs do: the run's
    figures, each process's peak memory (MB) and the wall seconds since the start."""
    summary["peak_memory_mb"] = memory
    summary["wall_seconds"] = round(time.time() - STARTED, 3)
    print(f"Summary: {line}; {summary['wall_seconds']:.1f} s in all")
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps(summary, indent=2) + "\n")


# --------- --profile --------------------

# Steps left out before --profile's window, as in the RPC programs.
WARMUP_STEPS = profiling.WARMUP_STEPS

class Recorder:
    """--profile in one process of a Monarch program: start() records it (every thread, where
    this torch can: compat.py), stop() writes DIR/<name>.json, with the rank and name that
    rpc_harness.profiling's merge reads. Without --profile both do nothing. A step count says
    when: step(i) starts at the step after the warm-up and stops --profile_steps later."""

    def __init__(self, args, rank, name):
        self.folder = args.profile
        self.steps = args.profile_steps
        self.rank = rank
        self.name = name
        self.prof = None  # None: not started; False: written

    def step(self, i):
        """Called with the number of the step about to run, from 0."""
        if i == WARMUP_STEPS:
            self.start()
        elif i == WARMUP_STEPS + self.steps:
            self.stop()

    def start(self):
        if not self.folder or self.prof is not None:
            return
        self.prof = torch.profiler.profile(**profiler_options()[0])
        self.prof.preset_metadata_json("rank", json.dumps(self.rank))
        self.prof.preset_metadata_json("rankName", json.dumps(self.name))
        self.prof.start()

    def stop(self):
        if not self.prof:
            return
        self.prof.stop()
        path = Path(self.folder) / f"{self.name}.json"
        self.prof.export_chrome_trace(str(path))
        self.prof = False
        print(f"{self.name}: profiled, wrote {path} ({path.stat().st_size // 1024} kB)",
              flush=True)


def write_timeline(args, names):
    """The controller, at the end: DIR/timeline.json from the traces of `names` (in that order,
    a track each) that --profile wrote."""
    if not args.profile:
        return
    traces = {}
    for name in names:
        path = Path(args.profile) / f"{name}.json"
        if path.exists():
            traces[name] = json.loads(path.read_text())
    print(profiling.write_timeline(args.profile, traces))


# --------- Failures and Ctrl-C --------------------


def _describe(failure, role):
    """One line from a MeshFailure, whose text is all it offers: which process (its rank in the
    mesh of `role` processes, from 1, as the RPC programs number their ranks) and why (killed
    by a signal, an exit status, or the last line of the error). Every mesh on those processes
    reports their failure (Monarch's own, for their logs and set-up, too), by the same rank."""
    text = repr(failure)
    ranks = re.search(r"crashed_ranks=\[(\d+)", text)
    who = f"{role}{int(ranks.group(1)) + 1}" if ranks else f"a process of the {role}s"
    killed = re.search(r"Killed\(sig=(\d+)\)", text)
    exited = re.search(r"exited with non-zero code (-?\d+)", text)
    if killed:
        return f"{who} was killed by {signal_name(int(killed.group(1)))}"
    if exited:
        return f"{who} exited with status {exited.group(1)}"
    return f"{who} failed: {failure.report().strip().splitlines()[-1].strip()}"


@contextlib.contextmanager
def one_line_on_failure(role):
    """Run the program's body so that an expected failure ends the command in one line, its
    terminal's last:

    - an actor's process killed or failed (Monarch's supervision reports it to the controller,
      through monarch.actor.unhandled_fault_hook, Monarch's hook for it): "trainer2 was killed
      by SIGKILL; stopped every process", status 1. `role` names what the processes that the
      controller started are ("trainer"); they are numbered from 1, as the RPC programs'
      ranks.
    - no answer within --call_timeout (a hung process, stopped with SIGSTOP say): one line,
      status 1.
    - an error raised in an endpoint: the actor's traceback, then one line naming the
      endpoint and the error, status 1.
    - Ctrl-C: "interrupted; stopped every process", status 130; SIGTERM, 143.
    - done: the body has printed the run's last line; the processes left are stopped and the
      command ends, status 0, without Python's exit (os._exit), at which Monarch's threads
      could abort it.

    The command stops every process it started before its line (and Monarch ends them when the
    command ends, however it ends: they die with their parent, PR_SET_PDEATHSIG)."""
    import monarch.actor

    def on_fault(failure):
        # Runs on a Monarch thread; it must not raise (Monarch would print its own report).
        try:
            line = _describe(failure, role)
        except Exception as err:  # noqa: BLE001 - the line, whatever the failure's text
            line = f"a process failed ({err})"
        _end(f"{line}; stopped every process", 1)

    monarch.actor.unhandled_fault_hook = on_fault
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    except KeyboardInterrupt:
        _end("interrupted; stopped every process", 130)
    except TimeoutError as err:
        _end(f"{err}; stopped every process", 1)
    except monarch.actor.ActorError as err:  # raised in an endpoint, which goes on serving
        if isinstance(err.exception, TimeoutError):
            _end(f"{err.message} {err.exception}; stopped every process", 1)
        _wait_for_a_failed_process()
        what = traceback.format_exception_only(type(err.exception), err.exception)[-1].strip()
        _end(f"{err.message.rstrip('.')} ({what}); stopped every process", 1,
             before=err.exception_formatted)
    except Exception:
        # A call to an actor whose process failed raises here (Monarch's SupervisionError) as
        # the same failure reaches on_fault, which names the process. Otherwise the error is
        # not one of those expected: printed whole.
        _wait_for_a_failed_process()
        raise
    else:
        # The run is done and has printed its last line: it ends here, as the RPC ranks do
        # (os._exit). At Python's own exit, finalization ends each thread that then asks for
        # the interpreter with pthread_exit; a Monarch thread in native code that catches every
        # exception then stopped the process with "FATAL: exception not rethrown" and SIGABRT
        # (status -6, after the summary, in 1 of 2 runs of `make test`).
        _end(None, 0)


def _on_sigterm(number, frame):
    _end("interrupted (SIGTERM); stopped every process", 128 + number)


def _wait_for_a_failed_process():
    """If on_fault is ending the command (its line names the process), wait for it: 2 s for
    Monarch's supervision to report the failure, then for ever."""
    if _ending_now.wait(timeout=2):
        threading.Event().wait()


# Held by the first thread to end the run, which says why; another cause found meanwhile waits,
# and is never printed. _ending_now: set once that thread holds it.
_ending = threading.Lock()
_ending_now = threading.Event()


def _end(line, status, before=None):
    """End the run now: stop every process this command started, then print `before` (an
    actor's traceback) and the run's last line (None: the run has printed it), and end this
    process with `status`. Whichever
    thread comes first; a second waits for the end."""
    if not _ending.acquire(blocking=False):
        threading.Event().wait()
    _ending_now.set()
    terminal = os.dup(2)
    with contextlib.suppress(ValueError, OSError):
        sys.stdout.flush()  # what the program printed so far, which os._exit would drop
        sys.stderr.flush()
    _stop_the_processes_started_here()
    nowhere = os.open(os.devnull, os.O_WRONLY)  # this process's own threads: quiet from now on
    os.dup2(nowhere, 1)
    os.dup2(nowhere, 2)
    text = (before.rstrip() + "\n" if before else "") + (line + "\n" if line else "")
    if text:
        os.write(terminal, text.encode())
    os._exit(status)


def _stop_the_processes_started_here():
    """SIGKILL every process this one started, and theirs: none prints after the run's last
    line (they would die with this one a moment later)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                parents[int(entry)] = int(stat[stat.rindex(")") + 2:].split()[1])
    ours = {os.getpid()}
    grew = True
    while grew:
        found = {pid for pid, parent in parents.items() if parent in ours} - ours
        grew = bool(found)
        ours |= found
    for pid in ours - {os.getpid()}:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
