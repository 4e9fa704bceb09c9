"""A parameter server trained over torch.distributed.rpc.

The runnable companion to the PyTorch tutorial "Implementing a Parameter Server Using
Distributed RPC Framework". Rank 0 is the parameter server, which holds the model; ranks 1..N-1
are trainers, which run the training loop and reach the model through RPC, distributed autograd
and DistributedOptimizer.

    python param_server/main.py --dataset synthetic          # every rank on this machine
    python param_server/main.py --world_size 2 --rank 1      # one rank per terminal
    torchrun --nproc_per_node 4 param_server/main.py         # under torchrun

See README.md beside this file for what differs from the tutorial, and `--help` for the flags.
"""

import argparse
import contextlib
import ctypes
import fcntl
import io
import ipaddress
import json
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
from threading import Lock

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch import optim
from torch.distributed.optim import DistributedOptimizer
from torch.utils.data import DataLoader, Subset, TensorDataset

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

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
               "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


# --------- MNIST Training Network to train, from pytorch/examples -----

def choose_devices(num_gpus, gpu_count):
    """Where Net puts its layers: (device of the two convs, device of the other layers).

    As in the tutorial: no GPU asked for means CPU; one means everything on cuda:0; two put the
    convs on cuda:0 and the rest on cuda:1. `gpu_count` is passed in (normally
    torch.cuda.device_count()) so that this choice can be tested on a machine without GPUs.
    """
    if not 0 <= num_gpus <= 2:
        raise ValueError(f"--num_gpus must be 0, 1 or 2, got {num_gpus}")
    if num_gpus > gpu_count:
        raise ValueError(f"--num_gpus {num_gpus} asks for more GPUs than this machine has "
                         f"({gpu_count})")
    if num_gpus == 0:
        return torch.device("cpu"), torch.device("cpu")
    return torch.device("cuda:0"), torch.device(f"cuda:{num_gpus - 1}")


class Net(nn.Module):
    def __init__(self, num_gpus=0):
        super().__init__()
        print(f"Using {num_gpus} GPUs to train")
        self.num_gpus = num_gpus
        first_device, rest_device = choose_devices(num_gpus, torch.cuda.device_count())
        print(f"Putting first 2 convs on {first_device}")
        self.conv1 = nn.Conv2d(1, 32, 3, 1).to(first_device)
        self.conv2 = nn.Conv2d(32, 64, 3, 1).to(first_device)
        print(f"Putting rest of layers on {rest_device}")
        self.dropout1 = nn.Dropout2d(0.25).to(rest_device)
        # nn.Dropout, not the tutorial's Dropout2d: this one acts on a (batch, features) tensor.
        self.dropout2 = nn.Dropout(0.5).to(rest_device)
        self.fc1 = nn.Linear(9216, 128).to(rest_device)
        self.fc2 = nn.Linear(128, 10).to(rest_device)

    def forward(self, x):
        x = self.conv1(x)
        x = F.relu(x)
        x = self.conv2(x)
        x = F.max_pool2d(x, 2)

        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        # Move tensor to next device if necessary
        next_device = next(self.fc1.parameters()).device
        x = x.to(next_device)

        x = self.fc1(x)
        x = F.relu(x)
        x = self.dropout2(x)
        x = self.fc2(x)
        output = F.log_softmax(x, dim=1)
        return output


# --------- Helper Methods --------------------

# On the local node, call a method with first arg as the value held by the RRef. Other args are
# passed in as arguments to the function called. Useful for calling instance methods.
def call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


# Given an RRef, return the result of calling the passed in method on the value held by the RRef.
# This call is done on the remote node that owns the RRef: remote_method(Foo.bar, rref, arg)
# runs <foo instance>.bar(arg) there and returns the result.
def remote_method(method, rref, *args, **kwargs):
    args = [method, rref] + list(args)
    return rpc.rpc_sync(rref.owner(), call_method, args=args, kwargs=kwargs)


# --------- Parameter Server --------------------

class ParameterServer(nn.Module):
    def __init__(self, num_gpus=0):
        super().__init__()
        self.model = Net(num_gpus=num_gpus)
        self.input_device = choose_devices(num_gpus, torch.cuda.device_count())[0]
        self.forward_lock = Lock()

    def forward(self, inp, training=True):
        inp = inp.to(self.input_device)
        # Trainers call this concurrently, and each one's optimizer step updates the parameters in
        # place while other trainers' backward passes may still need the values their forward
        # saw (upstream dies with "modified by an inplace operation", pytorch/examples#780).
        # So each forward runs on its own clone of the weights: clone() keeps the autograd link,
        # so gradients still reach the real parameters, but the optimizer never touches the
        # clone. The lock keeps functional_call's temporary swap of weights private to one call,
        # and lets `training` switch dropout for this call alone (get_accuracy turns it off).
        with self.forward_lock, torch.set_grad_enabled(training):
            self.model.train(training)
            weights = {name: param.clone() for name, param in self.model.named_parameters()}
            out = torch.func.functional_call(self.model, weights, (inp,))
        # Send the output back on the CPU, whatever device the model is on.
        return out.to("cpu")

    # Use dist autograd to retrieve gradients accumulated for this model. Primarily used for
    # verification. The tutorial returns every gradient, which copies the whole model over RPC
    # on each call; the check only needs to know they exist, so this returns their norms.
    def get_dist_gradients(self, cid):
        grads = dist_autograd.get_gradients(cid)
        return [grad.norm().item() for grad in grads.values()]

    # Wrap local parameters in a RRef. Needed for building the DistributedOptimizer, which
    # optimizes parameters remotely.
    def get_param_rrefs(self):
        param_rrefs = [rpc.RRef(param) for param in self.model.parameters()]
        return param_rrefs


def keep_freed_memory():
    """Have malloc keep the memory that the server frees, for the next batch. glibc gives large
    freed blocks back to the system, and with the forward and backward passes running on RPC's
    threads, each with a malloc arena of its own, the server then faulted in the pages of every
    batch's activations afresh: a million page faults in 100 batches, a fifth of its time.
    Linux with glibc only; elsewhere this does nothing."""
    if platform.libc_ver()[0] != "glibc":
        return
    libc = ctypes.CDLL(None)
    libc.mallopt(-3, 32 * 2**20)  # M_MMAP_THRESHOLD: blocks up to 32 MiB (the most) from arenas
    libc.mallopt(-1, 2**30)  # M_TRIM_THRESHOLD: give memory back only above 1 GiB free


# The global parameter server instance.
param_server = None
# A lock to ensure we only have one parameter server.
global_lock = Lock()


def get_parameter_server(num_gpus=0):
    """Returns a singleton parameter server to all trainer processes."""
    global param_server
    # Ensure that we get only one handle to the ParameterServer.
    with global_lock:
        if not param_server:
            # construct it once
            param_server = ParameterServer(num_gpus=num_gpus)
        return param_server


def run_parameter_server(rank, world_size, args):
    # The parameter server just acts as a host for the model and responds to requests from
    # trainers. Where the tutorial calls rpc.shutdown() at once, finish_and_shutdown() first waits
    # for every trainer to report that it is done, noticing on the way if one dies.
    started = time.perf_counter()
    torch.manual_seed(args.seed)
    keep_freed_memory()
    print("PS master initializing RPC")
    init_rpc_with_timeout("parameter_server", rank, world_size, args)
    print("RPC initialized! Running parameter server...")
    reports = finish_and_shutdown("parameter_server", world_size, args)
    print("RPC shutdown on parameter server.")
    write_summary(args, reports, time.perf_counter() - started)


# --------- Trainers --------------------

# nn.Module corresponding to the network trained by this trainer. The forward() method simply
# invokes the network on the given parameter server.
class TrainerNet(nn.Module):
    def __init__(self, num_gpus=0):
        super().__init__()
        self.num_gpus = num_gpus
        self.param_server_rref = rpc.remote(
            "parameter_server", get_parameter_server, args=(num_gpus,))

    def get_global_param_rrefs(self):
        remote_params = remote_method(
            ParameterServer.get_param_rrefs,
            self.param_server_rref)
        return remote_params

    def forward(self, x):
        # self.training (set by .train() / .eval()) travels with the call: model.eval() here
        # must turn dropout off in the Net on the server, which the tutorial's version never does.
        model_output = remote_method(
            ParameterServer.forward, self.param_server_rref, x, self.training)
        return model_output


def run_training_loop(rank, num_gpus, train_loader, test_loader, args):
    # Runs the typical neural network forward + backward + optimizer step, but in a distributed
    # fashion.
    net = TrainerNet(num_gpus=num_gpus)
    # Build DistributedOptimizer.
    param_rrefs = net.get_global_param_rrefs()
    opt = DistributedOptimizer(optim.SGD, param_rrefs, lr=args.lr)

    samples, batches = 0, 0
    started = time.perf_counter()
    for _ in range(args.epochs):
        for i, (data, target) in enumerate(train_loader):
            if args.max_batches is not None and i >= args.max_batches:
                break
            with dist_autograd.context() as cid:
                model_output = net(data)
                target = target.to(model_output.device)
                loss = F.nll_loss(model_output, target)
                if i % args.log_interval == 0:
                    print(f"Rank {rank} training batch {i} loss {loss.item()}")
                dist_autograd.backward(cid, [loss])
                # Ensure that dist autograd ran successfully and gradients were returned (on
                # logged batches only: it is a check, not part of training).
                if i % args.log_interval == 0 and not remote_method(
                        ParameterServer.get_dist_gradients, net.param_server_rref, cid):
                    raise RuntimeError("the distributed backward pass left no gradients")
                opt.step(cid)
            samples += len(data)
            batches += 1
    train_seconds = time.perf_counter() - started

    print("Training complete!")
    print("Getting accuracy....")
    accuracy = get_accuracy(test_loader, net)
    return {"accuracy": accuracy, "batches": batches, "samples": samples,
            "train_seconds": train_seconds}


def get_accuracy(test_loader, model):
    model.eval()
    correct_sum = 0
    # The output of the remote model always comes back on the CPU, so compare it there.
    with torch.no_grad():
        for data, target in test_loader:
            out = model(data)
            pred = out.argmax(dim=1, keepdim=True)
            correct = pred.eq(target.view_as(pred)).sum().item()
            correct_sum += correct

    accuracy = correct_sum / len(test_loader.dataset)
    print(f"Accuracy {accuracy}")
    return accuracy


# Main loop for trainers.
def run_worker(rank, world_size, num_gpus, train_loader, test_loader, args):
    print(f"Worker rank {rank} initializing RPC")
    init_rpc_with_timeout(f"trainer_{rank}", rank, world_size, args)

    print(f"Worker {rank} done initializing RPC")

    report = run_training_loop(rank, num_gpus, train_loader, test_loader, args)
    finish_and_shutdown(f"trainer_{rank}", world_size, args, report)


def worker_name(rank, world_size):
    return "parameter_server" if rank == 0 else f"trainer_{rank}"


# --------- Data --------------------

# Seven-segment shapes for the synthetic digits: segment -> (top, left, bottom, right) pixels.
SEGMENTS = {"a": (5, 9, 6, 19), "b": (5, 18, 14, 19), "c": (14, 18, 23, 19),
            "d": (22, 9, 23, 19), "e": (14, 9, 23, 10), "f": (5, 9, 14, 10), "g": (13, 9, 14, 19)}
DIGIT_SEGMENTS = ("abcdef", "bc", "abdeg", "abcdg", "bcfg", "acdfg", "acdefg", "abc",
                  "abcdefg", "abcdfg")
SYNTHETIC_TRAIN_SIZE, SYNTHETIC_TEST_SIZE = 6000, 1000


def synthetic_digits(size, seed):
    """MNIST-shaped stand-in for MNIST when it cannot be downloaded: digits drawn as
    seven-segment shapes, randomly rotated, scaled, shifted and blurred, with pixel noise, then
    normalised with MNIST's mean and deviation. Deterministic for a given seed, and learnable
    (each class has its own shape), so accuracy means something."""
    gen = torch.Generator().manual_seed(seed)
    templates = torch.zeros(10, 1, 28, 28)
    for digit, segments in enumerate(DIGIT_SEGMENTS):
        for segment in segments:
            top, left, bottom, right = SEGMENTS[segment]
            templates[digit, 0, top:bottom + 1, left:right + 1] = 1.0
    labels = torch.randint(0, 10, (size,), generator=gen)
    angle = (torch.rand(size, generator=gen) - 0.5) * 0.5  # up to about 15 degrees
    scale = 0.85 + 0.3 * torch.rand(size, generator=gen)
    shift = (torch.rand(size, 2, generator=gen) - 0.5) * 0.3
    cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
    theta = torch.stack([torch.stack([cos, -sin, shift[:, 0]], 1),
                         torch.stack([sin, cos, shift[:, 1]], 1)], 1)
    grid = F.affine_grid(theta, [size, 1, 28, 28], align_corners=False)
    images = F.grid_sample(templates[labels], grid, align_corners=False)
    images = F.avg_pool2d(images, 3, stride=1, padding=1)
    noise = 0.15 * torch.randn(size, 1, 28, 28, generator=gen)
    images = (1.5 * images + noise).clamp(0, 1)
    return TensorDataset((images - MNIST_MEAN) / MNIST_STD, labels)


def mnist(data_dir, train, download=False):
    from torchvision import datasets, transforms  # only trainers need torchvision

    transform = transforms.Compose([transforms.ToTensor(),
                                    transforms.Normalize((MNIST_MEAN,), (MNIST_STD,))])
    return datasets.MNIST(data_dir, train=train, download=download, transform=transform)


def check_mnist(data_dir):
    """Make sure MNIST is in data_dir, downloading it if it is not; None if it is there, else a
    one-line explanation. Runs once, before any rank starts."""
    try:
        # torchvision prints each mirror it tries; keep that out of the output, and bound each
        # attempt, so that an offline machine gets one line, quickly.
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            previous_timeout = socket.getdefaulttimeout()
            socket.setdefaulttimeout(30)
            try:
                mnist(data_dir, train=True, download=True)
                mnist(data_dir, train=False, download=True)
            finally:
                socket.setdefaulttimeout(previous_timeout)
    except Exception:  # noqa: BLE001 - any failure here means "not there and not downloadable"
        return (f"MNIST is not in {Path(data_dir) / 'MNIST' / 'raw'} (expected "
                f"{', '.join(MNIST_FILES)}) and could not be downloaded; "
                f"copy the files there, or run with --dataset synthetic")
    return None


def get_data_loaders(rank, world_size, args):
    """This trainer's share of the training set (every (world_size-1)th sample, so that an epoch
    of all trainers together is one pass over the data) and the whole test set."""
    if args.dataset == "synthetic":
        train_set = synthetic_digits(SYNTHETIC_TRAIN_SIZE, args.seed)
        test_set = synthetic_digits(SYNTHETIC_TEST_SIZE, args.seed + 1)
    else:
        train_set = mnist(args.data_dir, train=True)
        test_set = mnist(args.data_dir, train=False)
    shard = Subset(train_set, range(rank - 1, len(train_set), world_size - 1))
    train_loader = DataLoader(shard, batch_size=args.batch_size, shuffle=True,
                              generator=torch.Generator().manual_seed(args.seed + rank))
    test_loader = DataLoader(test_set, batch_size=args.batch_size, shuffle=False)
    return train_loader, test_loader


def write_summary(args, reports, wall_seconds):
    """The run's figures, from what each trainer reported when it finished."""
    trainers = {name: report for name, report in sorted(reports.items()) if report}
    accuracies = [report["accuracy"] for report in trainers.values()]
    samples = sum(report["samples"] for report in trainers.values())
    train_seconds = max(report["train_seconds"] for report in trainers.values())
    summary = {
        "example": "param_server",
        "dataset": args.dataset,
        "world_size": args.world_size,
        "trainers": len(trainers),
        "epochs": args.epochs,
        "accuracy": sum(accuracies) / len(accuracies),
        "accuracy_per_trainer": {name: r["accuracy"] for name, r in trainers.items()},
        "batches_per_trainer": {name: r["batches"] for name, r in trainers.items()},
        "samples": samples,
        "train_seconds": round(train_seconds, 3),
        "samples_per_second": round(samples / train_seconds, 1),
        "wall_seconds": round(wall_seconds, 3),
    }
    print(f"Summary: accuracy {summary['accuracy']:.4f} over {len(trainers)} trainer(s), "
          f"{summary['samples_per_second']} samples/s")
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
        if rank == 0:
            run_parameter_server(rank, args.world_size, args)
        else:
            train_loader, test_loader = get_data_loaders(rank, args.world_size, args)
            run_worker(rank, args.world_size, args.num_gpus, train_loader, test_loader, args)
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
        description="Parameter-Server RPC based training: rank 0 holds the model, the other "
                    "ranks train it through RPC.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    # tcp: the server's convolutions need every core, and its messages are few and large, so
    # the shared-memory transport's polling threads cost far more than they save (bench/).
    add_launch_arguments(parser, world_size=4, min_world_size=2,
                         roles="the parameter server (rank 0) and the trainers",
                         rpc_transport="tcp")
    add = parser.add_argument
    add("--num_gpus", "--num-gpus", type=int_at_least(0), default=0, metavar="N",
        help="GPUs for the model on the parameter server: 0, 1 (cuda:0), or 2 (convs on "
             "cuda:0, the rest on cuda:1)")
    add("--dataset", choices=("mnist", "synthetic"), default="mnist",
        help="MNIST (downloaded into --data_dir if missing), or generated digits "
             f"({SYNTHETIC_TRAIN_SIZE} to train on, {SYNTHETIC_TEST_SIZE} to test) offline")
    add("--data_dir", "--data-dir", default=str(DATA_DIR), metavar="PATH",
        help="folder holding MNIST/raw/")
    add("--epochs", type=int_at_least(1), default=1, metavar="N",
        help="passes over the training data")
    add("--max_batches", "--max-batches", type=int_at_least(1), default=None, metavar="N",
        help="end each trainer's epoch after this many batches (for short runs)")
    add("--batch_size", "--batch-size", type=int_at_least(1), default=32, metavar="N",
        help="batch size")
    add("--lr", type=positive_float, default=0.03, metavar="RATE", help="SGD learning rate")
    add("--log_interval", "--log-interval", type=int_at_least(1), default=5, metavar="N",
        help="print the loss every this many batches")
    args = parser.parse_args(argv)
    try:
        choose_devices(args.num_gpus, torch.cuda.device_count())
    except ValueError as err:
        parser.error(str(err))
    resolve_launch(parser, args, min_world_size=2)
    if not Path(args.data_dir).is_dir():
        parser.error(f"--data_dir {args.data_dir}: no such folder")
    if args.dataset == "mnist" and args.rank != 0:  # the parameter server needs no data
        problem = check_mnist(args.data_dir)
        if problem:
            parser.error(problem)
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
