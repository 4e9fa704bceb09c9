"""Distributed Pipeline Parallelism Using RPC: the tutorial's code, runnable.

A ResNet-50 in two shards on `worker1` and `worker2`; the `master` chains each batch's
micro-batches through them with asynchronous RPCs, so that shard 1 works on micro-batch i+1
while shard 2 works on i. README.md says what differs from the tutorial and why; data.py holds
the data; pipelining.py trains the same model with torch.distributed.pipelining. rpc_harness,
this project's package, bounds every wait and ends every rank in one line when one fails; each
of its names is explained where main.py first uses it.

    python main.py                                          # every rank on this machine
    python main.py --rank R                                 # one rank per terminal, R = 0, 1, 2
"""

import os
import sys
import threading
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
import torch.optim as optim
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef
from torchvision.models.resnet import Bottleneck

try:
    import rpc_harness
except ModuleNotFoundError:
    raise SystemExit("rpc_harness, this project's package, is missing: install it with "
                     "`pip install -e PATH`, PATH being the repository's folder (the one that "
                     "holds pyproject.toml), or run `make run` there") from None

from data import NUM_CLASSES, class_images

# Step 1: Partition ResNet50 Model

num_classes = NUM_CLASSES  # the tutorial's 1000 classes of random labels: see data.py


def conv1x1(in_planes, out_planes, stride=1):
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class ResNetBase(nn.Module):
    def __init__(self, block, inplanes, num_classes=1000,
                 groups=1, width_per_group=64, norm_layer=None):
        super().__init__()

        self._lock = threading.Lock()
        self._block = block
        self._norm_layer = nn.BatchNorm2d
        self.inplanes = inplanes
        self.dilation = 1
        self.groups = groups
        self.base_width = width_per_group
        # The shard's device, chosen on its own worker: the master cannot see the worker's GPUs.
        self.device = choose_device(rpc.get_worker_info().id, torch.cuda.device_count())
        print(f"{type(self).__name__} on {rpc.get_worker_info().name}, {self.device}")

    def _make_layer(self, planes, blocks, stride=1):
        norm_layer = self._norm_layer
        downsample = None
        previous_dilation = self.dilation
        if stride != 1 or self.inplanes != planes * self._block.expansion:
            downsample = nn.Sequential(
                conv1x1(self.inplanes, planes * self._block.expansion, stride),
                norm_layer(planes * self._block.expansion),
            )

        layers = []
        layers.append(self._block(self.inplanes, planes, stride, downsample, self.groups,
                                  self.base_width, previous_dilation, norm_layer))
        self.inplanes = planes * self._block.expansion
        for _ in range(1, blocks):
            layers.append(self._block(self.inplanes, planes, groups=self.groups,
                                      base_width=self.base_width, dilation=self.dilation,
                                      norm_layer=norm_layer))

        return nn.Sequential(*layers)

    def parameter_rrefs(self):
        return [RRef(p) for p in self.parameters()]

    def _zero_init_residuals(self):
        # Every residual block starts as the identity (torchvision's zero_init_residual): SGD
        # at the tutorial's 0.05 then trains ResNet-50 from scratch without diverging.
        for m in self.modules():
            if isinstance(m, Bottleneck):
                nn.init.constant_(m.bn3.weight, 0)


class ResNetShard1(ResNetBase):
    def __init__(self, *args, **kwargs):
        super().__init__(Bottleneck, 64, *args, num_classes=num_classes, **kwargs)

        self.seq = nn.Sequential(
            nn.Conv2d(3, self.inplanes, kernel_size=7, stride=2, padding=3, bias=False),
            self._norm_layer(self.inplanes),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
            self._make_layer(64, 3),
            self._make_layer(128, 4, stride=2)
        ).to(self.device)

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode='fan_out', nonlinearity='relu')
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)
        self._zero_init_residuals()

    def forward(self, x_rref):
        x = x_rref.to_here().to(self.device)
        with self._lock:
            out = self.seq(x)
        return out.cpu()


class ResNetShard2(ResNetBase):
    def __init__(self, *args, **kwargs):
        super().__init__(Bottleneck, 512, *args, num_classes=num_classes, **kwargs)

        self.seq = nn.Sequential(
            self._make_layer(256, 6, stride=2),
            self._make_layer(512, 3, stride=2),
            nn.AdaptiveAvgPool2d((1, 1)),
        ).to(self.device)

        self.fc = nn.Linear(512 * self._block.expansion, num_classes).to(self.device)
        self._zero_init_residuals()

    def forward(self, x_rref):
        x = x_rref.to_here().to(self.device)
        with self._lock:
            out = self.fc(torch.flatten(self.seq(x), 1))
        return out.cpu()


# Step 2: Stitch ResNet50 Model Shards Into One Module

class DistResNet50(nn.Module):
    def __init__(self, num_split, workers, *args, **kwargs):
        super().__init__()

        self.num_split = num_split

        # Put the first part of the ResNet50 on workers[0]
        self.p1_rref = rpc.remote(
            workers[0],
            ResNetShard1,
            args=args,
            kwargs=kwargs
        )

        # Put the second part of the ResNet50 on workers[1]
        self.p2_rref = rpc.remote(
            workers[1],
            ResNetShard2,
            args=args,
            kwargs=kwargs
        )

    def forward(self, xs):
        out_futures = []
        # num_split micro-batches (the tutorial's split_size was never set)
        split_size = -(-len(xs) // self.num_split)
        for x in iter(xs.split(split_size, dim=0)):
            x_rref = RRef(x)
            y_rref = self.p1_rref.remote().forward(x_rref)
            z_fut = self.p2_rref.rpc_async().forward(y_rref)
            out_futures.append(z_fut)

        return torch.cat(torch.futures.wait_all(out_futures))

    def parameter_rrefs(self):
        remote_params = []
        remote_params.extend(self.p1_rref.remote().parameter_rrefs().to_here())
        remote_params.extend(self.p2_rref.remote().parameter_rrefs().to_here())
        return remote_params


# Step 3: Define The Training Loop

def run_master(num_split, args):
    # put the two model parts on worker1 and worker2 respectively
    model = DistResNet50(num_split, ["worker1", "worker2"])
    # CrossEntropyLoss on class indices (the tutorial: MSELoss on one-hot labels): see README.md
    loss_fn = nn.CrossEntropyLoss()
    opt = DistributedOptimizer(
        optim.SGD,
        model.parameter_rrefs(),
        lr=args.lr,
    )

    losses, seconds = [], []
    # the same batches for every num_split, from --seed
    batches = class_images(args.num_batches, args.batch_size, args.image_size, args.seed)
    for i, (inputs, labels) in enumerate(batches):
        rpc_harness.profile_step()  # not in the tutorial: --profile's window
        print(f"Processing batch {i}")
        started = time.perf_counter()
        with dist_autograd.context() as context_id:
            outputs = model(inputs)
            loss = loss_fn(outputs, labels)
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
        seconds.append(time.perf_counter() - started)
        losses.append(loss.item())
        print(f"num_split {num_split}, batch {i}: loss {loss.item():.4f}, {seconds[-1]:.3f} s")
    report(num_split, losses, seconds)  # not in the tutorial: the summary's figures


# Step 4: Launch RPC Processes

@rpc_harness.watched  # not in the tutorial: one line when this rank ends early
def run_worker(rank, world_size, args):
    os.environ['MASTER_ADDR'] = args.master_addr
    os.environ['MASTER_PORT'] = str(args.master_port)
    torch.manual_seed(args.seed + rank)  # the shards' initial weights, on the workers
    # rpc_harness.options(args): TensorPipe's options, meeting through rpc_harness, which joins the
    # ranks where MASTER_ADDR and MASTER_PORT say (as the default env:// would), with bounded waits.
    # The join installs in this rank the harness's loop (Ctrl-C, SIGTERM, the watch over the other
    # ranks, which ends every rank in one line when one is lost or fails), its share of the cores
    # and whole lines (README.md: "What the harness changes").
    options = rpc_harness.options(args, num_worker_threads=128)

    if rank == 0:
        rpc.init_rpc(
            "master",
            rank=rank,
            world_size=world_size,
            rpc_backend_options=options
        )
        # each num_split in turn, in one world (the tutorial spawns a world for each)
        for num_split in args.num_split:
            tik = time.time()
            run_master(num_split, args)
            tok = time.time()
            print(f"number of splits = {num_split}, execution time = {tok - tik}")
    else:
        rpc.init_rpc(
            f"worker{rank}",
            rank=rank,
            world_size=world_size,
            rpc_backend_options=options
        )
        pass

    # block until all rpcs finish
    rpc.shutdown()


# --------- Not in the tutorial: devices, names, the summary -------------

def choose_device(worker_rank, gpu_count):
    """A worker's GPU when its machine has any (on one GPU both local workers; on two, cuda:0
    and cuda:1, as in the tutorial), else its CPU. Tests fake gpu_count."""
    return torch.device(f"cuda:{(worker_rank - 1) % gpu_count}" if gpu_count else "cpu")


def worker_name(rank, world_size):
    """Each rank's name in RPC, which the harness's messages use too."""
    return "master" if rank == 0 else f"worker{rank}"


def holds_a_shard(rank, world_size):
    """The ranks that compute (the workers, which run the shards), which share the cores."""
    return rank != 0


def is_the_master(rank, world_size):
    """The rank that loops over batches, whose steps --profile records."""
    return rank == 0


def report(num_split, losses, seconds):
    """Seconds per batch, without the first batch (warm-up), for the summary."""
    steady = seconds[1:] or seconds
    rpc_harness.report(**{str(num_split): {"seconds_per_batch": round(sum(steady) / len(steady),
                                                                      4),
                                           "first_loss": losses[0], "last_loss": losses[-1]}})


def write_summary(args, reports):
    """The run's figures and its line: each num_split's seconds a batch and first and last
    loss, from what the master reported."""
    splits = reports["master"]
    best = min(splits, key=lambda n: splits[n]["seconds_per_batch"])
    return ({"example": "pipeline_parallel", "batch_size": args.batch_size,
             "image_size": args.image_size, "num_batches": args.num_batches, "splits": splits},
            ", ".join(f"num_split {n}: {s['seconds_per_batch']:.3f} s a batch, loss "
                      f"{s['first_loss']:.3f} -> {s['last_loss']:.3f}" for n, s in splits.items())
            + (f"; fastest: num_split {best}" if len(splits) > 1 else ""))


# --------- The tutorial's __main__, with a command line --------------------

def parse_args(argv=None):
    """The command line (the tutorial has none: it runs 3 ranks on this machine, each
    num_split in turn), with this project's flags, checked: bad input ends the command here in
    one line, status 2."""
    # rpc_harness.ArgumentParser: argparse's, with every default in --help and errors in one
    # line (status 2). rpc_harness.int_at_least(N), port_number and positive_float: argument
    # types that refuse what a plain int or float would let through.
    parser = rpc_harness.ArgumentParser(description=(
        "Distributed pipeline parallelism: a ResNet-50 in two shards on worker1 and worker2, "
        "driven by the master, which splits each batch into --num_split micro-batches."))
    at_least = rpc_harness.int_at_least
    parser.add_argument("--world_size", "--world-size", type=at_least(3), default=3,
                        help="total number of processes: the master (rank 0), worker1 and "
                             "worker2")
    parser.add_argument("--rank", type=at_least(0), default=None,
                        help="rank of this process: 0 for the master, 1 and 2 for the workers. "
                             "Without it, every rank starts here (or torchrun's RANK)")
    parser.add_argument("--master_addr", "--master-addr",
                        default=os.environ.get("MASTER_ADDR", "localhost"),
                        help="address of the master (rank 0), where every rank meets (the "
                             "tutorial's localhost, or $MASTER_ADDR)")
    parser.add_argument("--master_port", "--master-port", type=rpc_harness.port_number,
                        default=os.environ.get("MASTER_PORT", "29500"),
                        help="port of the master, where every rank meets (the tutorial's 29500, "
                             "or $MASTER_PORT)")
    # Not in the tutorial: this example's settings, each the tutorial's constant or size made a
    # flag; then the flags that every example of this project has (timeouts, --seed,
    # --summary_json, --profile).
    parser.add_argument("--num_split", "--num-split", type=at_least(1), nargs="+",
                        default=[1, 2, 4, 8], metavar="N",
                        help="micro-batches per batch; several (1 2 4) are timed in turn")
    parser.add_argument("--batch_size", "--batch-size", type=at_least(1), default=32,
                        metavar="N", help="images per batch (the tutorial's 120)")
    # >= 64: below, shard 2 ends at 1 x 1 pixel, where batch norm fails on a 1-image micro-batch
    parser.add_argument("--image_size", "--image-size", type=at_least(64), default=64,
                        metavar="PIXELS",
                        help="height and width of the images (the tutorial's 128)")
    parser.add_argument("--num_batches", "--num-batches", type=at_least(1), default=20,
                        metavar="N",
                        help="batches trained for each --num_split (the tutorial's 3)")
    parser.add_argument("--lr", type=rpc_harness.positive_float, default=0.05, metavar="RATE",
                        help="SGD learning rate")
    # tcp: the shards' convolutions need every core, and shared memory's polling threads
    # (one a process) took so much of two cores that a batch took 1.5 s instead of 1.0.
    rpc_harness.add_arguments(parser, rpc_transport="tcp")
    args = parser.parse_args(argv)
    # rpc_harness.check_args: what argparse cannot check (the world, the rank, the address and
    # port, --profile's folder); torchrun's RANK and WORLD_SIZE stand for --rank and
    # --world_size; args.harness records what rpc_harness needs in every rank.
    rpc_harness.check_args(parser, args, worker_name, computes=holds_a_shard,
                           loops=is_the_master, summary=write_summary)
    if args.world_size != 3:
        parser.error(f"this example runs 3 ranks (the master, worker1 and worker2), "
                     f"not --world_size {args.world_size}")
    if max(args.num_split) > args.batch_size:
        parser.error(f"--num_split {max(args.num_split)} is more micro-batches than the "
                     f"{args.batch_size} images of a batch (--batch_size)")
    return args


if __name__ == "__main__":
    args = parse_args()
    # Not in the tutorial: when a rank fails or is killed, or on Ctrl-C or SIGTERM, this
    # command stops the ranks it started and says why in one line.
    rpc_harness.supervise(args)
    # spawn, mp.spawn's own way: the rank that --rank names starts in a fresh interpreter too
    mp.set_start_method("spawn")

    processes = []
    world_size = args.world_size
    if args.rank is None:
        # The tutorial spawns a world for each num_split in turn, timing each; here one world
        # runs every --num_split in turn (run_worker), so that a rank started by --rank, in a
        # terminal of its own, runs them all too.
        mp.spawn(run_worker, args=(world_size, args), nprocs=world_size, join=True)
    else:
        # Not in the tutorial: the one rank that --rank (or torchrun) names, in a process of
        # its own, as the parameter-server tutorial starts its ranks.
        p = mp.Process(target=run_worker, args=(args.rank, world_size, args))
        p.start()
        processes.append(p)

        for p in processes:
            p.join()
        # Not in the tutorial: the rank's exit status is the command's; rpc_harness.exit_status
        # says, in one line, when a signal killed the rank (which then could not say it).
        sys.exit(rpc_harness.exit_status(p))
