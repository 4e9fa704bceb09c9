"""How the ranks meet. init_rpc() and init_process_group() take their store from the handler
that torch calls for "harness://" (torch's extension point for an init_method scheme). The first
call joins every rank where MASTER_ADDR and MASTER_PORT say, as env:// does: rank 0 hosts the
store there (torchrun's agent hosts it under torchrun), each rank claims its rank with its flags,
and every rank waits, up to --init_timeout, for every claim. Flags that differ, a rank taken
twice, or ranks that never come end every rank that is there, in one line. Then each rank
connects to rank 0 for the watch (rank.py), and the join installs what rank.install() lists."""

import datetime
import ipaddress
import json
import os
import secrets
import socket
import sys
import time
from pathlib import Path

import torch.distributed as dist
import torch.distributed.rpc as rpc

from . import profiling, rank
from .cli import listen
from .compat import host_store

SCHEME = "harness"
INIT_METHOD = f"{SCHEME}://"
_KEYS = "rpc_harness/"  # the prefix of this harness's keys in the store (torchrun's has others)
POLL_SECONDS = 0.05  # the store wakes no client when a key appears: claims are polled
# How long rank 0, which holds the store, stays after the verdict for the ranks that are there
# to read it, once its own --init_timeout has passed (they poll every POLL_SECONDS).
READ_SECONDS = 5.0

# The command line that options() or init_method() was given, for the handler, which torch
# calls with the URL alone; and whether the handler is registered with torch.
_args = None
_registered = False
def options(args, num_worker_threads=16):
    """init_rpc's rpc_backend_options: TensorPipe's, meeting through this harness, with
    --rpc_timeout, and TCP alone between ranks of one machine if --rpc_transport says tcp."""
    _use(args)
    transports = ["uv"] if args.rpc_transport == "tcp" else None
    return rpc.TensorPipeRpcBackendOptions(init_method=INIT_METHOD,
                                           num_worker_threads=num_worker_threads,
                                           rpc_timeout=args.rpc_timeout, _transports=transports)


def init_method(args):
    """init_process_group's init_method: the same meeting as options()."""
    _use(args)
    return INIT_METHOD


def _use(args):
    """Keep this rank's command line for the join, and register the handler (once)."""
    global _args, _registered
    _args = args
    if not _registered:
        dist.register_rendezvous_handler(SCHEME, _rendezvous)
        _registered = True


def _rendezvous(url, timeout=None, **kwargs):
    """torch's rendezvous handler: yields (store, rank, world_size); the first call joins every
    rank of the command line's world (ddp_rpc_hybrid's trainers call init_process_group, for a
    group of the trainers alone, before init_rpc)."""
    query = dict(pair.split("=") for pair in url.partition("?")[2].split("&"))
    this_rank, world_size = int(query["rank"]), int(query["world_size"])
    this = rank.current()
    if this is None:
        this = _join(this_rank, _args.world_size)
    yield this.store, this_rank, world_size


def _join(this_rank, world_size):
    """Join every rank of the world; this rank's state (rank.Rank), its store, --profile and
    its watch set up."""
    args = _args
    this = rank.install(args, this_rank)
    name = this.name
    addr = os.environ["MASTER_ADDR"]
    port = int(os.environ["MASTER_PORT"])
    where = f"{addr}:{port}"
    if not args.harness.spawn_all:
        print(f"{name} (rank {this_rank} of {world_size}): waiting for the other ranks at "
              f"{where}, up to {args.init_timeout:g} s")
    deadline = time.monotonic() + args.init_timeout
    _choose_network_interface(addr)
    watch_socket = listen(addr, 0) if this_rank == 0 else None  # where the others reach rank 0
    store = _open_store(args, this_rank, addr, port, deadline)
    token = secrets.token_hex(8)
    claims = _meet(store, this_rank, world_size, watch_socket, token, deadline, where)
    try:
        if this_rank == 0:
            peers = _accept_peers(watch_socket, claims, deadline)
        else:
            peers = {0: _connect_to_rank_0(addr, claims, this_rank, token, deadline)}
    except OSError as err:  # a rank, or rank 0, went away meanwhile
        rank.end(f"{name}: lost a rank while joining at {where} ({err})", 1)
    print(f"{name}: joined the other {world_size - 1} rank(s); {rank.threads_line()}")
    profile = None
    if getattr(args, "profile", None) and args.harness.loops is not None:
        rank_0 = claims[0]
        profile = profiling.Profile(args, this_rank, name, store,
                                    f"{rank_0['host']}:{rank_0['pid']}")
    rank.joined(store, claims, profile, peers)
    return this


def _open_store(args, this_rank, addr, port, deadline):
    """Rank 0 hosts the store (but under torchrun, whose agent does); the others reach it,
    waiting up to --init_timeout for it to come."""
    name = args.harness.names[this_rank]
    rank_0 = f"{args.harness.names[0]} (rank 0)"
    where = f"{addr}:{port}"
    timeout = datetime.timedelta(seconds=args.init_timeout)
    try:
        if this_rank == 0 and not args.torchrun:
            return host_store(listen(addr, port), args.init_timeout)
        if not _wait_for_a_listener(addr, port, deadline):
            rank.end(f"{name}: {rank_0} did not come: nothing answered at {where} within "
                     f"{args.init_timeout:g} s (--init_timeout); start it with the same flags", 1)
        return dist.TCPStore(addr, port, is_master=False, timeout=timeout)
    except OSError as err:  # rank 0's port, taken since the command line was checked
        rank.end(f"{name}: cannot listen on {where} ({err.strerror})", 2)
    except RuntimeError as err:  # torch's DistNetworkError: rank 0's store went away meanwhile
        # On torch 2.4 a signal cuts the client's wait short with an error: then the rank's
        # loop ends the rank, with its line and status, within this second.
        time.sleep(1)
        message = str(err).splitlines()[0] if str(err) else type(err).__name__
        rank.end(f"{name}: cannot reach {rank_0}'s store at {where} ({message})", 1)


def _wait_for_a_listener(addr, port, deadline):
    """Whether something listens at addr:port before the deadline (polled). torch's store client
    retries past its own timeout: 12 s for a timeout of 8 on torch 2.15, more on a busy machine;
    with rank 0 there, it connects at once."""
    while True:
        seconds_left = deadline - time.monotonic()
        try:
            socket.create_connection((addr, port), timeout=max(0.1, min(1.0, seconds_left))).close()
            return True
        except OSError:  # refused, or no answer yet
            if seconds_left <= 0:
                return False
            time.sleep(min(POLL_SECONDS * 4, max(0.0, seconds_left)))


def _meet(store, this_rank, world_size, watch_socket, token, deadline, where):
    """Claim this rank, then wait for every rank's claim. The first to see flags that differ
    from rank 0's, or its deadline pass with ranks missing, writes the verdict; every rank that
    reads it ends with it. Rank 0's process holds the store, so it stays until every rank has
    read the verdict, or until its deadline has passed and every rank that came has read it
    (READ_SECONDS at most after the verdict)."""
    args = _args
    names = args.harness.names
    world = range(world_size)
    mine = {"name": names[this_rank], "flags": args.harness.flags, "pid": os.getpid(),
            "host": socket.gethostname(), "token": token,
            "port": watch_socket.getsockname()[1] if watch_socket else None}
    try:
        _claim(store, this_rank, json.dumps(mine))
        claims = {}
        verdict = None
        while verdict is None:
            for other in world:
                key = f"{_KEYS}rank{other}"
                if other not in claims and store.check([key]):
                    claims[other] = json.loads(store.get(key))
            if store.check([f"{_KEYS}verdict"]):
                verdict = store.get(f"{_KEYS}verdict")
                break
            difference = _differences(claims) if 0 in claims else ""
            missing = [f"{names[other]} (rank {other})" for other in world if other not in claims]
            if difference:
                verdict = _decide(store, 2, difference)
            elif not missing:
                return claims
            elif time.monotonic() > deadline:
                them = "them" if len(missing) > 1 else "it"
                verdict = _decide(store, 1, f"{', '.join(missing)} did not join at {where} "
                                            f"within {args.init_timeout:g} s (--init_timeout); "
                                            f"start {them} with the same flags")
            else:
                time.sleep(POLL_SECONDS)
        store.add(f"{_KEYS}read the verdict", 1)
        status, message = json.loads(verdict)
        if this_rank == 0:
            rank.say(f"{names[0]}: {message}")
            _stay_until_the_verdict_is_read(store, world_size, deadline)
            rank.end(None, status)
    except RuntimeError as err:  # the store went away: rank 0 ended meanwhile
        rank.end(f"{names[this_rank]}: {names[0]} (rank 0) went away while the ranks were "
                 f"joining at {where} ({str(err).splitlines()[0]})", 1)
    rank.end(f"{names[this_rank]}: {message}", status)


def _stay_until_the_verdict_is_read(store, world_size, deadline):
    """Rank 0, which holds the store: until every rank has read the verdict, or, once its
    deadline has passed, every rank that came (READ_SECONDS at most after that)."""
    last = max(deadline, time.monotonic()) + READ_SECONDS
    while time.monotonic() < last:
        read = store.add(f"{_KEYS}read the verdict", 0)
        came = sum(store.check([f"{_KEYS}rank{other}"]) for other in range(world_size))
        if read >= world_size or (read >= came and time.monotonic() > deadline):
            return
        time.sleep(POLL_SECONDS)


def _decide(store, status, message):
    """Write the verdict unless another rank wrote one first; the verdict that stands."""
    return store.compare_set(f"{_KEYS}verdict", "", json.dumps([status, message]))


def _claim(store, this_rank, mine):
    """Take this rank's key, unless a live process holds it (on Linux, a holder on this machine
    that has gone is replaced: a rank started again after it was killed)."""
    key = f"{_KEYS}rank{this_rank}"
    held = store.compare_set(key, "", mine).decode()
    if held == mine:
        return
    holder = json.loads(held)
    gone = (holder["host"] == socket.gethostname() and sys.platform.startswith("linux")
            and not Path(f"/proc/{holder['pid']}").exists())
    if gone:
        held = store.compare_set(key, held, mine).decode()
        if held == mine:
            return
        holder = json.loads(held)
    rank.end(f"{_args.harness.names[this_rank]}: rank {this_rank} is taken: process "
             f"{holder['pid']} on {holder['host']} joined as rank {this_rank} first; give every "
             "rank its own --rank", 2)


def _differences(claims):
    """One line naming every flag of every rank that differs from rank 0's, or ''."""
    first = claims[0]
    differences = []
    for other, claim in sorted(claims.items()):
        keys = sorted(set(first["flags"]) | set(claim["flags"]),
                      key=lambda key: (key != "world_size", key))
        for key in keys:
            ours = first["flags"].get(key)
            theirs = claim["flags"].get(key)
            if ours != theirs:
                flag = key if key == "script" else f"--{key}"
                differences.append(f"{flag} is {_shown(ours)} on rank 0 ({first['name']}) but "
                                   f"{_shown(theirs)} on rank {other} ({claim['name']})")
    if not differences:
        return ""
    return ("the ranks were started with different flags: " + "; ".join(differences)
            + "; start every rank with the same values")


def _shown(value):
    if value is None:
        return "unset"
    if isinstance(value, list):
        return " ".join(map(str, value))
    return value


def _accept_peers(watch_socket, claims, deadline):
    """Rank 0: a connection from every other rank, each proven by the token of its claim.
    Anything else that connects (a stray, a short or a second connection) is closed and
    ignored."""
    peers = {}
    while len(peers) < len(claims) - 1:
        watch_socket.settimeout(max(1.0, deadline - time.monotonic()))
        sock, _ = watch_socket.accept()  # socket.timeout (an OSError) past the deadline
        sock.settimeout(5.0)
        try:
            words = sock.makefile("rb").readline(100).split()
        except OSError:
            words = []
        claimed = int(words[0]) if len(words) == 2 and words[0].isdigit() else None
        if (claimed in claims and claimed != 0 and claimed not in peers
                and words[1] == claims[claimed]["token"].encode()):
            sock.settimeout(None)
            peers[claimed] = sock
        else:
            sock.close()
    return peers


def _connect_to_rank_0(addr, claims, this_rank, token, deadline):
    """A rank's connection to rank 0, which it opens with its rank and its claim's token."""
    timeout = max(1.0, deadline - time.monotonic())
    sock = socket.create_connection((addr, claims[0]["port"]), timeout=timeout)
    sock.sendall(f"{this_rank} {token}\n".encode())
    sock.settimeout(None)
    return sock


def _choose_network_interface(addr):
    """For TensorPipe, Gloo and NCCL, the interface towards MASTER_ADDR, unless set already:
    for a local run, loopback, so that nothing listens on the network (RPC runs unauthenticated
    pickles); never the host name's 127.0.1.1. Linux: the interface of an address is read with
    SIOCGIFADDR."""
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, 1, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(sockaddr)  # chooses the route; a UDP connect sends nothing
        local = probe.getsockname()[0]
    name = None
    for _, interface in socket.if_nameindex():
        if _ipv4_address(interface) == local:
            name = interface
            break
    if name is None and ipaddress.ip_address(local).is_loopback:
        name = "lo"
    if name is None:
        return
    for variable in ("TP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        os.environ.setdefault(variable, name)


def _ipv4_address(interface):
    """The IPv4 address of a network interface (Linux's SIOCGIFADDR), or None."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    request = struct.pack("256s", interface.encode()[:15])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            answer = fcntl.ioctl(sock.fileno(), siocgifaddr, request)
        except OSError:  # no IPv4 address
            return None
    return socket.inet_ntoa(answer[20:24])
