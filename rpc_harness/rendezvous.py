"""init_rpc() and init_process_group() meet through the handler for "harness://": the first
call joins every rank at rank 0's store. Then each rank holds a TCP connection to rank 0, which a
process closes however it ends: rank 0 tells the others, each stops in one line wherever it waits
(rpc.shutdown() would wait for ever). Done, a rank says "bye"; silent for --rpc_timeout, lost."""

import contextlib
import datetime
import fcntl
import ipaddress
import json
import os
import resource
import select
import socket
import struct
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from . import profiling
from .cli import listen
from .compat import host_store

INIT_METHOD = "harness://"
HEARTBEAT_SECONDS = 1.0
_KEYS = "rpc_harness/"

_args = _rank = _name = _store = None  # this rank's command line, rank, name; the store
_peers = {}  # rank -> its connection: rank 0's to each rank, the others' to rank 0
_left = set()  # the peers that said bye
_left_changed, _lost = threading.Condition(), threading.Event()  # a bye came; a peer is gone
_report = {}

def this_rank(args, rank):
    global _args, _rank, _name
    _args, _rank, _name = args, rank, args.harness.names[rank]

def options(num_worker_threads=16):
    """init_rpc's rpc_backend_options: this rendezvous, --rpc_timeout and --rpc_transport."""
    return rpc.TensorPipeRpcBackendOptions(
        init_method=INIT_METHOD, num_worker_threads=num_worker_threads,
        rpc_timeout=_args.rpc_timeout, _transports=["uv"] if _args.rpc_transport == "tcp" else None)

def _rendezvous(url, **kwargs):
    if _store is None:
        _join()
    query = dict(pair.split("=") for pair in url.partition("?")[2].split("&"))
    yield _store, int(query["rank"]), int(query["world_size"])

dist.register_rendezvous_handler(INIT_METHOD.split(":")[0], _rendezvous)
# A function run for an RPC that raises prints its traceback where it ran, and the caller, which
# reports it, gets the same error: a rank that lost a peer would print one that nobody waits for.
rpc.internal.print = lambda *args, **kwargs: None

def _join():
    global _store
    args, world = _args, _args.world_size
    where, first = f"{args.master_addr}:{args.master_port}", f"{args.harness.names[0]} (rank 0)"
    if not args.harness.spawned:
        print(f"{_name} (rank {_rank} of {world}): waiting for the other ranks at {where}, up to "
              f"{args.init_timeout:g} s")
    deadline = time.monotonic() + args.init_timeout
    _choose_network_interface(args.master_addr)
    watch = listen(args.master_addr, 0) if _rank == 0 else None  # where the others reach rank 0
    try:
        _store = (host_store(listen(args.master_addr, args.master_port), args.init_timeout)
                  if _rank == 0 and not args.torchrun else
                  dist.TCPStore(args.master_addr, args.master_port, is_master=False,
                                timeout=datetime.timedelta(seconds=args.init_timeout)))
    except OSError as err:  # rank 0's port, taken since it was checked
        _exit(f"{_name}: cannot listen on {where} ({err.strerror})", status=2)
    except RuntimeError:  # the store's client gave up, or a signal cut its wait short (torch 2.4):
        time.sleep(1)  # then the signal's own line and status come first, from its thread
        _exit(f"{_name}: {first} did not come: nothing answered at {where} within "
              f"{args.init_timeout:g} s (--init_timeout); start it with the same flags")
    try:
        claims = _meet(watch, deadline, where)
        if _rank == 0:  # rank 0 takes each connection that names a rank of its own
            watch.settimeout(max(1.0, deadline - time.monotonic()))
            while len(_peers) < world - 1:
                sock, _ = watch.accept()
                sock.settimeout(5)
                if 0 < (rank := struct.unpack("!I", sock.recv(4, socket.MSG_WAITALL))[0]) < world:
                    _peers[rank] = sock
        else:
            _peers[0] = socket.create_connection((args.master_addr, claims[0]["port"]),
                                                 timeout=max(1.0, deadline - time.monotonic()))
            _peers[0].sendall(struct.pack("!I", _rank))
    except (RuntimeError, OSError) as err:  # rank 0's store, or a rank, went away meanwhile
        _exit(f"{_name}: lost a rank while joining at {where} ({str(err).splitlines()[0]})")
    print(f"{_name}: joined the other {world - 1} rank(s)")
    profiling.begin(args, _rank, _name, _store, f"{claims[0]['host']}:{claims[0]['pid']}")
    threading.Thread(target=_watch, daemon=True, name="rpc_harness watch").start()

def _meet(watch, deadline, where):
    """Claim this rank, wait for every rank's: flags that differ, or no one, end every rank."""
    args, world = _args, range(_args.world_size)
    keys, verdict = [f"{_KEYS}rank{rank}" for rank in world], f"{_KEYS}verdict"
    _claim(keys[_rank], json.dumps({"name": _name, "flags": args.harness.flags, "pid": os.getpid(),
                                    "host": socket.gethostname(),
                                    "port": watch and watch.getsockname()[1]}))
    claims, ended = {}, None
    while ended is None:
        claims.update((rank, json.loads(_store.get(keys[rank]))) for rank in world
                      if rank not in claims and _store.check([keys[rank]]))
        difference = _differences(claims) if 0 in claims else ""
        missing = [f"{args.harness.names[rank]} (rank {rank})" for rank in world
                   if rank not in claims]
        if _store.check([verdict]):
            ended = _store.get(verdict)
        elif difference:
            ended = _store.compare_set(verdict, "", json.dumps([2, difference]))
        elif not missing:
            return [claims[rank] for rank in world]
        elif time.monotonic() > deadline:
            ended = _store.compare_set(verdict, "", json.dumps([1, (
                f"{', '.join(missing)} did not join at {where} within {args.init_timeout:g} s "
                f"(--init_timeout); start {'them' if len(missing) > 1 else 'it'} with the same "
                "flags")]))
        else:
            time.sleep(0.05)  # polled: the store wakes no client when compare_set makes a key
    told = _store.add(f"{_KEYS}told", 1)
    while _rank == 0 and told < len(claims) and time.monotonic() < deadline + 2:
        time.sleep(0.05)  # rank 0's process holds the store: the others read the verdict first
        told = _store.add(f"{_KEYS}told", 0)
    status, message = json.loads(ended)
    _exit(f"{_name}: {message}", status)

def _claim(key, mine):
    """Take this rank's key, unless a live process holds it (Linux: not one that is gone)."""
    held = _store.compare_set(key, "", mine).decode()
    if held != mine:
        holder = json.loads(held)
        if (holder["host"] == socket.gethostname() and sys.platform == "linux"
                and not Path(f"/proc/{holder['pid']}").exists()):
            held = _store.compare_set(key, held, mine).decode()
        if held != mine:
            _exit(f"{_name}: rank {_rank} is taken: process {holder['pid']} on {holder['host']} "
                  f"joined as rank {_rank} first; give every rank its own --rank", status=2)

def _differences(claims):
    """One line naming every flag of every rank that differs from rank 0's, or ''."""
    said = [f"{'' if key == 'script' else '--'}{key} is {_shown(claims[0]['flags'].get(key))} on "
            f"rank 0 ({claims[0]['name']}) but {_shown(claim['flags'].get(key))} on rank {rank} "
            f"({claim['name']})" for rank, claim in sorted(claims.items())
            for key in sorted(set(claims[0]["flags"]) | set(claim["flags"]),
                              key=lambda key: (key != "world_size", key))
            if claim["flags"].get(key) != claims[0]["flags"].get(key)]
    return ("the ranks were started with different flags: " + "; ".join(said)
            + "; start every rank with the same values") if said else ""

def _shown(value):
    return "unset" if value is None else " ".join(map(str, value)) if type(value) is list else value

def _choose_network_interface(addr):
    """For TensorPipe, Gloo and NCCL, the interface towards --master_addr: locally, loopback, away
    from the network (RPC runs unauthenticated pickles); never the host name's 127.0.1.1."""
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, 1, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(sockaddr)  # chooses the route; a UDP connect sends nothing
        local = probe.getsockname()[0]
    name = next((name for _, name in socket.if_nameindex() if _ipv4_address(name) == local),
                "lo" if ipaddress.ip_address(local).is_loopback else None)
    if name:
        for variable in ("TP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(variable, name)

def _ipv4_address(interface):  # Linux's SIOCGIFADDR; None for an interface without one
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock, contextlib.suppress(OSError):
        return socket.inet_ntoa(fcntl.ioctl(sock.fileno(), 0x8915, struct.pack(
            "256s", interface.encode()[:15]))[20:24])

def _watch():
    """Every second say "." to every peer, and read theirs: "bye", "gone R", or a closed end."""
    socks, beat = {sock: rank for rank, sock in _peers.items()}, 0.0
    heard, unread = dict.fromkeys(_peers, time.monotonic()), dict.fromkeys(socks, b"")
    while socks:
        if time.monotonic() >= beat:
            profiling.beat()
            _send(b".\n")
            beat = time.monotonic() + HEARTBEAT_SECONDS
        for sock in select.select(list(socks), [], [], HEARTBEAT_SECONDS)[0]:
            rank = socks[sock]
            data = b""
            with contextlib.suppress(OSError):  # a reset: closed too
                data = sock.recv(4096)
            if not data:
                del socks[sock]
                if rank not in _left:
                    _peer_lost(rank, "its connection closed")
                continue
            heard[rank] = time.monotonic()
            *lines, unread[sock] = (unread[sock] + data).split(b"\n")
            for line in lines:
                if line == b"bye":
                    with _left_changed:
                        _left.add(rank)
                        _left_changed.notify_all()
                elif line.startswith(b"gone "):
                    _peer_lost(int(line[5:]), f"as {_args.harness.names[0]} saw")
        for rank in socks.values():
            if rank not in _left and time.monotonic() - heard[rank] > _args.rpc_timeout:
                _peer_lost(rank, f"silent for {_args.rpc_timeout:g} s (--rpc_timeout)")

def _send(message):
    for sock in _peers.values():
        with contextlib.suppress(OSError):  # a peer that is gone, which the watch finds
            sock.send(message)

def _peer_lost(rank, how):
    """End in one line (spawn-all: the launcher's); rank 0 tells the others which rank went."""
    if not _lost.is_set():
        _lost.set()
        _send(f"gone {rank}\n".encode())
        _exit(None if _args.harness.spawned else
              f"{_name}: lost contact with {_args.harness.names[rank]} (rank {rank}, {how}); "
              "stopping")

def report(**figures):
    """Not in the tutorials: figures for the run's summary, which rank 0 writes at the end."""
    _report.update(figures)
    _store.set(f"{_KEYS}report{_rank}", json.dumps(_report))

def fail(err):
    """The rank's work raised: if a peer is gone, the watch ends the rank."""
    if _peers and _lost.wait(2 * HEARTBEAT_SECONDS):
        threading.Event().wait()
    sys.excepthook(*sys.exc_info())
    lines = [line for line in str(err).splitlines() if line and not line.startswith("On Worker")]
    _exit(f"{_name}: failed: {(lines or [type(err).__name__])[0]}")

def finish():
    """Done. Rank 0 (its process holds the store, which rpc.shutdown() reads to the end) waits for
    every bye, merges the traces and writes the summary."""
    profiling.end()
    report(peak_memory_mb=_peak_memory_mb())
    _send(b"bye\n")
    if _rank == 0:
        with _left_changed:
            _left_changed.wait_for(lambda: len(_left) == len(_peers), timeout=10)
        profiling.write_timeline_of_every_rank(_args.harness.names)
        reports = {name: json.loads(_store.get(f"{_KEYS}report{rank}"))
                   for rank, name in enumerate(_args.harness.names)
                   if _store.check([f"{_KEYS}report{rank}"])}
        memory = {name: figures.pop("peak_memory_mb") for name, figures in reports.items()}
        figures, line = _args.harness.summary(_args, {name: figures for name, figures
                                                      in reports.items() if figures})
        figures["peak_memory_mb"] = memory
        figures["wall_seconds"] = round(time.time() - _args.harness.started, 3)
        print(f"Summary: {line}; {figures['wall_seconds']:.1f} s in all")
        if _args.summary_json:
            Path(_args.summary_json).write_text(json.dumps(figures, indent=2) + "\n")

def _peak_memory_mb():
    """This rank's most resident memory (ru_maxrss: kB, bytes on macOS), and its GPU's if used."""
    peak = {"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            // (2**20 if sys.platform == "darwin" else 2**10)}
    if torch.cuda.is_initialized():
        peak["cuda"] = torch.cuda.max_memory_allocated() // 2**20
    return peak

def _exit(message, status=1):
    """End now: RPC's threads would keep an exit waiting for peers that are gone."""
    profiling.end(seconds=3.0)
    sys.stdout.flush()
    if message:
        print(message, file=sys.stderr, flush=True)
    os._exit(status)
