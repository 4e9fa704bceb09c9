"""The harness that every example here shares; main.py beside it holds the tutorial's code.

How the ranks start (all on this machine, one per --rank, or under torchrun), how they meet,
and how every wait is bounded. The tutorials start each rank with rpc.init_rpc() and end it
with rpc.shutdown(): the first gives up only after its rendezvous's 30-minute default, the
second waits for every other rank without any limit, so a rank that never starts, or dies
mid-run, leaves the others waiting. Here, in the order a run goes through this file:
  - parse_args() refuses bad input in one line, before anything starts;
  - start() runs every rank on this machine, or the one that --rank or torchrun names; Ctrl-C
    or SIGTERM ends a rank at once, in any phase, with one line;
  - _join() meets the other ranks at rank 0's store: it says who waits where, compares every
    rank's flags with rank 0's, and names the ranks that did not come within --init_timeout;
  - init_rpc_with_timeout() is rpc.init_rpc() over that store; from then until the rank
    finishes, _watch_peers() ends it within two heartbeats of a peer's death;
  - finish_and_shutdown() tells every peer that this rank is done, then waits until all are,
    asking the ones still working every HEARTBEAT_SECONDS whether they are alive; only then
    does it call rpc.shutdown(), which returns at once;
  - any RPC that fails (a peer died, or did not answer within --rpc_timeout) ends the rank:
    it names the peers that no longer answer and exits with status 1, without the graceful
    shutdown that would wait for them.

The same file sits in every example's folder, so that each folder runs on its own
(`cd param_server && python main.py`); a test checks that the copies are identical. main.py
imports it before torch, for the first section below.
"""

import argparse
import contextlib
import ctypes
import datetime
import fcntl
import io
import ipaddress
import json
import multiprocessing.connection
import os
import platform
import re
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
import traceback
import urllib.parse
import warnings
from pathlib import Path

# --------- Before torch is imported --------------------
#
# Expected failures (a peer that died, Ctrl-C) are reported here in one line, but torch's C++
# code logs them too, several lines each, some with a C++ stack trace ("[W... tensorpipe_agent.
# cpp:917] RPC agent for worker2 encountered error ...", "[E... thread_pool.cpp:170] Exception
# in thread pool task: ECONNRESET ... frame #0"). Every error that matters also reaches Python,
# where it is reported. torch reads TORCH_CPP_LOG_LEVEL once, when it is imported: FATAL keeps
# only the logs of a crash, unless the user chose a level (INFO shows everything).
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
# The profiler's library (Kineto) logs each start and stop, and on a machine without a GPU an
# "ERROR" about it; 6 is above its highest level: only what it writes into the trace remains.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

# Two known-harmless deprecation warnings come from inside PyTorch's RPC stack, in every
# process, about its own internals: the RPC agent builds its process group through an API
# deprecated since PyTorch 2.0, and DistributedOptimizer uses TorchScript functional
# optimizers, deprecated too. The first is an ordinary warning, so a filter drops it. The second
# is raised under warnings.simplefilter("always"), which overrides every filter (torch 2.4 raises
# it when torch.distributed.optim is imported), so it is dropped where warnings are shown
# instead: the hook below passes every other warning on to the hook it replaces, unchanged.
warnings.filterwarnings("ignore", message=r".*as a ProcessGroup\. This usage is deprecated")
TORCHSCRIPT_OPTIMIZER_WARNING = "`TorchScript` support for functional optimizers is deprecated"
_show_warning = warnings.showwarning


def _show_warning_unless_torchscript_optimizer(message, *args, **kwargs):
    if not str(message).startswith(TORCHSCRIPT_OPTIMIZER_WARNING):
        _show_warning(message, *args, **kwargs)


warnings.showwarning = _show_warning_unless_torchscript_optimizer


def _interrupted(number, frame=None, who="", then=""):
    """End this process on a signal, in one line; a rank that is profiling (`who` names it)
    first writes its trace."""
    sys.stdout.flush()
    if who:
        profiling.close_on_the_way_out()
    print(f"{who}interrupted{'' if number == signal.SIGINT else ' (SIGTERM)'}{then}",
          file=sys.stderr, flush=True)
    os._exit(128 + number)


# Ctrl-C while torch loads, a few seconds, ends a command of ours as later: in one line. (Not in
# a process that imports this file for other ends, such as the tests, nor in the ranks that
# spawn_all starts, which leave Ctrl-C to it.)
if (Path(getattr(sys.modules["__main__"], "__file__", "")).parent == Path(__file__).parent
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
    for _number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(_number, _interrupted)

import profiling  # noqa: E402 - --profile, beside this file
import torch  # noqa: E402 - after the settings above, which torch reads when imported
import torch.distributed as dist  # noqa: E402
import torch.distributed.rpc as rpc  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

# When a function called through RPC raises, torch prints its traceback in the rank where it
# ran, and hands the same error to the caller, which raises it (and, here, reports it). A rank
# whose caller has died would print the error of a call that nobody waits for, beside its own
# line about the lost peer. That print (the only one in the module) goes; the caller's stays.
rpc.internal.print = lambda *args, **kwargs: None

# --------- Command line --------------------

class _ShowDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Every default in --help but None, which the flag's help explains ("unset: ...")."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """Shows every default in --help, takes no abbreviated flags (a typo must not pass for
    another flag), and reports bad input as one line (no usage block) and exit status 2."""

    def __init__(self, **kwargs):
        super().__init__(formatter_class=_ShowDefaults, allow_abbrev=False, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def int_at_least(low):
    def parse(text):
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    parse.__name__ = f"integer (>= {low})"  # argparse names the type in its error message
    return parse


def int_list_at_least(low):
    """Whole numbers separated by commas, each at least `low`: 4, or 1,2,4,8."""
    def parse(text):
        try:
            values = [int(part) for part in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected numbers separated by commas, such as 4 or 1,2,4,8, got {text!r}") \
                from None
        if min(values) < low:
            raise argparse.ArgumentTypeError(f"each must be at least {low}, got {text}")
        return values
    parse.__name__ = f"list of integers (>= {low})"
    return parse


def number_type(name, accepts, requirement):
    """A float argument type that takes the values for which accepts(value) is true (a
    comparison, so that nan is refused), and otherwise says `requirement`."""
    def parse(text):
        value = float(text)
        if not accepts(value):
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {text}")
        return value
    parse.__name__ = name
    return parse


positive_float = number_type("number (> 0)", lambda v: v > 0, "greater than 0")
unit_interval = number_type("number (0 to 1)", lambda v: 0 <= v <= 1, "from 0 to 1")
probability = number_type("number (0 to < 1)", lambda v: 0 <= v < 1, "from 0 to less than 1")


def port_number(text):
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number from 1 to 65535, got {value}")
    return value


port_number.__name__ = "port"

# The flags that may differ between the ranks of one run; every other flag must be the same on
# every rank (_join checks). Paths name files on each rank's own machine.
PER_RANK_FLAGS = {"rank", "master_addr", "master_port", "init_timeout", "rpc_timeout",
                  "rpc_transport", "threads", "summary_json"}


def add_launch_arguments(parser, world_size, min_world_size, roles, rpc_transport,
                         profiled=True):
    """The flags every example takes; its own flags follow them in its main.py. profiled=False:
    no --profile here (the example profiles itself)."""
    add = parser.add_argument
    add("--world_size", "--world-size", type=int_at_least(min_world_size), default=world_size,
        metavar="N", help=f"total number of processes: {roles}")
    add("--rank", type=int_at_least(0), default=None, metavar="R",
        help="run only this rank and start the others in other terminals or on other "
             "machines, in any order, with the same flags (only --rank, --master_addr, "
             "--master_port, --threads, the timeouts, --rpc_transport, --summary_json and "
             "paths may differ). Default: every rank on this machine, or the RANK that "
             "torchrun sets")
    add("--master_addr", "--master-addr", default="localhost", metavar="ADDR",
        help="address of rank 0, reachable by every rank; keep localhost unless the ranks "
             "run on several machines of a trusted network")
    add("--master_port", "--master-port", type=port_number, default=29500, metavar="PORT",
        help="port of rank 0's rendezvous, where every rank meets")
    add("--init_timeout", "--init-timeout", type=positive_float, default=60.0,
        metavar="SECONDS", help="seconds to wait for every rank to join before giving up")
    add("--rpc_timeout", "--rpc-timeout", type=positive_float, default=60.0,
        metavar="SECONDS", help="seconds before an RPC without an answer fails and stops the run")
    add("--rpc_transport", "--rpc-transport", choices=("auto", "tcp"), default=rpc_transport,
        help="how RPC carries messages between processes of one machine: auto lets TensorPipe "
             "use shared memory, the quickest for small messages, but each process then keeps "
             "a thread polling it without pause, which on a small machine takes CPU time from "
             "the work; tcp uses loopback sockets, which wait idle. Between machines, TCP")
    add("--threads", type=int_at_least(1), default=None, metavar="N",
        help="intra-op threads of every rank this command starts. Default: OMP_NUM_THREADS if "
             "set, else this machine's cores shared by the ranks that do the arithmetic, and 1 "
             "for the ranks that mostly wait")
    add("--seed", type=int_at_least(0), default=1, metavar="N", help="random seed")
    add("--summary_json", "--summary-json", default=None, metavar="PATH",
        help="write the run's figures to this JSON file at the end")
    if profiled:
        add("--profile", default=None, metavar="DIR",
            help="profile every rank with torch.profiler: each writes DIR/<its name>.json and "
                 "rank 0 merges them into DIR/timeline.json, a track per rank, for "
                 "https://ui.perfetto.dev or chrome://tracing. The ranks that loop record "
                 f"--profile_steps steps after {profiling.WARMUP_STEPS} warm-up steps; the "
                 "others, from their start until those are done")
        add("--profile_steps", "--profile-steps", type=int_at_least(1), default=3, metavar="N",
            help="how many steps of each looping rank --profile records")


def parse_args(parser, argv, min_world_size, per_rank=()):
    """Parse the command line, fill in rank and rendezvous from torchrun's environment when
    torchrun started us, and check that the rank fits the world and that rank 0 can listen
    where it must. `per_rank`: the example's flags that may differ between ranks (paths).
    Bad input ends here: one line, status 2."""
    args = parser.parse_args(argv)
    args.torchrun = args.rank is None and "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if args.torchrun:
        try:
            args.rank = int(os.environ["RANK"])
            args.world_size = int(os.environ["WORLD_SIZE"])
            args.master_addr = os.environ["MASTER_ADDR"]
            args.master_port = int(os.environ["MASTER_PORT"])
        except (KeyError, ValueError) as err:
            parser.error(f"torchrun's environment is incomplete: {err}")
        if args.world_size < min_world_size:
            parser.error(f"this example needs at least {min_world_size} processes, "
                         f"torchrun started {args.world_size}")
    if args.rank is not None and args.rank >= args.world_size:
        parser.error(f"--rank {args.rank} is outside a world of {args.world_size} "
                     f"(ranks 0 to {args.world_size - 1})")
    try:
        socket.getaddrinfo(args.master_addr, args.master_port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as err:  # UnicodeError: not a valid host name at all
        parser.error(f"--master_addr {args.master_addr}: no such host "
                     f"({getattr(err, 'strerror', None) or 'not a valid host name'})")
    if not args.torchrun and args.rank in (None, 0):
        try:
            _listen(args.master_addr, args.master_port).close()
        except OSError as err:
            parser.error(f"cannot listen on {args.master_addr}:{args.master_port} "
                         f"({os.strerror(err.errno)}); if another run uses the port, choose "
                         f"another --master_port; if this run's rank 0 does, this rank is taken")
    if getattr(args, "profile_steps", None) and args.profile:
        profiling.check_folder(parser, args.profile)
    args.per_rank = sorted(PER_RANK_FLAGS.union(per_rank, {"torchrun", "per_rank"}))
    return args


def _listen(addr, port):
    family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((addr, port), family=family)


# --------- Starting the ranks --------------------

_args = None  # this process's command line
_worker_name = None  # the example's worker_name(rank, world_size)
_name = None  # this rank's name
_doing = None  # the example's doing(rank, world_size): what the rank does, said once it joined
_started = None  # when this rank started, for the summary's wall_seconds
_looping = None  # the ranks whose loops call profile_step(), from start's `steps`


def start(args, run_worker, worker_name, doing, heavy=None, steps=None):
    """Run run_worker(rank, world_size, args): for every rank on this machine, each in a
    process of its own (no --rank), or for the one rank that --rank or torchrun names.
    doing(rank, world_size) says what a rank does, once it has joined. heavy(rank, world_size)
    tells the ranks that do the example's arithmetic (default: all), which share the machine's
    cores (see thread_counts). steps(rank, world_size) tells the ranks whose loop calls
    profile_step() once a step, which bounds --profile's window (None: no --profile here)."""
    _print_whole_lines()
    choose_network_interface(args.master_addr)
    heavy = heavy or (lambda rank, world_size: True)
    threads = thread_counts(args, heavy)
    looping = None if steps is None else [rank for rank in range(args.world_size)
                                          if steps(rank, args.world_size)]
    if args.rank is None:
        spawn_all(args, run_worker, worker_name, doing, threads, looping)
    else:
        use_threads(threads[args.rank], heavy(args.rank, args.world_size),
                    f"{worker_name(args.rank, args.world_size)}: ")
        _end_on_signals(worker_name(args.rank, args.world_size))
        run_rank(args.rank, args, run_worker, worker_name, doing, looping)
    _exit_done()


def _end_on_signals(name, signals=(signal.SIGINT, signal.SIGTERM)):
    """Ctrl-C (SIGINT) or SIGTERM ends this process at once with one line, whatever it is doing.
    A Python signal handler runs only when the main thread returns to Python, which it may not
    do for the whole join or training (blocked in torch's C++ code); but every signal that has a
    Python handler is also written to the wakeup fd at once, by whichever thread takes it, and a
    thread here waits on that."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end)
    for number in signals:
        signal.signal(number, lambda number, frame: None)  # the thread below does the work

    def wait_for_a_signal():
        while (number := os.read(read_end, 1)[0]) not in signals:
            pass  # another signal that has a Python handler
        _interrupted(number, who=f"{name}: ")

    threading.Thread(target=wait_for_a_signal, daemon=True, name="signals").start()


# --------- Threads --------------------
#
# Several ranks share one machine's cores. A process's OpenMP thread teams, which run torch's
# intra-op work, are sized when the process starts: OMP_NUM_THREADS, or else every core.
# torch.set_num_threads() resizes only the teams of threads that call it, not those of RPC's
# threads, where a rank runs the calls it receives (measured: set to 1, a convolution on an RPC
# thread still kept two cores busy). So each rank that does the arithmetic (heavy) gets its
# share of the cores in OMP_NUM_THREADS before it starts; the others, which mostly wait for
# messages, get one thread each.

def thread_counts(args, heavy):
    """{rank: threads} for the ranks on this machine: --threads, else OMP_NUM_THREADS, else
    the cores shared by the heavy ranks, and 1 for the others."""
    world = range(args.world_size)
    if args.rank is None or _is_loopback(args.master_addr):
        local = world
    elif args.torchrun and "LOCAL_WORLD_SIZE" in os.environ:
        first = args.rank - int(os.environ.get("LOCAL_RANK", 0))
        local = range(first, first + int(os.environ["LOCAL_WORLD_SIZE"]))
    else:  # alone here, as far as this rank can tell
        local = [args.rank]
    fixed = args.threads or os.environ.get("OMP_NUM_THREADS")
    if fixed:
        return dict.fromkeys(local, int(fixed))
    heavy_ranks = [rank for rank in local if heavy(rank, args.world_size)]
    share = max(1, _cores() // max(1, len(heavy_ranks)))
    return {rank: share if rank in heavy_ranks else 1 for rank in local}


def use_threads(threads, heavy, who):
    """Give this process `threads` intra-op threads, and say so once. A heavy rank needs its
    thread teams that wide on every thread, so it restarts with OMP_NUM_THREADS set if they were
    sized otherwise when it started; a light rank sets its own thread's only, as RPC's threads
    have little to do there."""
    if heavy and os.environ.get("OMP_NUM_THREADS", str(_cores())) != str(threads):
        os.environ["OMP_NUM_THREADS"] = str(threads)
        sys.stdout.flush()
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
    torch.set_num_threads(threads)
    print(f"{who}{threads} intra-op thread(s) on {_cores()} core(s) "
          f"(--threads or OMP_NUM_THREADS to change)")


def _cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _is_loopback(addr):
    try:
        return ipaddress.ip_address(socket.getaddrinfo(addr, None)[0][4][0]).is_loopback
    except (OSError, ValueError):
        return False


def run_rank(rank, args, run_worker, worker_name, doing, looping=None, spawned=False):
    """Everything one rank does, in its own process; a failure ends the process with status 1.
    looping: the ranks that call profile_step() (None: no --profile)."""
    global _args, _worker_name, _name, _doing, _started, _looping
    _args, _worker_name, _doing, _started = args, worker_name, doing, time.perf_counter()
    _looping = looping
    _name = worker_name(rank, args.world_size)
    keep_freed_memory()
    try:
        _join(rank, quiet=spawned)
        run_worker(rank, args.world_size, args)
    except Exception as err:  # noqa: BLE001 - reported below, then the process ends
        peers = [worker_name(r, args.world_size) for r in range(args.world_size) if r != rank]
        lost = _unreachable(peers) if _watching.is_set() else []
        if not lost:
            traceback.print_exc()
            _exit(f"{_name}: failed: {_first_line(err)}")
        _exit(f"{_name}: lost contact with {', '.join(lost)} ({_first_line(err)}); stopping")


def spawn_all(args, run_worker, worker_name, doing, threads, looping):
    """Start every rank on this machine, each with its threads, and wait. If one fails, stop
    the others, name the one that failed first (killed by a signal, or else the first seen to
    exit with an error: the others then exit too, having lost it) and exit 1. Ctrl-C or SIGTERM
    stops them all, with one line."""
    print("Threads: " + ", ".join(f"{worker_name(rank, args.world_size)} {count}"
                                  for rank, count in threads.items())
          + f" (on {_cores()} core(s); --threads or OMP_NUM_THREADS to change)")
    context = mp.get_context("spawn")
    ranks = [context.Process(target=_spawned_rank,
                             args=(rank, args, run_worker, worker_name, doing, looping,
                                   os.getpid()))
             for rank in range(args.world_size)]
    omp_num_threads = os.environ.get("OMP_NUM_THREADS")
    # The ranks ignore Ctrl-C, which the terminal sends to all of them: this process stops them.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for rank, process in enumerate(ranks):
        os.environ["OMP_NUM_THREADS"] = str(threads[rank])  # what the child starts with
        process.start()
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, _raise_keyboard_interrupt)
    if omp_num_threads is None:
        del os.environ["OMP_NUM_THREADS"]
    else:
        os.environ["OMP_NUM_THREADS"] = omp_num_threads
    try:
        running = list(ranks)
        while running:
            ready = multiprocessing.connection.wait([process.sentinel for process in running])
            for process in running:
                if process.sentinel in ready:
                    # A dying process closes its files a moment before its exit status is
                    # known; without it, a rank killed first could be taken for a survivor.
                    process.join(5)
            failed = [p for p in running if p.exitcode not in (None, 0)]
            if failed:
                first = min(failed, key=lambda process: process.exitcode >= 0)
                rank = ranks.index(first)
                how = (f"was killed by {signal.Signals(-first.exitcode).name}"
                       if first.exitcode < 0 else f"exited with status {first.exitcode}")
                _stop(ranks)
                _exit(f"{worker_name(rank, args.world_size)} (rank {rank}) {how}; "
                      f"stopped the other ranks", status=2 if first.exitcode == 2 else 1)
            running = [process for process in running if process.exitcode is None]
    except KeyboardInterrupt as interrupt:
        _stop(ranks)
        _interrupted(interrupt.args[0] if interrupt.args else signal.SIGINT,
                     then="; stopped every rank")


def _raise_keyboard_interrupt(number, frame):
    raise KeyboardInterrupt(number)


def _stop(processes, grace=5.0):
    for process in processes:
        if process.exitcode is None and process.pid is not None:
            process.terminate()
    for process in processes:
        if process.pid is not None:
            process.join(grace)
            if process.exitcode is None:
                process.kill()
                process.join()


def _spawned_rank(rank, args, run_worker, worker_name, doing, looping, launcher_pid):
    """A rank started by spawn_all. It ends with its launcher, even one killed with SIGKILL,
    so that no rank is left running unseen (Linux; elsewhere it finishes its run)."""
    _print_whole_lines()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
        if os.getppid() != launcher_pid:  # the launcher was gone before prctl
            os._exit(1)
    if getattr(args, "profile", None):  # stopped by the launcher: its trace first, then its line
        _end_on_signals(worker_name(rank, args.world_size), (signal.SIGTERM,))
    run_rank(rank, args, run_worker, worker_name, doing, looping, spawned=True)
    _exit_done()


def _print_whole_lines():
    """Have print() write each line at once. The ranks share one terminal or log, where lines
    written in pieces (as under python -u or PYTHONUNBUFFERED) run into each other's; and each
    line then shows when it is printed, even through a pipe (| tee run.log)."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True, write_through=False)


def choose_network_interface(addr):
    """Tell TensorPipe, Gloo and NCCL which network interface to listen on and advertise
    (unless the environment already does): the one that holds this machine's address towards
    --master_addr. For a local run that is loopback, so nothing is reachable from the network
    (RPC runs unauthenticated pickles). Across machines, left to themselves they advertise the
    address the hostname resolves to, often 127.0.1.1, which the other machines cannot reach,
    and NCCL listens on the first interface that is not loopback."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(addr, 1, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(sockaddr)  # chooses the route; a UDP connect sends nothing
            local_address = probe.getsockname()[0]
    except OSError:
        return
    name = next((name for _, name in socket.if_nameindex()
                 if _ipv4_address(name) == local_address), None)
    if name is None and ipaddress.ip_address(local_address).is_loopback:
        name = "lo0" if sys.platform == "darwin" else "lo"
    if name:
        for variable in ("TP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(variable, name)


def _ipv4_address(interface):
    """The IPv4 address of a network interface (Linux), or None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            request = struct.pack("256s", interface.encode()[:15])
            reply = fcntl.ioctl(sock.fileno(), 0x8915, request)  # SIOCGIFADDR
    except OSError:
        return None
    return socket.inet_ntoa(reply[20:24])


def keep_freed_memory():
    """Have malloc keep the memory that a rank frees, for the next batch. glibc gives large
    freed blocks back to the system, and with the forward and backward passes running on RPC's
    threads, each with a malloc arena of its own, the parameter server then faulted in the pages
    of every batch's activations afresh: a million page faults in 100 batches, a fifth of its
    time. Linux with glibc only; elsewhere this does nothing."""
    if platform.libc_ver()[0] != "glibc":
        return
    libc = ctypes.CDLL(None)
    libc.mallopt(-3, 32 * 2**20)  # M_MMAP_THRESHOLD: blocks up to 32 MiB (the most) from arenas
    libc.mallopt(-1, 2**30)  # M_TRIM_THRESHOLD: give memory back only above 1 GiB free


# --------- Joining --------------------
#
# Every rank first meets the others at one key-value store (torch's TCPStore), hosted by rank 0
# on --master_addr:--master_port (under torchrun, by torchrun): each rank checks its flags
# against rank 0's, then claims its rank; once every rank has, RPC and any process group start
# over the same store, with everyone there.

_store = None  # the store every rank met at, for init_rpc and the process groups
_KEYS = "rpc_examples/"  # our keys in the store (torch's own have other names)


def _join(rank, quiet):
    """Meet every rank, or end this one with one line, as every other rank ends: the ranks that
    did not come within --init_timeout (status 1), a flag that differs from rank 0's (status 2);
    or this rank alone, when another process holds it (status 2). Unless `quiet` (spawn_all
    started every rank), first say who waits where."""
    global _store
    args, world_size = _args, _args.world_size
    first = f"{_worker_name(0, world_size)} (rank 0)"
    where = f"{args.master_addr}:{args.master_port}"
    if not quiet:
        print(f"{_name} (rank {rank} of {world_size}): waiting for the other ranks at {where}, "
              f"up to {args.init_timeout:g} s")
    deadline = time.monotonic() + args.init_timeout
    if rank == 0 and not args.torchrun:
        _store = _host_store(args.master_addr, args.master_port, args.init_timeout)
    else:
        _store = _connect(args.master_addr, args.master_port, deadline)
        if _store is None:
            _exit(f"{_name}: {first} did not come: nothing answered at {where} within "
                  f"{args.init_timeout:g} s (--init_timeout); start it with the same flags")
    try:
        ended = _meet(rank, deadline, where)
        if ended is None:
            return
        status, message, their_world_size = json.loads(ended)
        # Rank 0's process holds the store: it stays until every rank that came has read why
        # the join ended (and, if it ended early, until every rank has come, in the larger
        # world if two were asked for), so that none is left to find out by a timeout.
        told = _store.add(f"{_KEYS}told", 0 if rank == 0 else 1)
        everyone = max(world_size, their_world_size) - 1
        until = max(deadline, time.monotonic() + 2)
        while rank == 0 and time.monotonic() < until:
            arrived = _store.add(f"{_KEYS}arrived", 0)
            if told >= arrived and (told >= everyone or time.monotonic() > deadline):
                break
            time.sleep(0.1)
            told = _store.add(f"{_KEYS}told", 0)
    except RuntimeError as err:  # the store's errors: rank 0 is gone
        _exit(f"{_name}: lost {first} while waiting for the other ranks ({_first_line(err)})")
    _exit(f"{_name}: {message}", status=status)


def _meet(rank, deadline, where):
    """Claim this rank in the store, after comparing its flags with rank 0's, and wait for every
    other rank. Returns None when all have joined, or else the JSON [status, message, world size
    of the rank that ended it] that ends the join for every rank."""
    args, world_size = _args, _args.world_size
    ended, keys = f"{_KEYS}ended", [f"{_KEYS}rank{r}" for r in range(world_size)]
    mine = {"flags": {key: value for key, value in sorted(vars(args).items())
                      if key not in args.per_rank},
            "host": socket.gethostname(), "pid": os.getpid()}
    if rank != 0:
        _store.add(f"{_KEYS}arrived", 1)
        # Polled: a get() would wait, but torch's classic store server wakes no waiting client
        # when compare_set (rank 0's claim) makes the key, so a get() sent before the claim
        # would sit out the whole --init_timeout, as it did under load.
        while not _store.check([keys[0]]):
            if time.monotonic() > deadline:
                raise RuntimeError(f"it did not claim rank 0 within {args.init_timeout:g} s")
            time.sleep(0.05)
        difference = _flag_differences(json.loads(_store.get(keys[0]))["flags"], mine["flags"],
                                       rank)
        if difference:
            _store.compare_set(ended, "", json.dumps([2, difference, world_size]))
    if not _store.check([ended]):
        _claim(rank, json.dumps(mine))
    while not _store.check([ended]):
        if _store.check(keys):
            return None
        if time.monotonic() > deadline:
            missing = [f"{_worker_name(r, world_size)} (rank {r})"
                       for r, key in enumerate(keys) if not _store.check([key])]
            message = (f"{', '.join(missing)} did not join at {where} within "
                       f"{args.init_timeout:g} s (--init_timeout); start "
                       f"{'them' if len(missing) > 1 else 'it'} with the same flags")
            _store.compare_set(ended, "", json.dumps([1, message, world_size]))
        time.sleep(0.1)
    return _store.get(ended).decode()


def _connect(addr, port, deadline):
    """A client of rank 0's store, once rank 0 listens, or None at the deadline. Polled here
    with plain connections: TCPStore's own retries print C++ errors and can outlast their
    timeout twice."""
    while True:
        try:
            socket.create_connection((addr, port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                return None
            time.sleep(0.2)
    try:
        store = dist.TCPStore(addr, port, is_master=False, timeout=datetime.timedelta(seconds=5))
    except RuntimeError:  # rank 0 went away in between
        return None
    store.set_timeout(datetime.timedelta(seconds=max(1.0, deadline - time.monotonic())))
    return store


def _host_store(addr, port, seconds):
    """Rank 0's store, listening on `addr` only: given the host and port alone, TCPStore listens
    on every interface, which for a local run would expose an unauthenticated port to the
    network. So the socket is opened here and handed over. use_libuv=False: the libuv server,
    torch's default since 2.4, takes a listening socket only from torch 2.8 (pytorch/pytorch
    PR 150215); the classic server takes it in every version from 2.4 on."""
    try:
        sock = _listen(addr, port)
    except OSError as err:
        _exit(f"cannot listen on {addr}:{port} ({os.strerror(err.errno)}); if another run uses the "
              f"port, choose another --master_port", status=2)
    return dist.TCPStore(addr, port, is_master=True, master_listen_fd=sock.detach(),
                         wait_for_workers=False, use_libuv=False,
                         timeout=datetime.timedelta(seconds=seconds))


def _claim(rank, mine):
    """Take this rank's key in the store; refuse a rank that another live process holds. A key
    left by a process of this machine that is gone (Ctrl-C, then started again) is taken over."""
    key = f"{_KEYS}rank{rank}"
    held = _store.compare_set(key, "", mine).decode()
    if held != mine:
        holder = json.loads(held)
        if holder["host"] == socket.gethostname() and not _alive(holder["pid"]):
            held = _store.compare_set(key, held, mine).decode()
        if held != mine:
            _store.add(f"{_KEYS}told", 1)
            _exit(f"{_name}: rank {rank} is taken: process {holder['pid']} on {holder['host']} "
                  f"joined as rank {rank} first; give every rank its own --rank", status=2)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _flag_differences(theirs, mine, rank):
    """One line naming every flag whose value differs from rank 0's, or ''."""
    differing = sorted(set(theirs) | set(mine), key=lambda key: key != "world_size")
    differing = [key for key in differing if theirs.get(key) != mine.get(key)]
    if not differing:
        return ""
    first, me = _worker_name(0, _args.world_size), _name
    return ("the ranks were started with different flags: " + "; ".join(
        f"--{key} is {_shown(theirs.get(key))} on rank 0 ({first}) but {_shown(mine.get(key))} "
        f"on rank {rank} ({me})" for key in differing)
        + "; start every rank with the same values")


def _shown(value):
    if isinstance(value, bool) or value is None:
        return {True: "set", False: "not set", None: "unset"}[value]
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def _rendezvous(url, **kwargs):
    """init_rpc's rendezvous (init_method="launch://"): the store every rank joined at, with
    the rank and world size that init_rpc put in the URL."""
    query = dict(urllib.parse.parse_qsl(urllib.parse.urlparse(url).query))
    yield _store, int(query["rank"]), int(query["world_size"])


@contextlib.contextmanager
def _without_gloo_chatter():
    """Some torch releases (2.8 among them) print "[Gloo] Rank 1 is connected to 1 peer ranks.
    ..." on stdout from C++ whenever a Gloo group connects: in init_rpc, and for a process group.
    The lines printed meanwhile go through a file, and all but those come out."""
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 1)
        try:
            yield
        finally:
            ctypes.CDLL(None).fflush(None)
            os.dup2(saved, 1)
            os.close(saved)
            caught.seek(0)
            for line in caught.read().decode(errors="replace").splitlines(keepends=True):
                if not re.match(r"\[Gloo\] Rank \d+ is connected to \d+ peer ranks", line):
                    sys.stdout.write(line)
            sys.stdout.flush()


def init_rpc_with_timeout(name, rank, world_size, num_worker_threads=16):
    """rpc.init_rpc(name, rank=rank, world_size=world_size) over the store every rank joined
    at, with TensorPipe's num_worker_threads (16, its default, unless the example needs more).
    Everyone is there already, so it returns at once; should a rank vanish meanwhile, it gives
    up after --rpc_timeout. Then says what this rank does."""
    with contextlib.suppress(ValueError):  # already registered (tests load several examples)
        dist.register_rendezvous_handler("launch", _rendezvous)
    # --rpc_transport tcp: TensorPipe's TCP transport ("uv") only, no shared memory.
    transports = ["uv"] if _args.rpc_transport == "tcp" else None
    options = rpc.TensorPipeRpcBackendOptions(init_method="launch://",
                                              num_worker_threads=num_worker_threads,
                                              rpc_timeout=_args.rpc_timeout,
                                              _transports=transports)
    profiling.begin(_args, rank, name, _looping)
    try:
        with _without_gloo_chatter():
            rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)
    except Exception as err:  # noqa: BLE001 - any failure to start RPC ends this rank
        _exit(f"{name}: could not start RPC with the other ranks: {_first_line(err)}")
    print(f"{name}: joined; {_doing(rank, world_size)}")
    _watching.set()
    threading.Thread(target=_watch_peers, daemon=True).start()
    profiling.joined(_store, rank, _worker_name(0, world_size))


def init_process_group_with_timeout(name, backend, rank, world_size):
    """dist.init_process_group(backend, rank=rank, world_size=world_size) for a group of its
    own beside RPC (its ranks are the first world_size ranks), over the store every rank joined
    at, bounded by --init_timeout, which also bounds every collective after it."""
    try:
        with _without_gloo_chatter():
            dist.init_process_group(backend, store=dist.PrefixStore("process_group", _store),
                                    rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=_args.init_timeout))
    except Exception as err:  # noqa: BLE001 - any failure to join ends this rank with one line
        _exit(f"{name}: the {world_size} members of the process group did not all join within "
              f"{_args.init_timeout:g} s (--init_timeout): {_first_line(err)}")


# --------- Working, and ending --------------------

HEARTBEAT_SECONDS = 1.0
profile_step = profiling.step  # main.py's loops call it once a step: --profile's window
_watching = threading.Event()  # set once RPC is up: from then on a failure may be a lost peer
_reports = {}  # peer name -> what it reported when it finished
_reports_changed = threading.Condition()
_finishing = threading.Event()  # set when this rank starts to finish: the watch ends


def _watch_peers():
    """Until this rank starts to finish, ask every HEARTBEAT_SECONDS whether its peers are
    there (rank 0 asks every other rank, the others ask rank 0: a death reaches everyone in two
    beats), and end the rank as soon as one is gone, wherever its own work waits. A call that
    needs the dead peer only through another rank (an RRef the dead peer owns, say) can
    otherwise hang until TensorPipe gives up retrying or --rpc_timeout. No answer within
    --rpc_timeout (a busy peer) is not taken for a death; --rpc_timeout bounds that case."""
    me = rpc.get_worker_info().id
    peers = ([_worker_name(rank, _args.world_size) for rank in range(1, _args.world_size)]
             if me == 0 else [_worker_name(0, _args.world_size)])
    while not _finishing.wait(HEARTBEAT_SECONDS):
        for peer in peers:
            try:
                rpc.rpc_async(peer, _answer, timeout=_args.rpc_timeout).wait()
            except Exception as err:  # noqa: BLE001 - any error but a timeout is a lost peer
                if _finishing.is_set() or "timeout" in str(err).lower():
                    continue
                everyone = [_worker_name(rank, _args.world_size)
                            for rank in range(_args.world_size) if rank != me]
                lost = _unreachable(everyone) or [peer]
                _exit(f"{_name}: lost contact with {', '.join(lost)} ({_first_line(err)}); "
                      "stopping")


def finish_and_shutdown(report=None):
    """Tell every peer that this rank is done (with its report), wait until every peer is done,
    then rpc.shutdown(). Returns every peer's report."""
    _finishing.set()  # the heartbeat below takes over from _watch_peers
    peers = [_worker_name(rank, _args.world_size) for rank in range(_args.world_size)]
    peers.remove(_name)
    for peer in peers:
        rpc.rpc_sync(peer, _report_finished, args=(_name, report))
    beat = time.monotonic()
    while True:
        waiting = profiling.waiting_for_the_window()
        if waiting is False:  # every looping rank's window has closed: this one's closes too
            profiling.close()
        with _reports_changed:
            working = [peer for peer in peers if peer not in _reports]
            if not working:
                break
            _reports_changed.wait(0.05 if waiting else HEARTBEAT_SECONDS)
        if time.monotonic() - beat >= HEARTBEAT_SECONDS:
            beat = time.monotonic()
            for peer in working:
                rpc.rpc_sync(peer, _answer)  # raises if the peer is gone
    profiling.close()  # each rank's trace is written before rank 0 passes the barrier below
    me = rpc.get_worker_info().id
    rpc.shutdown(timeout=_args.rpc_timeout)
    # rpc.shutdown() ends with a barrier in the store, which lives in rank 0's process: rank 0
    # stays until every rank is past it (or has had 10 s), lest its exit reset their connection.
    left = _store.add(f"{_KEYS}left", 0 if me == 0 else 1)
    until = time.monotonic() + 10
    while me == 0 and left < _args.world_size - 1 and time.monotonic() < until:
        time.sleep(0.05)
        left = _store.add(f"{_KEYS}left", 0)
    if me == 0:
        profiling.write_timeline_of_every_rank(
            [_worker_name(rank, _args.world_size) for rank in range(_args.world_size)])
    return dict(_reports)


def _report_finished(name, report):
    with _reports_changed:
        _reports[name] = report
        _reports_changed.notify_all()


def _answer():
    return True


def _unreachable(peers):
    futures = {peer: rpc.rpc_async(peer, _answer, timeout=5) for peer in peers}
    lost = []
    for peer, future in futures.items():
        try:
            future.wait()
        except Exception:  # noqa: BLE001 - any error means no answer
            lost.append(peer)
    return lost


# --------- Failing, and the summary --------------------

def _first_line(err):
    """The gist of an error: its first line (after the "On WorkerInfo(...):" line that starts an
    error raised on another rank), without TensorPipe's note on its source file."""
    lines = [line for line in str(err).strip().splitlines()
             if line and not line.startswith("On WorkerInfo(")]
    return re.sub(r" \(this error originated at [^)]*\)", "", (lines or [type(err).__name__])[0])


def _exit_done():
    """End a process whose work is done and written out. Python's teardown of torch costs most
    of a CPU second a process (measured: 0.8 s), a wait at the end of every run, and nothing
    is left for it to do."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _exit(message, status=1):
    """Print one line and end the process now. os._exit, because RPC's own threads would keep a
    normal exit waiting for peers that are gone. A rank that is profiling first writes what
    its profiler holds: a lost peer loses the run only that peer's trace."""
    profiling.close_on_the_way_out()
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(status)


def write_summary(summary, line):
    """Print the run's one-line summary with this rank's wall seconds, and write its figures
    to --summary_json if asked."""
    summary["wall_seconds"] = round(time.perf_counter() - _started, 3)
    print(f"Summary: {line}; {summary['wall_seconds']:.1f} s in all")
    if _args.summary_json:
        Path(_args.summary_json).write_text(json.dumps(summary, indent=2) + "\n")
