"""Distributed Pipeline Parallelism Using RPC: the tutorial's code, runnable. A ResNet-50 in
two shards on `worker1` and `worker2`; the `master` chains each batch's micro-batches through
them with asynchronous RPCs, so that shard 1 works on micro-batch i+1 while shard 2 works on i.
README.md says what differs from the tutorial and why; rpc_harness starts the ranks and bounds
every wait; data.py holds the data. `python main.py`, or `--rank R` in each of 3 terminals."""

import threading
import time

try:
    import rpc_harness  # first: it sets what torch reads when it loads
except ModuleNotFoundError:
    raise SystemExit("rpc_harness is missing: run `make run` in the repository once, then use "
                     ".venv/bin/python (README.md)") from None

# isort: split
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn as nn
import torch.optim as optim
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef
from torchvision.models.resnet import Bottleneck

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

def run_worker(rank, world_size, args):
    torch.manual_seed(args.seed + rank)  # the shards' initial weights, on the workers
    options = rpc_harness.options(num_worker_threads=128)

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


# --------- Not in the tutorial: devices, names, the summary, the command line -------------

def choose_device(worker_rank, gpu_count):
    """A worker's GPU when its machine has any (on one GPU both local workers; on two, cuda:0
    and cuda:1, as in the tutorial), else its CPU. Tests fake gpu_count."""
    return torch.device(f"cuda:{(worker_rank - 1) % gpu_count}" if gpu_count else "cpu")


def worker_name(rank, world_size):
    return "master" if rank == 0 else f"worker{rank}"


def report(num_split, losses, seconds):
    """Seconds per batch, without the first batch (warm-up), for the summary."""
    steady = seconds[1:] or seconds
    rpc_harness.report(**{str(num_split): {"seconds_per_batch": round(sum(steady) / len(steady),
                                                                      4),
                                           "first_loss": losses[0], "last_loss": losses[-1]}})


def write_summary(args, reports):
    splits = reports["master"]
    best = min(splits, key=lambda n: splits[n]["seconds_per_batch"])
    return ({"example": "pipeline_parallel", "batch_size": args.batch_size,
             "image_size": args.image_size, "num_batches": args.num_batches, "splits": splits},
            ", ".join(f"num_split {n}: {s['seconds_per_batch']:.3f} s a batch, loss "
                      f"{s['first_loss']:.3f} -> {s['last_loss']:.3f}" for n, s in splits.items())
            + (f"; fastest: num_split {best}" if len(splits) > 1 else ""))


def parse_args(argv=None):
    parser = rpc_harness.ArgumentParser(description=(
        "Distributed pipeline parallelism: a ResNet-50 in two shards on worker1 and worker2, "
        "driven by the master, which splits each batch into --num_split micro-batches."))
    # tcp: the shards' convolutions need every core, and shared memory's polling threads
    # (one a process) took so much of two cores that a batch took 1.5 s instead of 1.0.
    rpc_harness.add_arguments(parser, world_size=3, min_world_size=3,
                                roles="the master (rank 0), worker1 and worker2",
                                rpc_transport="tcp")
    add, at_least = parser.add_argument, rpc_harness.int_at_least
    add("--num_split", "--num-split", type=at_least(1), nargs="+", default=[1, 2, 4, 8],
        metavar="N", help="micro-batches per batch; several (1 2 4) are timed in turn")
    add("--batch_size", "--batch-size", type=at_least(1), default=32, metavar="N",
        help="images per batch (the tutorial's 120)")
    # >= 64: below, shard 2 ends at 1 x 1 pixel, where batch norm fails on a 1-image micro-batch
    add("--image_size", "--image-size", type=at_least(64), default=64, metavar="PIXELS",
        help="height and width of the images (the tutorial's 128)")
    add("--num_batches", "--num-batches", type=at_least(1), default=20, metavar="N",
        help="batches trained for each --num_split (the tutorial's 3)")
    add("--lr", type=rpc_harness.positive_float, default=0.05, metavar="RATE",
        help="SGD learning rate")
    # heavy (sharing the cores): the workers, which run the shards; loops: the master's
    args = rpc_harness.parse_args(parser, argv, worker_name, heavy=lambda rank, _: rank != 0,
                                  loops=lambda rank, _: rank == 0, summary=write_summary)
    if args.world_size != 3:
        parser.error(f"this example runs 3 ranks (the master, worker1 and worker2), "
                     f"not --world_size {args.world_size}")
    if max(args.num_split) > args.batch_size:
        parser.error(f"--num_split {max(args.num_split)} is more micro-batches than the "
                     f"{args.batch_size} images of a batch (--batch_size)")
    return args


def main(argv=None):
    args = parse_args(argv)
    # tutorial: mp.spawn(run_worker, args=(world_size, num_split), nprocs=world_size, join=True)
    rpc_harness.spawn(run_worker, args=(args.world_size, args), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
