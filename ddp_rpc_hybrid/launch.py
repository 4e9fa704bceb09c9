"""The harness that every example here shares; main.py beside it holds the tutorial's code.

How the ranks start (all on this machine, one per --rank, or under torchrun), how they meet,
and how every wait is bounded. The tutorials start each rank with rpc.init_rpc() and end it
with rpc.shutdown(), both of which wait for every other rank with no practical time limit: a
rank that never starts, or dies mid-run, leaves the others waiting forever. Here:
  - init_rpc_with_timeout() is rpc.init_rpc(), given up after --init_timeout seconds; from
    then until the rank finishes, _watch_peers() ends it within two heartbeats of a peer's death;
  - finish_and_shutdown() tells every peer that this rank is done, then waits until all are,
    asking the ones still working every HEARTBEAT_SECONDS whether they are alive; only then
    does it call rpc.shutdown(), which returns at once;
  - any RPC that fails (a peer died, or did not answer within --rpc_timeout) ends the rank:
    it names the peers that no longer answer and exits with status 1, without the graceful
    shutdown that would wait for them.

The same file sits in every example's folder, so that each folder runs on its own
(`cd param_server && python main.py`); a test checks that the copies are identical.
"""

import argparse
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
import threading
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp

# --------- Warnings --------------------
#
# Two known-harmless deprecation warnings come from inside PyTorch's RPC stack, in every
# process, about its own internals: the RPC agent builds its process group through an API
# deprecated since PyTorch 2.0, and DistributedOptimizer uses TorchScript functional
# optimizers, deprecated too. The first is an ordinary warning, so a filter drops it. The second
# is raised under warnings.simplefilter("always"), which overrides every filter, so it is
# dropped where warnings are shown instead: the hook below passes every other warning on to
# the hook it replaces, unchanged.
warnings.filterwarnings("ignore", message=r".*as a ProcessGroup\. This usage is deprecated")
TORCHSCRIPT_OPTIMIZER_WARNING = "`TorchScript` support for functional optimizers is deprecated"
_show_warning = warnings.showwarning


def _show_warning_unless_torchscript_optimizer(message, *args, **kwargs):
    if not str(message).startswith(TORCHSCRIPT_OPTIMIZER_WARNING):
        _show_warning(message, *args, **kwargs)


warnings.showwarning = _show_warning_unless_torchscript_optimizer


# --------- Command line --------------------

class _ShowDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Every default in --help but None, which the flag's help explains ("unset: ...")."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """Shows every default in --help, and reports bad input as one line (no usage block) and
    exit status 2."""

    def __init__(self, **kwargs):
        super().__init__(formatter_class=_ShowDefaults, **kwargs)

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


def add_launch_arguments(parser, world_size, min_world_size, roles, rpc_transport):
    """The flags every example takes; its own flags follow them in its main.py."""
    add = parser.add_argument
    add("--world_size", "--world-size", type=int_at_least(min_world_size), default=world_size,
        metavar="N", help=f"total number of processes: {roles}")
    add("--rank", type=int_at_least(0), default=None, metavar="R",
        help="run only this rank and start the others in other terminals or on other "
             "machines (same --world_size, --master_addr, --master_port, any order). "
             "Default: every rank on this machine, or the RANK that torchrun sets")
    add("--master_addr", "--master-addr", default="localhost", metavar="ADDR",
        help="address of rank 0, reachable by every rank; keep localhost unless the ranks "
             "run on several machines of a trusted network")
    add("--master_port", "--master-port", type=port_number, default=29500, metavar="PORT",
        help="port of rank 0's rendezvous")
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


def parse_args(parser, argv, min_world_size, process_group_port=False):
    """Parse the command line, fill in rank and rendezvous from torchrun's environment when
    torchrun started us, and check that the rank fits the world and that rank 0 can listen
    where it must (with process_group_port, also on --master_port + 1, which rank 0 opens for a
    process group beside RPC's, under torchrun too). Bad input ends here: one line, status 2."""
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
    if not args.torchrun and args.rank in (None, 0):
        _check_can_listen(parser, args.master_addr, args.master_port, "")
    if process_group_port:
        if args.master_port == 65535:
            parser.error("--master_port 65535 leaves no port for the process group "
                         "(--master_port + 1); choose a lower one")
        if args.rank in (None, 0):
            _check_can_listen(parser, args.master_addr, args.master_port + 1,
                              ", the process group's port (--master_port + 1)")
    return args


def _check_can_listen(parser, addr, port, what):
    try:
        _listen(addr, port).close()
    except OSError as err:
        parser.error(f"cannot listen on {addr}:{port} ({err.strerror or err}){what}; "
                     f"if it is in use, choose another --master_port")


# --------- Starting the ranks --------------------

_args = None  # this process's command line
_worker_name = None  # the example's worker_name(rank, world_size)
_name = None  # this rank's name, once it has joined RPC
_rpc_ready = threading.Event()
_started = None  # when this rank started, for the summary's wall_seconds


def start(args, run_worker, worker_name, heavy=None):
    """Run run_worker(rank, world_size, args): for every rank on this machine, each in a
    process of its own (no --rank), or for the one rank that --rank or torchrun names.
    heavy(rank, world_size) tells the ranks that do the example's arithmetic (default: all),
    which share the machine's cores (see thread_counts)."""
    _print_whole_lines()
    os.environ["MASTER_ADDR"] = args.master_addr  # where init_rpc's env:// rendezvous looks
    os.environ["MASTER_PORT"] = str(args.master_port)
    choose_network_interface(args.master_addr)
    heavy = heavy or (lambda rank, world_size: True)
    threads = thread_counts(args, heavy)
    if args.rank is None:
        spawn_all(args, run_worker, worker_name, threads)
    else:
        use_threads(threads[args.rank], heavy(args.rank, args.world_size),
                    f"{worker_name(args.rank, args.world_size)}: ")
        run_rank(args.rank, args, run_worker, worker_name)


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


def run_rank(rank, args, run_worker, worker_name):
    """Everything one rank does, in its own process; a failure ends the process with status 1."""
    global _args, _worker_name, _started
    _args, _worker_name, _started = args, worker_name, time.perf_counter()
    keep_freed_memory()
    name = worker_name(rank, args.world_size)
    try:
        run_worker(rank, args.world_size, args)
    except KeyboardInterrupt:
        _exit(f"{name}: interrupted", status=130)
    except Exception as err:  # noqa: BLE001 - reported below, then the process ends
        peers = [worker_name(r, args.world_size) for r in range(args.world_size) if r != rank]
        lost = _unreachable(peers) if _rpc_ready.is_set() else []
        if not lost:
            traceback.print_exc()
            _exit(f"{name}: failed: {_first_line(err)}")
        _exit(f"{name}: lost contact with {', '.join(lost)} ({_first_line(err)}); stopping")


def spawn_all(args, run_worker, worker_name, threads):
    """Start every rank on this machine, each with its threads, and wait. If one fails, stop
    the others, name the one that failed first (killed by a signal, or else the first seen to
    exit with an error: the others then exit too, having lost it) and exit 1."""
    print("Threads: " + ", ".join(f"{worker_name(rank, args.world_size)} {count}"
                                  for rank, count in threads.items())
          + f" (on {_cores()} core(s); --threads or OMP_NUM_THREADS to change)")
    context = mp.get_context("spawn")
    ranks = [context.Process(target=_spawned_rank,
                             args=(rank, args, run_worker, worker_name, os.getpid()))
             for rank in range(args.world_size)]
    omp_num_threads = os.environ.get("OMP_NUM_THREADS")
    try:
        for rank, process in enumerate(ranks):
            os.environ["OMP_NUM_THREADS"] = str(threads[rank])  # what the child starts with
            process.start()
        if omp_num_threads is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = omp_num_threads
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
                      f"stopped the other ranks")
            running = [process for process in running if process.exitcode is None]
    except KeyboardInterrupt:
        _stop(ranks)
        _exit("interrupted", status=130)


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


def _spawned_rank(rank, args, run_worker, worker_name, launcher_pid):
    """A rank started by spawn_all. It ends with its launcher, even one killed with SIGKILL,
    so that no rank is left running unseen (Linux; elsewhere it finishes its run)."""
    _print_whole_lines()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
        if os.getppid() != launcher_pid:  # the launcher was gone before prctl
            os._exit(1)
    run_rank(rank, args, run_worker, worker_name)


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


# --------- Joining and ending --------------------

HEARTBEAT_SECONDS = 1.0
_reports = {}  # peer name -> what it reported when it finished
_reports_changed = threading.Condition()
_finishing = threading.Event()  # set when this rank starts to finish: the watch ends


def init_rpc_with_timeout(name, rank, world_size, num_worker_threads=16):
    """rpc.init_rpc(name, rank=rank, world_size=world_size), bounded by --init_timeout, with
    TensorPipe's num_worker_threads (16, its default, unless the example needs more)."""
    global _name

    def give_up():
        _exit(f"{name}: not all {world_size} ranks joined at {os.environ['MASTER_ADDR']}:"
              f"{os.environ['MASTER_PORT']} within {_args.init_timeout:g} s (--init_timeout); "
              f"start every rank with the same --world_size, --master_addr and --master_port")

    timer = threading.Timer(_args.init_timeout, give_up)
    timer.daemon = True
    timer.start()
    try:
        # Rank 0 hosts the rendezvous; open its port ourselves so that it listens on
        # --master_addr only (see _listen_for_rendezvous). Under torchrun, torchrun hosts it.
        if rank == 0 and not _args.torchrun:
            _listen_for_rendezvous(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        # --rpc_transport tcp: TensorPipe's TCP transport ("uv") only, no shared memory.
        transports = ["uv"] if _args.rpc_transport == "tcp" else None
        options = rpc.TensorPipeRpcBackendOptions(init_method="env://",
                                                  num_worker_threads=num_worker_threads,
                                                  rpc_timeout=_args.rpc_timeout,
                                                  _transports=transports)
        rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)
    except Exception as err:  # noqa: BLE001 - any failure to join ends this rank with one line
        _exit(f"{name}: could not join the other ranks at {os.environ['MASTER_ADDR']}:"
              f"{os.environ['MASTER_PORT']}: {_first_line(err)}")
    finally:
        timer.cancel()
    _name = name
    _rpc_ready.set()
    threading.Thread(target=_watch_peers, daemon=True).start()


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


def _listen(addr, port):
    family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((addr, port), family=family)


def _listen_for_rendezvous(addr, port):
    """Open the rendezvous port of rank 0 on `addr` only. init_rpc's TCPStore would listen on
    every interface, which for a local run exposes an unauthenticated port to the network; created
    first, this store's server is shared by init_rpc's (multi_tenant). A busy port fails here with
    a clear message instead of deep inside init_rpc."""
    global _rendezvous_store  # kept for the life of the process
    try:
        sock = _listen(addr, port)
    except OSError as err:
        _exit(f"cannot listen on {addr}:{port} ({err.strerror}); "
              f"if the port is in use, choose another with --master_port", status=2)
    _rendezvous_store = dist.TCPStore(addr, port, is_master=True, master_listen_fd=sock.detach(),
                                      wait_for_workers=False, multi_tenant=True)


def init_process_group_with_timeout(name, backend, rank, world_size):
    """dist.init_process_group(backend, rank=rank, world_size=world_size) for a group of its
    own beside RPC, meeting on --master_port + 1 and bounded by --init_timeout, which also bounds
    every collective after it. Its rank 0 opens the port itself, on --master_addr only, as for
    RPC's rendezvous: the TCPStore would otherwise listen on every interface."""
    addr, port = _args.master_addr, _args.master_port + 1
    timeout = datetime.timedelta(seconds=_args.init_timeout)
    listen_fd = None
    if rank == 0:
        try:
            listen_fd = _listen(addr, port).detach()
        except OSError as err:
            _exit(f"cannot listen on {addr}:{port} ({err.strerror}); "
                  f"if the port is in use, choose another with --master_port", status=2)
    try:
        store = dist.TCPStore(addr, port, world_size=world_size, is_master=rank == 0,
                              master_listen_fd=listen_fd, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
    except Exception as err:  # noqa: BLE001 - any failure to join ends this rank with one line
        _exit(f"{name}: the {world_size} members of the process group did not all join at "
              f"{addr}:{port} within {_args.init_timeout:g} s (--init_timeout): "
              f"{_first_line(err)}")


def finish_and_shutdown(report=None):
    """Tell every peer that this rank is done (with its report), wait until every peer is done,
    then rpc.shutdown(). Returns every peer's report."""
    _finishing.set()  # the heartbeat below takes over from _watch_peers
    peers = [_worker_name(rank, _args.world_size) for rank in range(_args.world_size)]
    peers.remove(_name)
    for peer in peers:
        rpc.rpc_sync(peer, _report_finished, args=(_name, report))
    while True:
        with _reports_changed:
            working = [peer for peer in peers if peer not in _reports]
            if not working:
                break
            _reports_changed.wait(HEARTBEAT_SECONDS)
        for peer in working:
            rpc.rpc_sync(peer, _answer)  # raises if the peer is gone
    rpc.shutdown(timeout=_args.rpc_timeout)
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


def _exit(message, status=1):
    """Print one line and end the process now. os._exit, because RPC's own threads would keep a
    normal exit waiting for peers that are gone."""
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(status)


def write_summary(summary, line):
    """Print the run's one-line summary, and write its figures (with this rank's wall seconds)
    to --summary_json if asked."""
    summary["wall_seconds"] = round(time.perf_counter() - _started, 3)
    print(f"Summary: {line} ({summary['wall_seconds']:.1f} s)")
    if _args.summary_json:
        Path(_args.summary_json).write_text(json.dumps(summary, indent=2) + "\n")
