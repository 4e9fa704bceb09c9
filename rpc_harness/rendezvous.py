"""How the ranks meet. init_rpc() and init_process_group() take their store from the handler
that torch calls for "harness://" (torch's extension point for an init_method scheme). The
first call joins every rank where MASTER_ADDR and MASTER_PORT say, as env:// does:

1. rank 0 hosts the store there (torchrun's agent hosts it under torchrun); the others wait for
   it, up to --init_timeout;
2. each rank claims its rank in the store, with its program, its flags and its address;
3. every rank waits for every claim, up to --init_timeout. A program or flags that differ from
   rank 0's, or ranks that never come: the first rank to see it writes the verdict, and every
   rank that reads it ends with it (rank 0, which holds the store, once the others have read
   it). A rank that is taken ends alone;
4. each rank connects to rank 0 for the watch (rank.py), proving itself with its claim's
   token. Any deadline that ends a step ends the rank, in one line (Rank.end)."""

import datetime
import ipaddress
import json
import os
import secrets
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from . import rank as rank_module
from .cli import address_towards, listen
from .compat import host_store
from .profiling import Recorder
from .state import state

SCHEME = "harness"
INIT_METHOD = f"{SCHEME}://"
KEYS = "rpc_harness/"  # the prefix of this harness's keys in the store (torchrun's has others)
POLL_SECONDS = 0.05  # the store wakes no client when a key appears: claims are polled
# How long rank 0, which holds the store, stays after the verdict for the ranks that came to
# read it, once its own --init_timeout has passed (they poll every POLL_SECONDS).
READ_SECONDS = 5.0
# The least time the ranks have to make their watch connections once every rank has joined.
CONNECT_SECONDS = 2.0



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
    if state.joining is None:
        dist.register_rendezvous_handler(SCHEME, _rendezvous)
    state.joining = args


def _rendezvous(url, timeout=None, **kwargs):
    """torch's rendezvous handler: yields (store, rank, world_size); the first call joins every
    rank of the command line's world (ddp_rpc_hybrid's trainers call init_process_group, for a
    group of the trainers alone, before init_rpc)."""
    query = dict(pair.split("=") for pair in url.partition("?")[2].split("&"))
    this = rank_module.current()
    if this is None:
        raise RuntimeError("rpc_harness's rendezvous needs the rank's function marked "
                           "@rpc_harness.watched")
    if this.store is None:
        this.store = _join(this)
    yield this.store, int(query["rank"]), int(query["world_size"])


def _join(this):
    """Join every rank of the world; the store, once this rank's peers are watched."""
    args = state.joining
    name = this.name
    world_size = len(this.names)
    addr = os.environ["MASTER_ADDR"]
    port = int(os.environ["MASTER_PORT"])
    where = f"{addr}:{port}"
    if not args.harness.spawn_all:
        print(f"{name} (rank {this.rank} of {world_size}): waiting for the other ranks at "
              f"{where}, up to {args.init_timeout:g} s")
    deadline = time.monotonic() + args.init_timeout
    _choose_network_interface(addr)
    watch = listen(addr, 0) if this.rank == 0 else None  # where the others reach rank 0
    store = _open_store(this, addr, port, deadline)
    token = secrets.token_hex(8)
    this.claims = _meet(this, store, watch, token, deadline, where)
    connect_by = max(deadline, time.monotonic() + CONNECT_SECONDS)
    try:
        if this.rank == 0:
            peers = accept_peers(watch, this.claims, connect_by)
        else:
            peers = {0: _connect_to_rank_0(addr, this.claims, this.rank, token, connect_by)}
    except OSError as err:  # a rank, or rank 0, went away meanwhile
        this.end(f"{name}: lost a rank while joining at {where} ({err})", 1)
    finally:
        if watch is not None:
            watch.close()
    print(f"{name}: joined the other {world_size - 1} rank(s); {rank_module.threads_line()}")
    if getattr(args, "profile", None) and args.harness.loops is not None:
        this.recorder = _recorder(this, store)
    this.watch(peers)
    return store


def _open_store(this, addr, port, deadline):
    """Rank 0 hosts the store (but under torchrun, whose agent does); the others reach it,
    waiting for it up to the deadline."""
    rank_0 = f"{this.names[0]} (rank 0)"
    where = f"{addr}:{port}"
    try:
        if this.rank == 0 and not state.joining.torchrun:
            return host_store(listen(addr, port), state.joining.init_timeout)
        if not _wait_for_a_listener(addr, port, deadline):
            this.end(f"{this.name}: {rank_0} did not come: nothing answered at {where} within "
                     f"{state.joining.init_timeout:g} s (--init_timeout); start it with the "
                     "same flags", 1)
        seconds_left = max(1.0, deadline - time.monotonic())
        return dist.TCPStore(addr, port, is_master=False,
                             timeout=datetime.timedelta(seconds=seconds_left))
    except OSError as err:  # rank 0's port, taken since the command line was checked
        this.end(f"{this.name}: cannot listen on {where} ({err.strerror or err})", 2)
    except RuntimeError as err:  # torch's DistNetworkError: rank 0's store went away meanwhile
        message = str(err).splitlines()[0] if str(err) else type(err).__name__
        this.end(f"{this.name}: cannot reach {rank_0}'s store at {where} ({message})", 1)


def _wait_for_a_listener(addr, port, deadline):
    """Whether something listens at addr:port before the deadline (polled). torch's store client
    retries past its own timeout (12 s for a timeout of 8 on torch 2.15); with rank 0 there, it
    connects at once."""
    while True:
        seconds_left = deadline - time.monotonic()
        try:
            socket.create_connection((addr, port), timeout=max(0.1, min(1.0, seconds_left))).close()
            return True
        except OSError:  # refused, or no answer yet
            if seconds_left <= 0:
                return False
            time.sleep(min(4 * POLL_SECONDS, max(0.0, seconds_left)))


def _meet(this, store, watch, token, deadline, where):
    """Claim this rank, then wait for every rank's claim. The first rank to see every claim, a
    program or flags that differ from rank 0's, or its deadline pass with ranks missing, writes
    the verdict, which every rank follows: every rank's claim is returned, or the rank ends with
    the verdict's line."""
    names = this.names
    world = range(len(names))
    plan = state.joining.harness
    mine = {"name": this.name, "program": plan.program, "flags": plan.flags,
            "pid": os.getpid(), "host": socket.gethostname(), "token": token,
            "port": watch.getsockname()[1] if watch else None}
    try:
        _claim(this, store, json.dumps(mine))
        claims = {}
        verdict = None
        while verdict is None:
            for other in world:
                key = f"{KEYS}rank{other}"
                if other not in claims and store.check([key]):
                    claims[other] = json.loads(store.get(key))
            if store.check([f"{KEYS}verdict"]):
                verdict = store.get(f"{KEYS}verdict")
                break
            difference = differences(claims) if 0 in claims else ""
            missing = [f"{names[other]} (rank {other})" for other in world if other not in claims]
            if difference:
                verdict = _decide(store, 2, difference)
            elif not missing:
                verdict = _decide(store, 0, "every rank joined")
            elif time.monotonic() > deadline:
                them = "them" if len(missing) > 1 else "it"
                seconds = state.joining.init_timeout
                verdict = _decide(store, 1, f"{', '.join(missing)} did not join at {where} "
                                            f"within {seconds:g} s (--init_timeout); "
                                            f"start {them} with the same flags")
            else:
                time.sleep(POLL_SECONDS)
        status, message = json.loads(verdict)
        if status == 0:  # every rank joined: their claims, all there
            return {other: json.loads(store.get(f"{KEYS}rank{other}")) for other in world}
        store.add(f"{KEYS}read the verdict", 1)
        if this.rank == 0:
            _stay_for_the_readers(store, len(names), deadline)
    except RuntimeError as err:  # the store went away: rank 0 ended meanwhile
        this.end(f"{this.name}: {names[0]} (rank 0) went away while the ranks were joining at "
                 f"{where} ({str(err).splitlines()[0]})", 1)
    this.end(f"{this.name}: {message}", status)


def _stay_for_the_readers(store, world_size, deadline):
    """Rank 0, which holds the store, after the verdict: until every rank has read it, or, once
    its deadline has passed, every rank that came (READ_SECONDS at most after that)."""
    last = max(deadline, time.monotonic()) + READ_SECONDS
    while time.monotonic() < last:
        read = store.add(f"{KEYS}read the verdict", 0)
        came = sum(store.check([f"{KEYS}rank{other}"]) for other in range(world_size))
        if read >= world_size or (read >= came and time.monotonic() > deadline):
            return
        time.sleep(POLL_SECONDS)


def _decide(store, status, message):
    """Write the verdict unless another rank wrote one first; the verdict that stands."""
    return store.compare_set(f"{KEYS}verdict", "", json.dumps([status, message]))


def _claim(this, store, mine):
    """Take this rank's key, unless a live process holds it (on Linux, a holder on this machine
    that has gone is replaced: a rank started again after it was killed)."""
    key = f"{KEYS}rank{this.rank}"
    held = store.compare_set(key, "", mine).decode()
    if held == mine:
        return
    holder = json.loads(held)
    gone = (holder["host"] == socket.gethostname() and sys.platform.startswith("linux")
            and not Path(f"/proc/{holder['pid']}").exists())
    if gone and store.compare_set(key, held, mine).decode() == mine:
        return
    this.end(f"{this.name}: rank {this.rank} is taken: process {holder['pid']} on "
             f"{holder['host']} joined as rank {this.rank} first; give every rank its own "
             "--rank", 2)


def differences(claims):
    """One line naming what differs from rank 0's claim (rank -> claim): the program that each
    rank runs, or else every flag of every rank; '' where nothing does."""
    first = claims[0]
    others = sorted(claims.items())[1:]
    programs = [f"rank {other} ({claim['name']}) runs {claim['program']}"
                for other, claim in others if claim["program"] != first["program"]]
    if programs:
        return (f"rank 0 ({first['name']}) runs {first['program']}, but {'; '.join(programs)}: "
                "start every rank with the same program")
    found = []
    for other, claim in others:
        keys = sorted(set(first["flags"]) | set(claim["flags"]),
                      key=lambda key: (key != "world_size", key))
        for key in keys:
            ours = first["flags"].get(key)
            theirs = claim["flags"].get(key)
            if ours != theirs:
                found.append(f"--{key} is {_shown(ours)} on rank 0 ({first['name']}) but "
                             f"{_shown(theirs)} on rank {other} ({claim['name']})")
    if not found:
        return ""
    return ("the ranks were started with different flags: " + "; ".join(found)
            + "; start every rank with the same values")


def _shown(value):
    if value is None:
        return "unset"
    if isinstance(value, list):
        return " ".join(map(str, value))
    return value


def accept_peers(watch, claims, connect_by):
    """Rank 0: a connection from every other rank, each proven by its claim's token, by
    `connect_by`. Anything else that connects (a stray, a short or a second connection) is
    closed and ignored."""
    peers = {}
    while len(peers) < len(claims) - 1:
        seconds_left = connect_by - time.monotonic()
        if seconds_left <= 0:
            raise TimeoutError("not every rank connected in time")
        watch.settimeout(seconds_left)
        sock, _ = watch.accept()  # socket.timeout (an OSError) past the bound
        sock.settimeout(max(0.01, connect_by - time.monotonic()))
        try:
            # unbuffered: a line read a byte at a time, nothing of what follows taken
            words = sock.makefile("rb", buffering=0).readline(100).split()
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


def _connect_to_rank_0(addr, claims, this_rank, token, connect_by):
    """A rank's connection to rank 0, which it opens with its rank and its claim's token."""
    timeout = max(0.01, connect_by - time.monotonic())
    sock = socket.create_connection((addr, claims[0]["port"]), timeout=timeout)
    sock.sendall(f"{this_rank} {token}\n".encode())
    sock.settimeout(None)
    return sock


def _recorder(this, store):
    """--profile's recorder of this rank, made on its main thread (Kineto's first start must be
    there): a rank that loops starts at its first step, one that serves now, until every looping
    rank's window has closed (a count in rank 0's store)."""
    rank_0 = this.claims[0]
    recorder = Recorder(state.joining.profile, state.joining.profile_steps, this.rank, this.name,
                        run=f"{rank_0['host']}:{rank_0['pid']}")
    closed = f"{KEYS}profiles closed"
    if this.rank in state.joining.harness.loops:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            pass
        recorder.on_written = lambda: store.add(closed, 1)
    else:
        recorder.start_until(lambda: store.add(closed, 0) >= len(state.joining.harness.loops))
    return recorder


def _choose_network_interface(addr):
    """For TensorPipe, Gloo and NCCL, the interface towards MASTER_ADDR, unless set already:
    for a local run, loopback, so that nothing listens on the network (RPC runs unauthenticated
    pickles); never the host name's 127.0.1.1. Linux: an interface's address is read with
    SIOCGIFADDR."""
    local = address_towards(addr)
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
