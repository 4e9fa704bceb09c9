"""DistributedDataParallel combined with distributed RPC: a sparse table on a parameter server,
a dense layer replicated on the trainers.

The runnable companion to the PyTorch tutorial "Combining Distributed DataParallel with
Distributed RPC Framework". With N trainers (world size N + 2): ranks 0..N-1 are the trainers
`trainer0`, `trainer1`, ..., rank N is the `master` and rank N+1 is the parameter server `ps`.
The master creates an nn.EmbeddingBag on `ps` and starts the training loop on every trainer;
each trainer looks up embeddings on `ps` through RPC and runs an nn.Linear replicated under DDP.
Distributed autograd carries the gradients to both halves, and DistributedOptimizer updates both.

    python ddp_rpc_hybrid/main.py                              # every rank on this machine
    python ddp_rpc_hybrid/main.py --world_size 3 --rank 2      # one rank per terminal
    torchrun --nproc_per_node 4 ddp_rpc_hybrid/main.py         # under torchrun

See README.md beside this file for what differs from the tutorial, and `--help` for the flags.
"""

import argparse
import ctypes
import datetime
import fcntl
import io
import ipaddress
import json
import os
import random
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
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
from torch import optim
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef
from torch.nn.parallel import DistributedDataParallel as DDP

# Known-harmless warnings that PyTorch prints from inside its RPC stack, in every process, about
# its own internals: the RPC agent builds its process group through an API deprecated since
# PyTorch 2.0, and DistributedOptimizer uses TorchScript functional optimizers, deprecated too.
# The second is raised under warnings.simplefilter("always"), which overrides
# warnings.filterwarnings, so they are dropped where warnings are shown instead.
KNOWN_HARMLESS_WARNINGS = re.compile(r"as a ProcessGroup\. This usage is deprecated"
                                     r"|`TorchScript` support for functional optimizers")
_show_warning = warnings.showwarning


def _show_useful_warning(message, *args, **kwargs):
    if not KNOWN_HARMLESS_WARNINGS.search(str(message)):
        _show_warning(message, *args, **kwargs)


warnings.showwarning = _show_useful_warning

# --------- The model: a sparse part on the parameter server, a dense part under DDP ---------

NUM_EMBEDDINGS = 100
EMBEDDING_DIM = 16
NUM_CLASSES = 8  # the outputs of the dense layer, nn.Linear(16, 8) in the tutorial
LEARNING_RATE = 0.05


def choose_backend_and_device(trainer_rank, num_trainers, gpu_count):
    """The trainers' process-group backend, and where this trainer puts its dense layer.

    As in the tutorial, NCCL with trainer R on cuda:R, but only when every trainer has a GPU of
    its own; otherwise Gloo, with everything on the CPU. `gpu_count` is passed in (normally
    torch.cuda.device_count()) so that this choice can be tested on a machine without GPUs.
    """
    if gpu_count >= num_trainers:
        return "nccl", torch.device(f"cuda:{trainer_rank}")
    return "gloo", torch.device("cpu")


class HybridModel(nn.Module):
    """The sparse part is the nn.EmbeddingBag that lives on the parameter server, reached through
    `emb_rref`. The dense part is an nn.Linear replicated on every trainer under DDP, which
    averages its gradients over the trainers so that the replicas stay identical."""

    def __init__(self, emb_rref, device):
        super().__init__()
        self.emb_rref = emb_rref
        # device_ids names the one GPU that holds this replica; a CPU module must not have any.
        device_ids = [device] if device.type == "cuda" else None
        self.fc = DDP(nn.Linear(EMBEDDING_DIM, NUM_CLASSES).to(device), device_ids=device_ids)
        self.device = device

    def forward(self, indices, offsets):
        emb_lookup = self.emb_rref.rpc_sync().forward(indices, offsets)
        return self.fc(emb_lookup.to(self.device))


# Runs on ps: RRefs to the table's parameters, for the trainers' DistributedOptimizer.
def _retrieve_embedding_parameters(emb_rref):
    param_rrefs = []
    for param in emb_rref.local_value().parameters():
        param_rrefs.append(RRef(param))
    return param_rrefs


# Runs on ps: a copy of the table, which the master takes before and after training to show that
# the sparse half trained.
def _get_embedding_weights(emb_rref):
    return emb_rref.local_value().weight.detach().clone()


def get_next_batch(rng, num_batches, device):
    """`num_batches` batches of bags, drawn from `rng` (a random.Random).

    As in the tutorial, 20 to 50 indices split into bags of 1 to 10 by random offsets. The
    tutorial's targets are random, so there is nothing to learn; here every index belongs to
    class index % NUM_CLASSES, and each bag's indices are drawn from its target's class.
    """
    for _ in range(num_batches):
        num_indices = rng.randint(20, 50)

        # Generate offsets: where each bag starts in the indices.
        offsets = []
        start = 0
        while start < num_indices:
            offsets.append(start)
            start += rng.randint(1, 10)
        ends = offsets[1:] + [num_indices]

        target = [rng.randrange(NUM_CLASSES) for _ in offsets]
        indices = [rng.randrange(bag_class, NUM_EMBEDDINGS, NUM_CLASSES)
                   for bag_class, begin, end in zip(target, offsets, ends, strict=True)
                   for _ in range(end - begin)]
        # The indices go to ps over RPC, so they stay on the CPU; the target meets the output.
        yield torch.tensor(indices), torch.tensor(offsets), torch.tensor(target, device=device)


def _run_trainer(emb_rref, rank, epochs, batches_per_epoch, seed):
    """The training loop of one trainer, started by the master over RPC. The forward pass looks
    up the embeddings on ps and runs the local nn.Linear; in the backward pass DDP allreduces the
    dense gradients over the trainers, and distributed autograd sends the table's gradients to
    ps. Returns the per-epoch losses and the final dense weights, for the master to compare."""
    torch.manual_seed(seed)  # DDP copies trainer0's initial dense weights to the others
    _, device = choose_backend_and_device(rank, dist.get_world_size(), torch.cuda.device_count())
    model = HybridModel(emb_rref, device)

    # DistributedOptimizer takes RRefs to every parameter it updates: those of the table, from
    # ps, and those of the dense layer, local ones included (model.parameters() has only these).
    model_parameter_rrefs = rpc.rpc_sync(
        "ps", _retrieve_embedding_parameters, args=(emb_rref,))
    for param in model.parameters():
        model_parameter_rrefs.append(RRef(param))

    opt = DistributedOptimizer(optim.SGD, model_parameter_rrefs, lr=LEARNING_RATE)
    criterion = nn.CrossEntropyLoss()

    rng = random.Random(seed * 1000 + rank)  # each trainer draws batches of its own
    epoch_losses = []
    started = time.perf_counter()
    for epoch in range(epochs):
        losses = []
        for indices, offsets, target in get_next_batch(rng, batches_per_epoch, device):
            # Each iteration has its own context, which holds its gradients: nothing to zero.
            with dist_autograd.context() as context_id:
                output = model(indices, offsets)
                loss = criterion(output, target)
                dist_autograd.backward(context_id, [loss])
                opt.step(context_id)
            losses.append(loss.item())
        epoch_losses.append(sum(losses) / len(losses))
        print(f"Training done for epoch {epoch} on trainer{rank}, "
              f"loss {epoch_losses[-1]:.4f}")
    return {"losses": epoch_losses,
            "iterations": epochs * batches_per_epoch,
            "train_seconds": time.perf_counter() - started,
            "backend": dist.get_backend(),
            "dense_weights": [param.detach().cpu() for param in model.parameters()]}


def run_worker(rank, world_size, args):
    """What rank `rank` does: with N = world_size - 2 trainers, ranks 0..N-1 are the trainers,
    rank N the master and rank N+1 the parameter server."""
    num_trainers = world_size - 2
    name = worker_name(rank, world_size)
    if rank == num_trainers:
        started = time.perf_counter()
        init_rpc_with_timeout(name, rank, world_size, args)

        # Build the embedding table on ps.
        emb_rref = rpc.remote(
            "ps", nn.EmbeddingBag, args=(NUM_EMBEDDINGS, EMBEDDING_DIM), kwargs={"mode": "sum"})
        table_before = rpc.rpc_sync("ps", _get_embedding_weights, args=(emb_rref,))

        # Run the training loop on every trainer, passing each its own rank (the tutorial passes
        # the master's). timeout=0: training takes as long as it takes. A trainer that dies
        # fails its call at once, and the other trainers' next allreduce with it.
        futs = []
        for trainer_rank in range(num_trainers):
            trainer_name = f"trainer{trainer_rank}"
            fut = rpc.rpc_async(
                trainer_name, _run_trainer,
                args=(emb_rref, trainer_rank, args.epochs, args.batches_per_epoch, args.seed),
                timeout=0)
            futs.append(fut)

        # Wait for all training to finish.
        results = {f"trainer{trainer_rank}": fut.wait() for trainer_rank, fut in enumerate(futs)}
        table_after = rpc.rpc_sync("ps", _get_embedding_weights, args=(emb_rref,))
        finish_and_shutdown(name, world_size, args)
        write_summary(args, results, table_before, table_after, time.perf_counter() - started)
    elif rank < num_trainers:
        # The trainers' own process group for DDP first, then RPC with everyone.
        backend, _ = choose_backend_and_device(rank, num_trainers, torch.cuda.device_count())
        init_trainer_process_group(rank, num_trainers, backend, args)
        init_rpc_with_timeout(name, rank, world_size, args)
        # The training loop arrives from the master as an RPC; this thread waits until the
        # master is done.
        finish_and_shutdown(name, world_size, args)
        dist.destroy_process_group()
    else:
        torch.manual_seed(args.seed)  # the table's initial weights
        init_rpc_with_timeout(name, rank, world_size, args)
        # The parameter server only answers the RPCs of the master and the trainers.
        finish_and_shutdown(name, world_size, args)


def worker_name(rank, world_size):
    """trainer0..trainer{N-1}, then master, then ps, for N = world_size - 2 trainers."""
    num_trainers = world_size - 2
    if rank < num_trainers:
        return f"trainer{rank}"
    return "master" if rank == num_trainers else "ps"


def init_trainer_process_group(rank, num_trainers, backend, args):
    """dist.init_process_group for the trainers alone, on --master_port + 1 (RPC has
    --master_port), bounded by --init_timeout, which also bounds every allreduce after it.
    trainer0 opens the port itself, on --master_addr only, as rank 0 does for RPC (see
    _listen_for_rendezvous): the TCPStore would otherwise listen on every interface."""
    addr, port = args.master_addr, args.master_port + 1
    timeout = datetime.timedelta(seconds=args.init_timeout)
    listen_fd = None
    if rank == 0:
        try:
            listen_fd = _listen(addr, port).detach()
        except OSError as err:
            _exit(f"cannot listen on {addr}:{port} ({err.strerror}); "
                  f"if the port is in use, choose another with --master_port", status=2)
    try:
        store = dist.TCPStore(addr, port, world_size=num_trainers, is_master=rank == 0,
                              master_listen_fd=listen_fd, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=num_trainers,
                                timeout=timeout)
    except Exception as err:  # noqa: BLE001 - any failure to join ends this rank with one line
        _exit(f"trainer{rank}: the {num_trainers} trainers did not all join their process "
              f"group at {addr}:{port} within {args.init_timeout:g} s (--init_timeout): "
              f"{_first_line(err)}")


def write_summary(args, results, table_before, table_after, wall_seconds):
    """Report the run, with the proof that both halves of the model trained: DDP kept the
    trainers' dense layers identical, and the table on ps has moved."""
    names = list(results)
    first_weights = results[names[0]]["dense_weights"]
    dense_identical = all(
        torch.equal(mine, first)
        for result in results.values()
        for mine, first in zip(result["dense_weights"], first_weights, strict=True))
    table_change = (table_after - table_before).abs().max().item()
    summary = {
        "example": "ddp_rpc_hybrid",
        "world_size": args.world_size,
        "trainers": len(names),
        "backend": results[names[0]]["backend"],
        "epochs": args.epochs,
        "batches_per_epoch": args.batches_per_epoch,
        "seed": args.seed,
        "iterations_per_trainer": {name: r["iterations"] for name, r in results.items()},
        "first_loss": {name: round(r["losses"][0], 4) for name, r in results.items()},
        "last_loss": {name: round(r["losses"][-1], 4) for name, r in results.items()},
        "dense_weights_identical": dense_identical,
        "embedding_table_changed": table_change > 0,
        "embedding_table_max_change": round(table_change, 4),
        "train_seconds": round(max(r["train_seconds"] for r in results.values()), 3),
        "wall_seconds": round(wall_seconds, 3),
    }
    print(f"Dense layer weights identical on {', '.join(names)}: "
          f"{'yes' if dense_identical else 'NO'}")
    print(f"Embedding table on ps changed: {'yes' if table_change > 0 else 'NO'} "
          f"(largest change {table_change:.4f})")
    print("Summary: loss " + ", ".join(
        f"{name} {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}" for name, r in results.items())
        + f" in {summary['wall_seconds']:.1f} s")
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps(summary, indent=2) + "\n")


# --------- Starting, ending and failing safely (the same in each example) --------------------
#
# The tutorial starts each rank with rpc.init_rpc() and ends it with rpc.shutdown(), both of which
# wait for every other rank with no practical time limit: a rank that never starts, or dies
# mid-run, leaves the others waiting forever. Here every wait has a bound:
#   - init_rpc() must complete within --init_timeout seconds;
#   - a rank that has finished its own work tells the others, and waits for them to finish too,
#     checking every HEARTBEAT_SECONDS that the ones still working answer; only when all are done
#     does it call rpc.shutdown(), which then returns at once;
#   - any RPC that fails (a peer died, or did not answer within --rpc_timeout) stops this rank:
#     it names the peers that no longer answer and exits with status 1, without the graceful
#     shutdown that would wait for them.

HEARTBEAT_SECONDS = 1.0
_reports = {}  # peer name -> what it reported when it finished
_reports_changed = threading.Condition()
_rpc_ready = threading.Event()


def _report_finished(name, report):
    with _reports_changed:
        _reports[name] = report
        _reports_changed.notify_all()


def _answer():
    return True


def init_rpc_with_timeout(name, rank, world_size, args):
    """rpc.init_rpc(), bounded by --init_timeout."""
    def give_up():
        _exit(f"{name}: not all {world_size} ranks joined at {os.environ['MASTER_ADDR']}:"
              f"{os.environ['MASTER_PORT']} within {args.init_timeout:g} s (--init_timeout); "
              f"start every rank with the same --world_size, --master_addr and --master_port")

    timer = threading.Timer(args.init_timeout, give_up)
    timer.daemon = True
    timer.start()
    try:
        # Rank 0 hosts the rendezvous; open its port ourselves so that it listens on
        # --master_addr only (see _listen_for_rendezvous). Under torchrun, torchrun hosts it.
        if rank == 0 and not args.torchrun:
            _listen_for_rendezvous(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        # --rpc_transport tcp: TensorPipe's TCP transport ("uv") only, no shared memory.
        transports = ["uv"] if args.rpc_transport == "tcp" else None
        options = rpc.TensorPipeRpcBackendOptions(init_method="env://",
                                                  rpc_timeout=args.rpc_timeout,
                                                  _transports=transports)
        rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)
    except Exception as err:  # noqa: BLE001 - any failure to join ends this rank with one line
        _exit(f"{name}: could not join the other ranks at {os.environ['MASTER_ADDR']}:"
              f"{os.environ['MASTER_PORT']}: {_first_line(err)}")
    finally:
        timer.cancel()
    _rpc_ready.set()


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


def finish_and_shutdown(name, world_size, args, report=None):
    """Tell every peer that this rank is done (with its report), wait until every peer is done,
    then shut RPC down. Returns every peer's report."""
    peers = [worker_name(rank, world_size) for rank in range(world_size)
             if worker_name(rank, world_size) != name]
    for peer in peers:
        rpc.rpc_sync(peer, _report_finished, args=(name, report))
    while True:
        with _reports_changed:
            working = [peer for peer in peers if peer not in _reports]
            if not working:
                break
            _reports_changed.wait(HEARTBEAT_SECONDS)
        for peer in working:
            rpc.rpc_sync(peer, _answer)  # raises if the peer is gone
    rpc.shutdown(timeout=args.rpc_timeout)
    return dict(_reports)


def run_rank(rank, args):
    """Everything one rank does, in its own process; a failure ends the process with status 1."""
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


def _unreachable(peers):
    futures = {peer: rpc.rpc_async(peer, _answer, timeout=5) for peer in peers}
    lost = []
    for peer, future in futures.items():
        try:
            future.wait()
        except Exception:  # noqa: BLE001 - any error means no answer
            lost.append(peer)
    return lost


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


def choose_network_interface(addr):
    """Tell TensorPipe and Gloo which network interface to listen on and advertise (unless the
    environment already does): the one that holds this machine's address towards --master_addr.
    For a local run that is loopback, so nothing is reachable from the network (RPC runs
    unauthenticated pickles). Across machines, left to themselves they advertise the address
    the hostname resolves to, often 127.0.1.1, which the other machines cannot reach."""
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
        os.environ.setdefault("TP_SOCKET_IFNAME", name)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", name)


def _ipv4_address(interface):
    """The IPv4 address of a network interface (Linux), or None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            request = struct.pack("256s", interface.encode()[:15])
            reply = fcntl.ioctl(sock.fileno(), 0x8915, request)  # SIOCGIFADDR
    except OSError:
        return None
    return socket.inet_ntoa(reply[20:24])


def spawn_all(args):
    """Start every rank on this machine and wait; if one fails, stop the others and exit 1."""
    try:
        mp.spawn(_spawned_rank, args=(args, os.getpid()), nprocs=args.world_size, join=True)
    except mp.ProcessExitedException as err:
        how = (f"was killed by {err.signal_name}" if err.signal_name
               else f"exited with status {err.exit_code}")
        _exit(f"{worker_name(err.error_index, args.world_size)} (rank {err.error_index}) {how}; "
              f"stopped the other ranks")
    except KeyboardInterrupt:
        _exit("interrupted", status=130)


def _spawned_rank(rank, args, launcher_pid):
    """A rank started by spawn_all. It ends with its launcher, even one killed with SIGKILL,
    so that no rank is left running unseen (Linux; elsewhere it finishes its run)."""
    _print_whole_lines()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
        if os.getppid() != launcher_pid:  # the launcher was gone before prctl
            os._exit(1)
    run_rank(rank, args)


def _print_whole_lines():
    """Have print() write each line at once. The ranks share one terminal or log, where lines
    written in pieces (as under python -u or PYTHONUNBUFFERED) run into each other's; and each
    line then shows when it is printed, even through a pipe (| tee run.log)."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True, write_through=False)


# --------- Command line --------------------

class ArgumentParser(argparse.ArgumentParser):
    """Reports bad input as one line (no usage block) and exit status 2."""

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


def positive_float(text):
    value = float(text)
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be greater than 0, got {text}")
    return value


def port_number(text):
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number from 1 to 65535, got {value}")
    return value


positive_float.__name__ = "number (> 0)"
port_number.__name__ = "port"


def add_launch_arguments(parser, world_size, min_world_size, roles, rpc_transport):
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
    add("--seed", type=int_at_least(0), default=1, metavar="N", help="random seed")
    add("--summary_json", "--summary-json", default=None, metavar="PATH",
        help="write the run's figures to this JSON file at the end")


def resolve_launch(parser, args, min_world_size):
    """Fill in rank and rendezvous from torchrun's environment when torchrun started us, and
    check that the rank fits the world and that rank 0 can listen where it must."""
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
        try:  # rank 0 will listen here: find out now if it cannot
            _listen(args.master_addr, args.master_port).close()
        except OSError as err:
            parser.error(f"cannot listen on {args.master_addr}:{args.master_port} "
                         f"({err.strerror or err}); if the port is in use, choose another "
                         f"with --master_port")


def parse_args(argv=None):
    """Parse and check the command line; bad input ends here with one line and status 2,
    before any process starts."""
    parser = ArgumentParser(
        description="DistributedDataParallel with distributed RPC: an nn.EmbeddingBag on the "
                    "parameter server ps, an nn.Linear replicated under DDP on the trainers, "
                    "driven by the master. Rank 0 (trainer0) hosts RPC's rendezvous on "
                    "--master_port and the trainers' process group for DDP on --master_port + 1; "
                    "--init_timeout bounds both, and each of DDP's allreduces.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    # auto (shared memory): each iteration is a few tiny messages, latency-bound.
    add_launch_arguments(parser, world_size=4, min_world_size=3,
                         roles="N-2 trainers (ranks 0 to N-3), the master (rank N-2) and the "
                               "parameter server ps (rank N-1)", rpc_transport="auto")
    add = parser.add_argument
    add("--epochs", type=int_at_least(1), default=100, metavar="N",
        help="epochs of training on each trainer (the master's value counts)")
    add("--batches_per_epoch", "--batches-per-epoch", type=int_at_least(1), default=10,
        metavar="N", help="batches in each epoch (the master's value counts)")
    args = parser.parse_args(argv)
    resolve_launch(parser, args, min_world_size=3)
    if args.master_port == 65535:
        parser.error("--master_port 65535 leaves no port for the trainers' process group "
                     "(--master_port + 1); choose a lower one")
    if args.rank in (None, 0):  # trainer0 will listen on --master_port + 1, under torchrun too
        try:
            _listen(args.master_addr, args.master_port + 1).close()
        except OSError as err:
            parser.error(f"cannot listen on {args.master_addr}:{args.master_port + 1} "
                         f"({err.strerror or err}), the trainers' process group port "
                         f"(--master_port + 1); if it is in use, choose another --master_port")
    return args


def main(argv=None):
    args = parse_args(argv)
    _print_whole_lines()
    os.environ["MASTER_ADDR"] = args.master_addr  # where init_rpc's env:// rendezvous looks
    os.environ["MASTER_PORT"] = str(args.master_port)
    choose_network_interface(args.master_addr)
    if args.rank is None:
        spawn_all(args)
    else:
        run_rank(args.rank, args)


if __name__ == "__main__":
    main()
