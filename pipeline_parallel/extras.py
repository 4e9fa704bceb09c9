"""What pipeline_parallel's main.py adds beside the tutorial: where each shard runs, how its
residual blocks start, each batch's loss and seconds, the ranks' names, the run's summary, and
the command line (the tutorial has none). main.py imports it, so that it shows its tutorial's
code."""

import os
import time

import torch
import torch.nn as nn
from torchvision.models.resnet import Bottleneck

import rpc_harness  # this project's package: `make run` installs it (or `pip install -e .`)


def choose_device(worker_rank, gpu_count):
    """A worker's GPU when its machine has any (on one GPU both local workers; on two, cuda:0
    and cuda:1, as in the tutorial), else its CPU. Tests fake gpu_count."""
    return torch.device(f"cuda:{(worker_rank - 1) % gpu_count}" if gpu_count else "cpu")


def zero_init_residuals(shard):
    """Every residual block of the shard starts as the identity: the last batch norm of each
    block at 0 (torchvision's zero_init_residual). SGD at the tutorial's 0.05 then trains
    ResNet-50 from scratch without diverging."""
    for m in shard.modules():
        if isinstance(m, Bottleneck):
            nn.init.constant_(m.bn3.weight, 0)


class Progress:
    """The master's batches of one --num_split: a line after each with its loss and seconds,
    and at the end the setting's figures for the summary."""

    def __init__(self, num_split):
        self.num_split = num_split
        self.losses = []
        self.seconds = []
        self.started = None

    def start(self):
        """A batch starts: its seconds count from here."""
        self.started = time.perf_counter()

    def end(self, i, loss):
        """Batch i is done, with this loss: its line."""
        self.seconds.append(time.perf_counter() - self.started)
        self.losses.append(loss.item())
        print(f"num_split {self.num_split}, batch {i}: loss {self.losses[-1]:.4f}, "
              f"{self.seconds[-1]:.3f} s")

    def report(self):
        """Seconds per batch, without the first batch (warm-up), and the first and last loss,
        for the summary."""
        steady = self.seconds[1:] or self.seconds
        figures = {"seconds_per_batch": round(sum(steady) / len(steady), 4),
                   "first_loss": self.losses[0], "last_loss": self.losses[-1]}
        rpc_harness.report(**{str(self.num_split): figures})


def worker_name(rank, world_size):
    """Each rank's name in RPC, which the harness's messages use too."""
    return "master" if rank == 0 else f"worker{rank}"


def holds_a_shard(rank, world_size):
    """The ranks that compute (the workers, which run the shards), which share the cores."""
    return rank != 0


def is_the_master(rank, world_size):
    """The rank that loops over batches, whose steps --profile records."""
    return rank == 0


def write_summary(args, reports):
    """The run's figures and its line: each num_split's seconds a batch and first and last
    loss, from what the master reported."""
    splits = reports["master"]
    best = min(splits, key=lambda n: splits[n]["seconds_per_batch"])
    figures = {"example": "pipeline_parallel", "batch_size": args.batch_size,
               "image_size": args.image_size, "num_batches": args.num_batches, "splits": splits}
    line = ", ".join(f"num_split {n}: {s['seconds_per_batch']:.3f} s a batch, loss "
                     f"{s['first_loss']:.3f} -> {s['last_loss']:.3f}" for n, s in splits.items())
    if len(splits) > 1:
        line += f"; fastest: num_split {best}"
    return figures, line


def parse_args(argv=None):
    """The command line (the tutorial has none: it runs 3 ranks on this machine, each
    num_split in turn), with this project's flags, checked: bad input ends the command here in
    one line, status 2."""
    # rpc_harness.ArgumentParser: argparse's, with every default in --help, each flag spelled
    # with hyphens too (--world-size), and errors in one line (status 2).
    # rpc_harness.int_at_least(N), port_number and positive_float: argument types that refuse
    # what a plain int or float would let through.
    parser = rpc_harness.ArgumentParser(description=(
        "Distributed pipeline parallelism: a ResNet-50 in two shards on worker1 and worker2, "
        "driven by the master, which splits each batch into --num_split micro-batches."))
    at_least = rpc_harness.int_at_least
    parser.add_argument("--world_size", type=at_least(3), default=3,
                        help="total number of processes: the master (rank 0), worker1 and "
                             "worker2")
    parser.add_argument("--rank", type=at_least(0), default=None,
                        help="rank of this process: 0 for the master, 1 and 2 for the workers. "
                             "Without it, every rank starts here (or torchrun's RANK)")
    parser.add_argument("--master_addr", default=os.environ.get("MASTER_ADDR", "localhost"),
                        help="address of the master (rank 0), where every rank meets (the "
                             "tutorial's localhost, or $MASTER_ADDR)")
    parser.add_argument("--master_port", type=rpc_harness.port_number,
                        default=os.environ.get("MASTER_PORT", "29500"),
                        help="port of the master, where every rank meets (the tutorial's 29500, "
                             "or $MASTER_PORT)")
    # This example's settings, each the tutorial's constant or size made a flag; then the flags
    # that every example of this project has (timeouts, --seed, --summary_json, --profile).
    parser.add_argument("--num_split", type=at_least(1), nargs="+", default=[1, 2, 4, 8],
                        metavar="N",
                        help="micro-batches per batch; several (1 2 4) are timed in turn")
    parser.add_argument("--batch_size", type=at_least(1), default=32, metavar="N",
                        help="images per batch (the tutorial's 120)")
    # >= 64: below, shard 2 ends at 1 x 1 pixel, where batch norm fails on a 1-image micro-batch
    parser.add_argument("--image_size", type=at_least(64), default=64, metavar="PIXELS",
                        help="height and width of the images (the tutorial's 128)")
    parser.add_argument("--num_batches", type=at_least(1), default=20, metavar="N",
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
