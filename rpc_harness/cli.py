"""The command line of every program: argparse's parser with one-line errors, argument types
that refuse bad values, the flags this project adds, and the checks that argparse cannot make.
Bad input ends the command here in one line, with status 2, before any rank starts or any port
opens. check_args() records in args.harness (a Plan) what the harness needs in every rank."""

import argparse
import contextlib
import os
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

# The summary's seconds count from here, as a program imports rpc_harness (after torch).
STARTED = time.time()

# The cores this process may run on, which the ranks on this machine share.
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()

# Flags that describe a rank's own machine, which may differ between ranks; the join compares
# every other flag.
PER_RANK = {"rank", "master_addr", "master_port", "init_timeout", "rpc_timeout",
            "rpc_transport", "summary_json", "profile", "torchrun", "harness"}


@dataclass
class Plan:
    """What every rank needs to know of the run, from the command line (args.harness)."""

    names: list  # each rank's name, by rank
    program: str  # the folder and script that runs ("param_server/main.py")
    flags: dict  # the flags that every rank must share, which the join compares
    threads: dict  # rank -> its intra-op threads, for the ranks on this machine
    computes: list  # the ranks that do the heavy computing
    loops: list | None  # the ranks that call profile_step() (None: the program profiles itself)
    summary: object  # summary(args, figures by rank name) -> (figures, line), on rank 0
    rank: int | None  # the rank this command starts (--rank, torchrun's); None: every rank
    records: str | None = None  # the command's folder for the ranks' records (supervise())
    parent: int = field(default_factory=os.getppid)  # the process that started the command
    started: float = field(default=STARTED)

    @property
    def spawn_all(self):
        """Whether this command starts every rank (mp.spawn)."""
        return self.rank is None


class _ShowDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Every default in --help, except None (there the help text says what unset means) and
    where the help text gives it already (the tutorials' "(default: 0.99)")."""

    def _get_help_string(self, action):
        if action.default is None or "(default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with every default in --help, no abbreviated flags (a typo must not
    pass for another flag), each flag spelled with hyphens too (--world-size for --world_size,
    and the other way round), and errors in one line: "main.py: error: ...", status 2."""

    def __init__(self, **kwargs):
        kwargs.setdefault("formatter_class", _ShowDefaults)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(**kwargs)

    def add_argument(self, *names, **kwargs):
        """argparse's, with each --flag_name also spelled --flag-name, and the other way round."""
        spellings = list(names)
        for name in names:
            if not name.startswith("--"):
                continue
            for other in ("--" + name[2:].replace("_", "-"), "--" + name[2:].replace("-", "_")):
                if other not in spellings:
                    spellings.append(other)
        return super().add_argument(*spellings, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def checked(kind, convert, accepts, requirement):
    """An argument type: convert(text), refused unless accepts(value). argparse names `kind`
    when convert fails; `requirement` says what accepts() wants. NaN fails every comparison,
    so it is refused too."""

    def parse(text):
        value = convert(text)
        if not accepts(value):
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {text}")
        return value

    parse.__name__ = kind
    return parse


def int_at_least(low):
    """An integer argument of at least `low`."""
    return checked(f"integer (>= {low})", int, lambda value: value >= low, f"at least {low}")


positive_float = checked("number (> 0)", float, lambda value: value > 0, "greater than 0")
unit_interval = checked("number (0 to 1)", float, lambda value: 0 <= value <= 1, "from 0 to 1")
probability = checked("number (0 to < 1)", float, lambda value: 0 <= value < 1,
                      "from 0 to less than 1")
port_number = checked("port", int, lambda value: 1 <= value <= 65535,
                      "a port number from 1 to 65535")


# --------- The flags this project adds --------------------

def add_shared_arguments(parser, init_timeout_help, profiled=True):
    """The flags of every program, RPC's and Monarch's: --init_timeout, --seed, --summary_json
    and, unless the program profiles itself, --profile and --profile_steps."""
    parser.add_argument("--init_timeout", "--init-timeout", type=positive_float, default=60.0,
                        metavar="SECONDS", help=init_timeout_help)
    with contextlib.suppress(argparse.ArgumentError):  # the tutorial's own --seed, if it has one
        parser.add_argument("--seed", type=int_at_least(0), default=1, metavar="N",
                            help="random seed")
    parser.add_argument("--summary_json", "--summary-json", default=None, metavar="PATH",
                        help="write the run's figures to this JSON file at the end")
    if profiled:
        parser.add_argument("--profile", default=None, metavar="DIR",
                            help="profile every process into DIR/<its name>.json, merged into "
                                 "DIR/timeline.json (https://ui.perfetto.dev): --profile_steps "
                                 "steps of each process that loops, after two warm-up steps")
        parser.add_argument("--profile_steps", "--profile-steps", type=int_at_least(1),
                            default=3, metavar="N", help="how many steps --profile records")


def add_arguments(parser, rpc_transport="tcp", profiled=True):
    """Add the flags that this project adds to every RPC program: the bounds of every wait, the
    transport between ranks of one machine (None: the program has no RPC), and the shared ones
    (profiled=False: the program profiles itself)."""
    add_shared_arguments(parser, "seconds to wait for every rank to join", profiled)
    parser.add_argument("--rpc_timeout", "--rpc-timeout", type=positive_float, default=60.0,
                        metavar="SECONDS",
                        help="seconds before an RPC without an answer fails, or a silent rank "
                             "counts as lost")
    if rpc_transport is not None:
        parser.add_argument("--rpc_transport", "--rpc-transport", choices=("auto", "tcp"),
                            default=rpc_transport,
                            help="between ranks of one machine: auto lets TensorPipe use shared "
                                 "memory, quickest but polled without pause; tcp, loopback "
                                 "sockets")


# --------- What argparse cannot check --------------------

def check_args(parser, args, worker_name, computes=None, loops=None, summary=None,
               per_rank=(), min_world_size=2):
    """Check what argparse cannot, before any rank starts: bad input ends the command in one
    line, status 2. Under torchrun (RANK and WORLD_SIZE set, no --rank), take its rank and world
    size. Then record in args.harness (a Plan) what the harness needs in every rank:

    worker_name(rank, world_size): each rank's name; computes(rank, world_size): whether the
    rank does the heavy computing, and so shares this machine's cores with the others that do
    (the others get one thread); loops(rank, world_size): whether the rank calls profile_step()
    (None: the program profiles itself); summary(args, reports) -> (figures, line): the run's
    summary, which rank 0 writes at the end; per_rank: the program's flags that may differ
    between ranks (paths of a rank's own machine). The tutorial's own flags are checked here
    too, whose types argparse takes from the tutorial (`type=int`): --world_size, at least
    min_world_size; --rank; --master_port, a port number."""
    args.torchrun = args.rank is None and "RANK" in os.environ and "WORLD_SIZE" in os.environ
    omp_num_threads(parser)
    if args.torchrun:  # its agent's rank, world and store, as env:// takes them
        args.rank = int(os.environ["RANK"])
        args.world_size = _torchrun_world_size(parser, os.environ["WORLD_SIZE"])
        args.master_addr = os.environ.get("MASTER_ADDR", args.master_addr)
        args.master_port = type(args.master_port)(os.environ.get("MASTER_PORT",
                                                                 args.master_port))
    if args.world_size < min_world_size:
        what = (f"torchrun started {args.world_size} processes: the world size" if args.torchrun
                else "argument --world_size:")
        parser.error(f"{what} must be at least {min_world_size}, got {args.world_size}")
    if args.rank is not None and args.rank < 0:
        parser.error(f"argument --rank: must be at least 0, got {args.rank}")
    try:
        port_number(str(args.master_port))
    except (ValueError, argparse.ArgumentTypeError):
        parser.error(f"argument --master_port: must be a port number from 1 to 65535, got "
                     f"{args.master_port}")
    if args.rank is not None and args.rank >= args.world_size:
        parser.error(f"--rank {args.rank} is outside a world of {args.world_size} "
                     f"(ranks 0 to {args.world_size - 1})")
    _check_address(parser, args)
    if getattr(args, "profile", None) and loops is not None:
        check_folder(parser, "--profile", args.profile)
    if args.summary_json and args.rank in (None, 0):  # rank 0 writes it
        check_file(parser, "--summary_json", args.summary_json)
    world = range(args.world_size)
    computing = [rank for rank in world if computes and computes(rank, args.world_size)]
    shared = sorted(set(vars(args)) - PER_RANK - set(per_rank))
    script = Path(sys.argv[0]).resolve()
    args.harness = Plan(
        names=[worker_name(rank, args.world_size) for rank in world],
        program=f"{script.parent.name}/{script.name}",
        flags={key: getattr(args, key) for key in shared},
        threads=threads_per_rank(args, computing),
        computes=computing,
        loops=None if loops is None else [rank for rank in world if loops(rank, args.world_size)],
        summary=summary,
        rank=args.rank,
    )
    return args


def _torchrun_world_size(parser, text):
    """torchrun's WORLD_SIZE, a number."""
    if not text.strip().isdigit():
        parser.error(f"torchrun's WORLD_SIZE is {text}, not a number of processes")
    return int(text)


def _check_address(parser, args):
    """--master_addr must resolve, and where this command hosts the rendezvous (rank 0, or
    every rank), --master_port must be free."""
    try:
        socket.getaddrinfo(args.master_addr, args.master_port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as err:  # UnicodeError: not a host name at all
        reason = getattr(err, "strerror", None) or "not a valid host name"
        parser.error(f"--master_addr {args.master_addr}: no such host ({reason})")
    if args.torchrun or args.rank not in (None, 0):
        return
    try:
        listen(args.master_addr, int(args.master_port)).close()
    except OSError as err:
        parser.error(f"cannot listen on {args.master_addr}:{args.master_port} "
                     f"({os.strerror(err.errno)}); if another run uses the port, choose another "
                     "--master_port; if this run's rank 0 does, this rank is taken")


def check_folder(parser, flag, folder):
    """A folder to write in, made if missing; otherwise one line naming the flag, status 2."""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as err:
        parser.error(f"{flag} {folder}: cannot make that folder ({err.strerror or err})")
    if not os.access(folder, os.W_OK | os.X_OK):
        parser.error(f"{flag} {folder}: cannot write in that folder")


def check_file(parser, flag, path):
    """A file that the run writes at its end: checked before any rank starts, so that a long run
    does not end without it. Its folder must be there and take a new file (one is made and
    removed), and the file, where it is there already, must be a file that can be written;
    otherwise one line naming the flag, status 2."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        parser.error(f"{flag} {path}: that is a folder, not a file")
    if not os.path.isdir(folder):
        parser.error(f"{flag} {path}: no such folder ({folder})")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        parser.error(f"{flag} {path}: cannot write that file")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".rpc_harness-check-"):
            pass
    except OSError as err:
        parser.error(f"{flag} {path}: cannot write in {folder} ({err.strerror or err})")


# --------- Threads --------------------

def omp_num_threads(parser):
    """OMP_NUM_THREADS's threads, or None where it is unset. OpenMP reads a list, one number a
    level of nesting ("4,2"): torch's pool is the first level. Anything else is bad input."""
    text = os.environ.get("OMP_NUM_THREADS", "").strip()
    if not text:
        return None
    first = text.split(",")[0].strip()
    if not first.isdigit() or int(first) < 1:
        parser.error(f"OMP_NUM_THREADS={text}: not a number of threads (a whole number of at "
                     "least 1, or a list of them, as OpenMP reads it)")
    return int(first)


def share_of_the_cores(sharing):
    """The intra-op threads of a process that shares this machine's cores with `sharing - 1`
    others: OMP_NUM_THREADS's first number if set (omp_num_threads() checked it), else its
    share of the cores, at least one."""
    asked = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if asked:
        return int(asked)
    return max(1, CORES // max(1, sharing))


def threads_per_rank(args, computing):
    """{rank: intra-op threads} for the ranks on this machine: the ranks that compute share the
    cores, and the others get one thread each, unless OMP_NUM_THREADS says. A rank on this
    machine alone (--rank with another machine's address) counts as the only one here;
    torchrun says how many of its ranks run here (LOCAL_WORLD_SIZE)."""
    if args.rank is None or args.master_addr in ("localhost", "127.0.0.1", "::1"):
        local = list(range(args.world_size))
    else:
        first = args.rank - int(os.environ.get("LOCAL_RANK", 0))
        local = list(range(first, first + int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    heavy = [rank for rank in local if rank in computing]
    counts = {}
    for rank in local:
        if rank in heavy or os.environ.get("OMP_NUM_THREADS"):
            counts[rank] = share_of_the_cores(len(heavy))
        else:
            counts[rank] = 1
    return counts


# --------- Addresses --------------------

def listen(addr, port):
    """A socket listening on addr:port, with the address family that addr resolves to."""
    family = socket.getaddrinfo(addr, port)[0][0]
    return socket.create_server((addr, port), family=family)


def address_towards(host, port=1):
    """This machine's address on the route to host: what host sees it as. A UDP socket's
    connect() chooses the route and sends nothing."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(sockaddr)
        return probe.getsockname()[0]
