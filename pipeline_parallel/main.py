"""Distributed Pipeline Parallelism Using RPC: the tutorial's code, in its order. A ResNet-50 in
two shards on worker1 and worker2 (ranks 1 and 2); the master (rank 0) cuts each batch into
micro-batches and chains them through the shards with asynchronous RPCs, so that shard 1 works
on micro-batch i+1 while shard 2 works on micro-batch i.

Each line that is not the tutorial's ends with "# ours:" and why, or follows a "# ours:" comment
line. What is not the lesson (the run's flags, where a shard runs, each batch's loss and
seconds, the summary, --profile) is in extras.py, the images in data.py. README.md says what
differs from the tutorial and why; pipelining.py trains the same model with
torch.distributed.pipelining.

    python main.py                                  # every rank on this machine
    python main.py --world_size=3 --rank=R          # one rank per terminal, R = 0, 1, 2
    torchrun --nproc_per_node=3 main.py             # torchrun's ranks
"""

# ours: the imports at the top, as in the pytorch/examples script (the tutorial spreads them
# over its steps, and leaves out RRef's)
import argparse  # ours: the command line
import os
import sys  # ours: the command's exit status
import threading
import time

import extras  # ours: what is not the lesson; first, so that its warning filter is set in time
import torch
import torch.nn as nn
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.optim as optim
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef

from torchvision.models.resnet import Bottleneck

from data import NUM_CLASSES, class_images  # ours: images of classes that can be learned


# --------- Step 1: Partition ResNet50 Model --------------------

# ResNet-50 in two shards, one a worker: ResNetBase holds what both shards share, ResNetShard1
# and ResNetShard2 each hold their half of the layers.


num_classes = NUM_CLASSES  # ours: data.py's 10 classes, not 1000 classes of random labels


def conv1x1(in_planes, out_planes, stride=1):
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class ResNetBase(nn.Module):
    def __init__(self, block, inplanes, num_classes=1000,
                 groups=1, width_per_group=64, norm_layer=None):
        super(ResNetBase, self).__init__()

        self._lock = threading.Lock()
        self._block = block
        self._norm_layer = nn.BatchNorm2d
        self.inplanes = inplanes
        self.dilation = 1
        self.groups = groups
        self.base_width = width_per_group

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
        # an RRef to each of this shard's parameters, for the master's DistributedOptimizer
        return [RRef(p) for p in self.parameters()]


class ResNetShard1(ResNetBase):
    # the stem and the first two stages
    def __init__(self, device, *args, **kwargs):
        super(ResNetShard1, self).__init__(
            Bottleneck, 64, num_classes=num_classes, *args, **kwargs)  # noqa: B026

        self.device = extras.choose_device(device)  # ours: that GPU if here, else the CPU
        print(f"ResNetShard1 on {rpc.get_worker_info().name}, {self.device}")  # ours: where
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
                nn.init.ones_(m.weight)  # ours: the script's, for nn.init.constant_(m.weight, 1)
                nn.init.zeros_(m.bias)  # ours: and for nn.init.constant_(m.bias, 0)
        extras.zero_init_residuals(self)  # ours: each block starts as the identity, to learn

    def forward(self, x_rref):
        x = x_rref.to_here().to(self.device)
        with self._lock:
            out = self.seq(x)
        return out.cpu()


class ResNetShard2(ResNetBase):
    # the last two stages, the pooling and the classifier
    def __init__(self, device, *args, **kwargs):
        super(ResNetShard2, self).__init__(
            Bottleneck, 512, num_classes=num_classes, *args, **kwargs)  # noqa: B026

        self.device = extras.choose_device(device)  # ours: that GPU if here, else the CPU
        print(f"ResNetShard2 on {rpc.get_worker_info().name}, {self.device}")  # ours: where
        self.seq = nn.Sequential(
            self._make_layer(256, 6, stride=2),
            self._make_layer(512, 3, stride=2),
            nn.AdaptiveAvgPool2d((1, 1)),
        ).to(self.device)

        self.fc = nn.Linear(512 * self._block.expansion, num_classes).to(self.device)
        extras.zero_init_residuals(self)  # ours: each block starts as the identity, to learn

    def forward(self, x_rref):
        x = x_rref.to_here().to(self.device)
        with self._lock:
            out = self.fc(torch.flatten(self.seq(x), 1))
        return out.cpu()


# --------- Step 2: Stitch ResNet50 Model Shards Into One Module --------------------

class DistResNet50(nn.Module):
    # the two shards as one nn.Module, whose forward pass pipelines the micro-batches
    # ours: split_size, the script's, for the tutorial's num_split: forward() reads
    # self.split_size, which the tutorial never sets
    def __init__(self, split_size, workers, *args, **kwargs):
        super(DistResNet50, self).__init__()

        self.split_size = split_size  # ours: the script's, for the tutorial's num_split

        # shard 1, built on the first worker
        self.p1_rref = rpc.remote(
            workers[0],
            ResNetShard1,
            args = ("cuda:0",) + args,
            kwargs = kwargs
        )

        # shard 2, built on the second worker
        self.p2_rref = rpc.remote(
            workers[1],
            ResNetShard2,
            args = ("cuda:1",) + args,
            kwargs = kwargs
        )

    def forward(self, xs):
        # each micro-batch to shard 1, whose output (an RRef, at once) goes on to shard 2; the
        # futures of shard 2's outputs, in the batch's order
        out_futures = []
        for x in iter(xs.split(self.split_size, dim=0)):
            x_rref = RRef(x)
            y_rref = self.p1_rref.remote().forward(x_rref)
            z_fut = self.p2_rref.rpc_async().forward(y_rref)
            out_futures.append(z_fut)

        # the outputs, once all have come, as one batch
        return torch.cat(torch.futures.wait_all(out_futures))

    def parameter_rrefs(self):
        remote_params = []
        remote_params.extend(self.p1_rref.remote().parameter_rrefs().to_here())
        remote_params.extend(self.p2_rref.remote().parameter_rrefs().to_here())
        return remote_params


# --------- Step 3: Define The Training Loop --------------------

def run_master(num_split, args):  # ours: the flags too
    split_size = -(-args.batch_size // num_split)  # ours: the size (rounded up) for num_split

    # put the two model parts on worker1 and worker2 respectively
    model = DistResNet50(split_size, ["worker1", "worker2"])  # ours: split_size (above)
    loss_fn = nn.CrossEntropyLoss()  # ours: class indices; MSELoss on one-hot labels diverged
    opt = DistributedOptimizer(
        optim.SGD,
        model.parameter_rrefs(),
        lr=args.lr,  # ours: --lr, the tutorial's 0.05 by default
    )

    # ours: data.py's images and labels, the same for every num_split (the tutorial: random)
    batches = class_images(args.num_batches, args.batch_size, args.image_size, args.seed)
    progress = extras.Progress(f"num_split {num_split}")  # ours: each batch's loss and seconds

    for i, (inputs, labels) in enumerate(batches):  # ours: data.py's batches
        print(f"Processing batch {i}")
        progress.start()  # ours: each batch's seconds

        # Distributed autograd keeps this step's gradients under context_id, where the
        # DistributedOptimizer finds them.
        with dist_autograd.context() as context_id:
            outputs = model(inputs)
            # ours: the loss kept, to print it
            loss = loss_fn(outputs, labels)
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
        progress.end(i, loss)  # ours: its line
        extras.profile_step()  # ours: a step done: --profile records steps 3 to 5
    progress.report(str(num_split))  # ours: the summary's figures


# --------- Step 4: Launch RPC Processes --------------------

def run_worker(rank, world_size, args):  # ours: args, the flags
    os.environ['MASTER_ADDR'] = args.master_addr  # ours: --master_addr, 'localhost' by default
    os.environ['MASTER_PORT'] = args.master_port  # ours: --master_port, '29500' by default
    torch.manual_seed(args.seed)  # ours: the shards' first weights, the same each run
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=128)

    if rank == 0:
        rpc.init_rpc(
            "master",
            rank=rank,
            world_size=world_size,
            rpc_backend_options=options
        )
        extras.start_profile(args, rank, "master", loops=True)  # ours: --profile DIR
        run_each_num_split(args)  # ours: every --num_split in this one world (below)
    else:
        rpc.init_rpc(
            f"worker{rank}",
            rank=rank,
            world_size=world_size,
            rpc_backend_options=options
        )
        extras.start_profile(args, rank, f"worker{rank}")  # ours: --profile DIR
        pass
    store = extras.hold_store(args, rank)  # ours: rank 0's store, kept for rpc.shutdown()

    # block until all rpcs finish
    rpc.shutdown()
    extras.finish(args, rank, store)  # ours: the store let go; --profile's trace; the summary


# ours: the tutorial's __main__ loop, run by the master in one world, so that a rank that
# --rank or torchrun starts runs them all (the tutorial spawned a world for each num_split)
def run_each_num_split(args):
    for num_split in args.num_split:
        tik = time.time()
        run_master(num_split, args)  # ours: args
        tok = time.time()
        print(f"number of splits = {num_split}, execution time = {tok - tik}")
    # ours: each rank's peak memory, for the summary
    for name in ("master", "worker1", "worker2"):
        extras.MEMORY[name] = rpc.rpc_sync(name, extras.peak_memory_mb)


if __name__ == "__main__":
    # ours: a command line (the tutorial has none): its world of 3, one rank or every rank,
    # where they meet; extras.py adds the run's flags and checks them all
    parser = argparse.ArgumentParser(allow_abbrev=False,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--world_size", "--world-size", type=int, default=3,
                        help="the master and its two workers")
    parser.add_argument("--rank", type=int, default=None,
                        help="run this rank alone; unset: every rank (or torchrun's)")
    parser.add_argument("--master_addr", "--master-addr", default="localhost",
                        help="rank 0's address, where the ranks meet")
    parser.add_argument("--master_port", "--master-port", default="29500",
                        help="rank 0's port")
    args = extras.parse_args(parser, 3, "the master, worker1 and worker2")
    world_size = args.world_size  # ours: --world_size, the tutorial's 3 (the only one taken)
    # ours: one rank (--rank, or torchrun's), as the parameter-server tutorial starts its own
    if args.rank is not None:
        p = mp.Process(target=run_worker, args=(args.rank, world_size, args))
        p.start()
        p.join()
        sys.exit(p.exitcode if p.exitcode >= 0 else 128 - p.exitcode)
    mp.spawn(run_worker, args=(world_size, args), nprocs=world_size, join=True)  # ours: args
