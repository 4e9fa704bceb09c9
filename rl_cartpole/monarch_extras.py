"""What actors.py adds to Monarch's own API, in plain code: Monarch imported (or one line that
says why not), the flags of a Monarch run (--call_timeout, --workers, --serve), every wait for
another process bounded, the processes on other hosts, --profile's few lines, and the end of
the run in one line. actors.py calls it from lines marked "# ours:".

SIGTERM, a closed pipe, whole lines on a terminal and each process's share of the cores are
rpcrun's, from outside (`rpcrun actors.py ...`, docs/rpcrun.md)."""

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import sys
import threading
import traceback
from pathlib import Path

import torch

# A Monarch worker's address, as --workers and --serve take it.
WORKER = re.compile(r"tcp://([^:/*]+):(\d+)")


def import_monarch():
    """Monarch's actor API, or, where torchmonarch is not installed, one line saying why, status
    2. Before Monarch loads, two of its settings, unless the environment has them:

    - how often the controller asks whether its processes are alive: at Monarch's default, 10 s,
      a run that lost a process waited that long; at 500 ms it ends within 2 s;
    - how long processes on other hosts (--workers) outlive a controller that went away: at
      Monarch's default, a killed controller's processes trained on for over 160 s; at 5 s they
      were gone within 10."""
    os.environ.setdefault("HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY", "500ms")
    os.environ.setdefault("HYPERACTOR_MESH_ORPHAN_TIMEOUT", "5s")
    try:
        import monarch.actor
    except ModuleNotFoundError as error:
        if not (error.name or "").startswith("monarch"):
            raise
        print(f"{Path(sys.argv[0]).name}: error: Monarch is missing: `pip install torchmonarch` "
              "(its wheels are for Linux and Python 3.10 to 3.13; main.py and batch.py run "
              "without it)", file=sys.stderr)
        sys.exit(2)
    return monarch.actor


# --------- The flags --------------------

def positive_float(text):
    value = float(text)
    if not value > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be greater than 0, got {text}")
    return value


def add_arguments(parser):
    """The flags of a Monarch run; and on the parser: every default in --help, no abbreviated
    flags, errors in one line (argparse's usage lines left out)."""
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    parser.allow_abbrev = False
    parser.error = lambda message: parser.exit(2, f"{parser.prog}: error: {message}\n")
    parser.add_argument("--call_timeout", "--call-timeout", type=positive_float, default=60.0,
                        metavar="SECONDS",
                        help="longest wait for one answer of the actors in other processes")
    parser.add_argument("--workers", metavar="tcp://HOST:PORT[,...]",
                        help="run the actors' processes on these hosts, shared equally, each "
                             "serving with `python actors.py --serve tcp://HOST:PORT`")
    parser.add_argument("--serve", metavar="tcp://HOST:PORT",
                        help="serve this host to a controller on another one (--workers), at "
                             "this host's address as the controller reaches it")


def check_workers(parser, args, count, what):
    """--serve's address; --workers, each tcp://HOST:PORT, sharing `count` processes (of `what`)
    equally. Bad input: one line, status 2."""
    if args.serve and not WORKER.fullmatch(args.serve):
        parser.error(f"--serve: {args.serve}: expected tcp://HOST:PORT, HOST this host's "
                     "address as the controller reaches it (not *)")
    workers = args.workers.split(",") if args.workers else []
    for worker in workers:
        if not WORKER.fullmatch(worker):
            parser.error(f"--workers: {worker}: expected tcp://HOST:PORT")
    if workers and count % len(workers):
        parser.error(f"--workers: {count} {what} cannot be shared equally by {len(workers)} "
                     "workers")


# --------- Where the processes run --------------------

def import_from_here():
    """This folder on the PYTHONPATH that Monarch's processes inherit: they import actors.py's
    modules (main.py, extras.py, this one) wherever the command started."""
    paths = [str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH")]
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, paths))


def spawn_procs(args, count, bootstrap):
    """`count` processes, each starting with `bootstrap`: on this host, or shared equally by the
    hosts of --workers, which the controller attaches to (Monarch's `attach_to_workers`)."""
    from monarch.actor import attach_to_workers, enable_transport, this_host

    import_from_here()
    if not args.workers:
        return this_host().spawn_procs(per_host={"procs": count}, bootstrap=bootstrap)
    workers = args.workers.split(",")
    host, port = WORKER.fullmatch(workers[0]).groups()
    # Monarch's "tcp" takes the address of this host's name, and panics where that is a
    # loopback one (a container's): the address on the way to the first worker, given.
    family, _, _, _, sockaddr = socket.getaddrinfo(host, int(port), type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(sockaddr)  # chooses the route; sends nothing
        enable_transport(f"tcp://{probe.getsockname()[0]}:0")
    hosts = attach_to_workers(workers=workers, ca="trust_all_connections")
    get(hosts.initialized, args.call_timeout, f"the workers ({args.workers})")
    return hosts.spawn_procs(per_host={"procs": count // len(workers)}, bootstrap=bootstrap)


def serve(address):
    """--serve: this host's share of the processes, for a controller on another host. Monarch's
    own loop: it waits for a controller, starts the processes it asks for, and when that
    controller is gone stops them and waits for the next. They print in this terminal."""
    from monarch.actor import run_worker_loop_forever

    import_from_here()
    print(f"serving at {address}; Ctrl-C ends it", flush=True)
    try:
        run_worker_loop_forever(address=address, ca="trust_all_connections")
    except KeyboardInterrupt:
        end("interrupted (Ctrl-C); stopped every process", 130)


def whole_lines():
    """Each line written in one piece, also under python -u (PYTHONUNBUFFERED), where
    print(f"...") writes the text and the newline apart: two processes' lines never run into
    one. For every process: this one, and Monarch's (spawn_procs' bootstrap)."""
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=False)


# --------- Bounded waits --------------------

def timed_out(what, timeout):
    return TimeoutError(f"no answer from {what} within {timeout:g} s (--call_timeout)")


def get(future, timeout, what):
    """future.get(), within `timeout` (--call_timeout), or TimeoutError saying whose answer did
    not come."""
    try:
        return future.get(timeout=timeout)
    except TimeoutError:
        raise timed_out(what, timeout) from None


async def answer(future, timeout, what):
    """The same, awaited in an endpoint (`async def`)."""
    try:
        return await asyncio.wait_for(future, timeout)
    except asyncio.TimeoutError:  # TimeoutError from Python 3.11, its own class in 3.10
        raise timed_out(what, timeout) from None


# --------- --profile DIR --------------------

class NoProfile:
    def step(self):
        pass

    def stop(self):
        pass


def profiler(folder, name, rank, loops):
    """--profile DIR: a started torch.profiler of this actor, which writes DIR/<name>.json. An
    actor that loops calls step() once a step and records steps 3 to 5; one that serves records
    until stop(). Every thread where this torch can."""
    if not folder:
        return NoProfile()

    def write(prof):  # whole or not at all
        path, part = Path(folder) / f"{name}.json", Path(folder) / f".{name}.json"
        prof.export_chrome_trace(str(part))
        os.replace(part, path)
        print(f"{name}: profiled, wrote {path} ({path.stat().st_size // 1024} kB)", flush=True)

    try:
        options = {"experimental_config": torch._C._profiler._ExperimentalConfig(
            profile_all_threads=True)}
    except TypeError:  # an older torch records only its own thread
        options = {}
    if loops:
        options["schedule"] = torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1)
    prof = torch.profiler.profile(on_trace_ready=write, **options)
    prof.preset_metadata_json("rank", json.dumps(rank))  # rpcrun's timeline: tracks by rank
    prof.start()
    return prof


# --------- The end, in one line --------------------

_ending = threading.Lock()  # held by the thread that ends the process
_fault = threading.Event()  # Monarch reported a process that failed


def describe(failure, role):
    """One line from Monarch's MeshFailure, whose text is all it offers: which process (its
    place in the mesh of `role`s, from 1, as the RPC programs number their ranks) and why."""
    text = repr(failure)
    ranks = re.search(r"crashed_ranks=\[(\d+)", text)
    who = f"{role}{int(ranks.group(1)) + 1}" if ranks else f"a process of the {role}s"
    killed = re.search(r"Killed\(sig=(\d+)\)", text)
    exited = re.search(r"exited with non-zero code (-?\d+)", text)
    if killed:
        return f"{who} was killed by {signal.Signals(int(killed.group(1))).name}"
    if exited:
        return f"{who} exited with status {exited.group(1)}"
    return f"{who} failed: {failure.report().strip().splitlines()[-1].strip()}"


def run(main, role):
    """main(), ended in one line, its terminal's last, with the processes started here stopped
    first: a process of the `role`s killed or failed ("observer1 was killed by SIGKILL"),
    through monarch.actor.unhandled_fault_hook, Monarch's hook for it; no answer within
    --call_timeout; an endpoint's error (its traceback, then one line); a --summary_json that
    cannot be written. Status 1, or 0 when main() returns."""
    import monarch.actor

    def on_fault(failure):  # on a Monarch thread; it must not raise
        _fault.set()
        try:
            line = describe(failure, role)
        except Exception as error:  # noqa: BLE001 - the line, whatever the failure's text
            line = f"a process of the {role}s failed ({error})"
        end(f"{line}; stopped every process", 1)

    monarch.actor.unhandled_fault_hook = on_fault
    try:
        main()
    except TimeoutError as error:
        end(f"{error}; stopped every process", 1)
    except monarch.actor.ActorError as error:
        # An endpoint that awaited another's passes its error on, wrapped: the innermost says
        # what went wrong.
        while isinstance(error.exception, monarch.actor.ActorError):
            error = error.exception
        if isinstance(error.exception, TimeoutError):
            end(f"{error.exception}; stopped every process", 1)
        _fault.wait(2)  # a call to a process that died fails as on_fault names the process
        what = traceback.format_exception_only(type(error.exception), error.exception)[-1]
        end(f"{error.message.rstrip('.')} ({what.strip()}); stopped every process", 1,
            before=error.exception_formatted)
    except KeyboardInterrupt:  # Ctrl-C: without this, a traceback, and 12 s of Monarch's exit
        end("interrupted (Ctrl-C); stopped every process", 130)
    except SystemExit as exit:  # the summary's file not written: its line says why
        end(exit.code if isinstance(exit.code, str) else None,
            exit.code if isinstance(exit.code, int) else 1)
    except Exception:  # noqa: BLE001 - another error: its traceback, then the end
        _fault.wait(2)
        end(None, 1, before=traceback.format_exc())
    end(None, 0)


def end(line, status, before=None):
    """End the command: what Monarch's threads print from now on goes nowhere, the processes
    that Monarch started on this host are killed (they would die with this one a moment later,
    and print meanwhile), then `before` and `line`, then the status, without Python's exit, at
    which Monarch's threads aborted the process ("FATAL: exception not rethrown", 1 run in 2)."""
    _ending.acquire()  # another thread that ends it meanwhile waits for the process to end
    with contextlib.suppress(ValueError):  # in the main thread: Ctrl-C again changes nothing
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
        sys.stderr.flush()
    terminal = os.dup(2)
    nowhere = os.open(os.devnull, os.O_WRONLY)
    os.dup2(nowhere, 1)
    os.dup2(nowhere, 2)
    me = str(os.getpid())
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            text = stat.read_text()
            if text[text.rindex(")") + 2:].split()[1] == me:  # a child of this process
                os.kill(int(stat.parent.name), signal.SIGKILL)
    text = "".join(f"{part.rstrip()}\n" for part in (before, line) if part)
    with contextlib.suppress(OSError):
        os.write(terminal, text.encode(errors="replace"))
    os._exit(status)
