"""rpcrun's command line, and what it reads of the command it supervises.

    rpcrun [--join_timeout S] [--lost_timeout S] [--port P] SCRIPT [ARGS...]

SCRIPT ARGS is the example's own command (`python SCRIPT ARGS`), run as it is. Of its flags,
rpcrun reads only --world_size, --rank, --master_addr, --master_port and --profile; where one is
not given, the default that SCRIPT's folder declares for it (`add_argument("--world_size", ...,
default=4)`, read with `ast`, never by importing it). The rest of ARGS it compares between the
ranks, as text."""

import argparse
import ast
import ipaddress
import os
import socket
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path

# The flags that describe a rank's own machine or part, which may differ between ranks; the
# meeting compares the others. --world_size and --master_port are compared by their values.
PER_RANK_FLAGS = {"rank", "master_addr", "master_port", "world_size", "summary_json",
                  "profile", "data_dir"}

# The examples' defaults where their scripts declare none that can be read (CONVENTIONS.md).
DEFAULT_MASTER_ADDR = "localhost"
DEFAULT_MASTER_PORT = 29500

# rpcrun's own port is the command's --master_port less this (29400 for 29500, as torchrun's
# rendezvous): not --master_port + 1, which the DDP tutorial's RPC takes.
PORT_OFFSET = 100


@dataclass
class Command:
    """What the supervisor knows of the command it runs: the script and its arguments, and, of
    those, what it needs to meet the other ranks' supervisors."""

    script: Path  # the example's script, as given
    argv: list  # the arguments after it
    world_size: int | None  # --world_size, or the script's default; None: unknown
    rank: int | None  # --rank; None: the command starts every rank (mp.spawn)
    master_addr: str
    master_port: int | None
    profile: str | None  # --profile DIR
    join_timeout: float
    lost_timeout: float
    port: int | None  # where the supervisors meet (rank 0's listens)
    flags: dict = field(default_factory=dict)  # flag -> values, as the ranks must share them

    @property
    def program(self):
        """The script as the ranks compare it: its folder and name ("param_server/main.py")."""
        resolved = self.script.resolve()
        return f"{resolved.parent.name}/{resolved.name}"

    @property
    def meets(self):
        """Whether this command is one rank of several that meet: --rank R of a world of W,
        both sensible. Otherwise (every rank here, --help, or flags that the script itself
        will refuse) it runs alone, and its script says what is wrong."""
        return (self.rank is not None and self.world_size is not None
                and self.world_size >= 2 and 0 <= self.rank < self.world_size
                and self.master_port is not None and self.port is not None)

    @property
    def local(self):
        """Whether every rank runs on this machine: the ranks meet on a loopback address, or
        this command starts them all."""
        return self.rank is None or is_loopback(self.master_addr)

    @property
    def ranks_here(self):
        """How many ranks share this machine's cores, or None where that is unknown (ranks of
        other machines meet at --master_addr)."""
        return self.world_size if self.local else None


def parser():
    """rpcrun's own flags, before SCRIPT."""
    made = argparse.ArgumentParser(
        prog="rpcrun",
        usage="rpcrun [options] SCRIPT [ARGS...]",
        description="Run an example's command (python SCRIPT ARGS) under a supervisor, in every "
                    "terminal of a run: the ranks' supervisors meet before the ranks start, every "
                    "wait is bounded, and when one rank fails, is killed, stopped or interrupted, "
                    "every terminal ends with one line that says so and nothing is left running. "
                    "See docs/rpcrun.md.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False)
    made.add_argument("--join_timeout", "--join-timeout", type=positive_seconds, default=60.0,
                      metavar="SECONDS", help="how long the ranks may take to come")
    made.add_argument("--lost_timeout", "--lost-timeout", type=positive_seconds, default=30.0,
                      metavar="SECONDS",
                      help="a rank whose supervisor is silent, or whose process is stopped "
                           "(SIGSTOP), this long is lost")
    made.add_argument("--port", type=port_number, default=None,
                      help=f"where the ranks' supervisors meet, on --master_addr (default: "
                           f"--master_port - {PORT_OFFSET})")
    made.add_argument("script", metavar="SCRIPT", help="the example's script (main.py, ...)")
    made.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS",
                      help="the script's own arguments")
    return made


def positive_seconds(text):
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0, got {text}")
    return value


def port_number(text):
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port from 1 to 65535, got {text}")
    return value


def parse(argv=None):
    """rpcrun's command line, and what it reads of the script's; bad input of its own: one
    line, status 2. Under torchrun (RANK and WORLD_SIZE set) it refuses: torchrun's agent
    supervises its own workers."""
    made = parser()
    args = made.parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        made.error("RANK and WORLD_SIZE are set, as torchrun sets them for its workers: torchrun "
                   "supervises its own ranks; run the script under torchrun without rpcrun")
    script = Path(args.script)
    if not script.is_file():
        made.error(f"{args.script}: no such file")
    given = script_flags(args.args)
    defaults = declared_defaults(script)
    master_port = integer(first(given, "master_port", defaults) or DEFAULT_MASTER_PORT)
    port = args.port
    if port is None and master_port is not None and 1 <= master_port <= 65535:
        above = master_port > PORT_OFFSET
        port = master_port - PORT_OFFSET if above else master_port + PORT_OFFSET
    asks_for_help = "-h" in args.args or "--help" in args.args
    return Command(
        script=script,
        argv=list(args.args),
        world_size=integer(first(given, "world_size", defaults)),
        rank=None if asks_for_help else integer(first(given, "rank", {})),
        master_addr=first(given, "master_addr", defaults) or DEFAULT_MASTER_ADDR,
        master_port=master_port,
        profile=first(given, "profile", {}),
        join_timeout=args.join_timeout,
        lost_timeout=args.lost_timeout,
        port=port,
        flags={name: values for name, values in given.items() if name not in PER_RANK_FLAGS},
    )


def script_flags(argv):
    """The script's arguments as {flag: (values...)}: `--flag value`, `--flag=value`,
    `--flag v1 v2` (nargs) and a bare `--flag`; hyphens and underscores alike (`--world-size`
    is world_size). Words before the first flag are under ""."""
    flags = {}
    name = ""
    for word in argv:
        if word.startswith("--") and len(word) > 2:
            name, equals, value = word[2:].partition("=")
            name = name.replace("-", "_")
            flags[name] = (value,) if equals else ()
        elif word.startswith("-") and len(word) > 1 and not is_number(word):
            name = word  # a short flag, kept as written
            flags[name] = ()
        else:
            flags[name] = flags.get(name, ()) + (word,)
    return flags


def is_number(word):
    try:
        float(word)
    except ValueError:
        return False
    return True


def first(given, name, defaults):
    """A flag's value: the last one given (argparse keeps the last), else its default."""
    if given.get(name):
        return given[name][-1]
    return defaults.get(name)


def integer(value):
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def declared_defaults(script):
    """The defaults of --world_size, --master_addr and --master_port that the script, or a
    module beside it that it imports, declares as literals in an add_argument call (the script
    first)."""
    wanted = {"world_size", "master_addr", "master_port"}
    found = {}
    for tree in script_modules(script):
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "add_argument"):
                continue
            names = {arg.value[2:].replace("-", "_") for arg in node.args
                     if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
                     and arg.value.startswith("--")}
            default = next((keyword.value for keyword in node.keywords
                            if keyword.arg == "default"), None)
            if not isinstance(default, ast.Constant) or default.value is None:
                continue
            for name in names & wanted:
                found.setdefault(name, str(default.value))
    return found


def script_modules(script):
    """The parsed script, then the modules beside it that it imports by their plain names
    (`from extras import ...`), and theirs in turn."""
    todo, seen = [script], []
    while todo:
        path = todo.pop(0)
        if path in seen:
            continue
        seen.append(path)
        try:
            tree = ast.parse(path.read_text())
        except (OSError, SyntaxError, ValueError):
            continue
        yield tree
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            todo += [script.parent / f"{name}.py" for name in names
                     if (script.parent / f"{name}.py").is_file()]


def is_loopback(addr):
    """Whether addr names this machine's loopback (localhost, 127.0.0.1, ::1)."""
    try:
        resolved = socket.getaddrinfo(addr, None)[0][4][0]
        return ipaddress.ip_address(resolved.split("%")[0]).is_loopback
    except (OSError, ValueError, UnicodeError):
        return False


def loopback_interface():
    """The name of this machine's loopback interface ("lo" on Linux, "lo0" elsewhere)."""
    names = [name for _, name in socket.if_nameindex()]
    return next((name for name in names if name.startswith("lo")), "lo")


def interface_towards(addr):
    """The name of the network interface whose address this machine would send from to reach
    addr (a UDP socket's connect() asks the routing table and sends nothing), or None where that
    cannot be found: no route, or a system without SIOCGIFADDR (Linux's ioctl, read with fcntl)."""
    try:
        # any port: the route depends on the address alone
        family, _, _, _, destination = socket.getaddrinfo(addr, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(destination)
            local = probe.getsockname()[0]
    except (OSError, UnicodeError):
        return None
    if ipaddress.ip_address(local.split("%")[0]).is_loopback:
        return loopback_interface()
    return next((name for _, name in socket.if_nameindex() if _ipv4_address(name) == local), None)


def _ipv4_address(interface):
    """The IPv4 address of a network interface, or None (none, or not Linux)."""
    try:
        import fcntl
    except ImportError:  # Windows
        return None
    siocgifaddr = 0x8915  # Linux's ioctl for an interface's address
    request = struct.pack("256s", interface.encode()[:15])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            answer = fcntl.ioctl(sock.fileno(), siocgifaddr, request)
        except OSError:  # no IPv4 address, or not Linux
            return None
    return socket.inet_ntoa(answer[20:24])


def cores():
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def child_environment(command, environ=None):
    """The child's environment: the supervisor's, with what rpcrun sets unless it is set already
    (docs/rpcrun.md says why each): OMP_NUM_THREADS, the ranks' share of this machine's cores;
    TensorPipe, Gloo and NCCL on the interface towards --master_addr (loopback for a loopback
    address);
    TORCH_CPP_LOG_LEVEL=ERROR; with --profile, KINETO_LOG_LEVEL=6; and PYTHONUNBUFFERED left out.
    Returns (environment, the names it changed)."""
    env = dict(os.environ if environ is None else environ)
    wanted = {"TORCH_CPP_LOG_LEVEL": "ERROR"}
    if command.ranks_here:
        wanted["OMP_NUM_THREADS"] = str(max(1, cores() // command.ranks_here))
    # Left alone, TensorPipe and Gloo listen on the address of the host's name: on many
    # machines 127.0.1.1, which no other machine reaches, or an address open to the network
    # for a run that never leaves this one.
    interface = interface_towards(command.master_addr)
    if interface:
        for name in ("TP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            wanted[name] = interface
    if command.profile:
        wanted["KINETO_LOG_LEVEL"] = "6"
    set_here = []
    for name, value in wanted.items():
        if not env.get(name):
            env[name] = value
            set_here.append(name)
    # Unbuffered, Python writes a line in pieces (print("a", 1): four writes), and two ranks'
    # pieces run into one line; on the pty, line-buffered, each line is one write, at once.
    if env.pop("PYTHONUNBUFFERED", None) is not None:
        set_here.append("PYTHONUNBUFFERED")
    return env, set_here


def threads_line(command, env, set_here):
    """The line that says, once, how many threads each rank computes with, or None."""
    if "OMP_NUM_THREADS" not in set_here:
        return None
    ranks = command.ranks_here
    each = "each rank" if command.rank is None else f"rank {command.rank}"
    return (f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']} for {each}: {ranks} ranks share "
            f"{cores()} cores here (set OMP_NUM_THREADS to choose)")


if __name__ == "__main__":  # for a look at what rpcrun reads: python -m rpc_harness.command ...
    print(parse(sys.argv[1:]))
