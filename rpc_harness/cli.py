"""The command line every example shares; bad input ends it in one line, status 2, before any
rank starts or any port opens. First, before torch loads, what torch reads as it loads."""

import argparse
import os
import signal
import socket
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

# Expected failures get one line of ours; torch's C++ code would log them too, with stack traces.
# The profiler (Kineto) logs its starts and stops, and an "ERROR" without a GPU: 6 is above all.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

# Harmless deprecation warnings from inside torch's RPC stack (its agent's process group, the
# TorchScript optimizers of DistributedOptimizer, shown under simplefilter("always")).
warnings.filterwarnings("ignore", message=r".*as a ProcessGroup\. This usage is deprecated")

def _show_warning_unless_torchscript_optimizer(message, *args, show=warnings.showwarning, **kw):
    if not str(message).startswith("`TorchScript` support for functional optimizers is deprec"):
        show(message, *args, **kw)

def _interrupted_while_loading(number, frame):
    print("interrupted", file=sys.stderr)
    os._exit(130)

warnings.showwarning = _show_warning_unless_torchscript_optimizer
# Ctrl-C while torch loads ends an example's command in one line, as later (not the tests, nor
# the ranks that spawn() starts, which ignore it).
if (Path(getattr(sys.modules["__main__"], "__file__", "/")).resolve().parent.parent
        == Path(__file__).resolve().parent.parent
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
    signal.signal(signal.SIGINT, _interrupted_while_loading)

STARTED = time.time()  # before torch loads: the summary's seconds count from here
parsed = None  # this process's command line, for spawn()
# A rank's own machine, which may differ between ranks; the join compares every other flag.
PER_RANK = {"rank", "master_addr", "master_port", "init_timeout", "rpc_timeout",
            "rpc_transport", "summary_json", "torchrun"}

class _ShowDefaults(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):  # a default of None: the help says what unset means
        return action.help if action.default is None else super()._get_help_string(action)

class ArgumentParser(argparse.ArgumentParser):
    """Every default in --help; no abbreviations, lest a typo pass for another flag."""

    def __init__(self, **kwargs):
        super().__init__(formatter_class=_ShowDefaults, allow_abbrev=False, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")

def checked(kind, convert, accepts, requirement):
    """An argument type; argparse names `kind` if convert fails. accepts() compares: nan fails."""
    def parse(text):
        if not accepts(value := convert(text)):
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {text}")
        return value
    parse.__name__ = kind
    return parse

def int_at_least(low):
    return checked(f"integer (>= {low})", int, lambda value: value >= low, f"at least {low}")

positive_float = checked("number (> 0)", float, lambda v: v > 0, "greater than 0")
unit_interval = checked("number (0 to 1)", float, lambda v: 0 <= v <= 1, "from 0 to 1")
probability = checked("number (0 to < 1)", float, lambda v: 0 <= v < 1, "from 0 to less than 1")
port_number = checked("port", int, lambda v: 1 <= v <= 65535, "a port number from 1 to 65535")

def add_arguments(parser, world_size, min_world_size, roles, rpc_transport, profiled=True):
    """The flags of every example, before its own; rpc_transport None: no RPC; profiled=False:
    it profiles itself."""
    add, parser.min_world_size = parser.add_argument, min_world_size
    add("--world_size", "--world-size", type=int_at_least(min_world_size), default=world_size,
        metavar="N", help=f"total number of processes: {roles}")
    add("--rank", type=int_at_least(0), default=None, metavar="R",
        help="only this rank; start the others, in any order, with the same flags (but those of "
             "a rank's machine: addresses, timeouts, paths). Default: all, or torchrun's RANK")
    add("--master_addr", "--master-addr", default="localhost", metavar="ADDR",
        help="address of rank 0; other than localhost, on a trusted network only")
    add("--master_port", "--master-port", type=port_number, default=29500, metavar="PORT",
        help="port of rank 0's rendezvous, where every rank meets")
    add("--init_timeout", "--init-timeout", type=positive_float, default=60.0, metavar="SECONDS",
        help="seconds to wait for every rank to join")
    add("--rpc_timeout", "--rpc-timeout", type=positive_float, default=60.0, metavar="SECONDS",
        help="seconds before an RPC without an answer fails, or a silent rank counts as lost")
    if rpc_transport:  # None: no RPC
        add("--rpc_transport", "--rpc-transport", choices=("auto", "tcp"), default=rpc_transport,
            help="between ranks of a machine: auto lets TensorPipe use shared memory, quickest "
                 "but polled without pause; tcp, loopback sockets")
    add("--seed", type=int_at_least(0), default=1, metavar="N", help="random seed")
    add("--summary_json", "--summary-json", default=None, metavar="PATH",
        help="write the run's figures to this JSON file at the end")
    if profiled:
        add("--profile", default=None, metavar="DIR",
            help="profile every rank into DIR/<its name>.json, merged into DIR/timeline.json "
                 "(https://ui.perfetto.dev): --profile_steps steps of the ranks that loop")
        add("--profile_steps", "--profile-steps", type=int_at_least(1), default=3, metavar="N",
            help="how many steps of each looping rank --profile records")

def parse_args(parser, argv, names, summary, heavy=None, loops=None, per_rank=()):
    """The checked command line (or torchrun's). Roles, f(rank, world_size): names; heavy, ranks
    that compute; loops, that call profile_step(). summary(args, reports) -> (figures, line)."""
    global parsed
    args = parser.parse_args(argv)
    args.torchrun = args.rank is None and {"RANK", "WORLD_SIZE", "MASTER_PORT"} <= set(os.environ)
    if args.torchrun:
        args.rank, args.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        args.master_addr = os.environ.get("MASTER_ADDR", args.master_addr)
        args.master_port = int(os.environ["MASTER_PORT"])
        if args.world_size < parser.min_world_size:
            parser.error(f"this example needs at least {parser.min_world_size} processes, "
                         f"torchrun started {args.world_size}")
    if args.rank is not None and args.rank >= args.world_size:
        parser.error(f"--rank {args.rank} is outside a world of {args.world_size} "
                     f"(ranks 0 to {args.world_size - 1})")
    try:
        socket.getaddrinfo(args.master_addr, args.master_port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as err:  # UnicodeError: not a host name at all
        parser.error(f"--master_addr {args.master_addr}: no such host "
                     f"({getattr(err, 'strerror', None) or 'not a valid host name'})")
    if not args.torchrun and args.rank in (None, 0):
        try:
            listen(args.master_addr, args.master_port).close()
        except OSError as err:
            parser.error(f"cannot listen on {args.master_addr}:{args.master_port} "
                         f"({os.strerror(err.errno)}); if another run uses the port, choose "
                         f"another --master_port; if this run's rank 0 does, this rank is taken")
    if getattr(args, "profile_steps", None) and args.profile:
        check_folder(parser, args.profile)
    world, shared = range(args.world_size), set(vars(args)) - PER_RANK - set(per_rank)
    args.harness = SimpleNamespace(
        names=[names(rank, args.world_size) for rank in world],
        heavy=[rank for rank in world if heavy is None or heavy(rank, args.world_size)],
        loops=None if loops is None else [rank for rank in world if loops(rank, args.world_size)],
        flags={"script": os.path.basename(sys.argv[0]), **{key: vars(args)[key] for key in shared}},
        summary=summary, started=STARTED, spawned=False)
    parsed = args
    return args

def listen(addr, port):
    return socket.create_server((addr, port), family=socket.getaddrinfo(addr, port)[0][0])

def check_folder(parser, folder):
    """--profile's folder, made if missing."""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as err:
        parser.error(f"--profile {folder}: cannot make that folder ({err.strerror or err})")
    if not os.access(folder, os.W_OK | os.X_OK):
        parser.error(f"--profile {folder}: cannot write in that folder")
