"""Distributed Pipeline Parallelism Using RPC: the tutorial's code, in its order. A ResNet-50 in
two shards on worker1 and worker2 (ranks 1 and 2); the master (rank 0) cuts each batch into
micro-batches and chains them through the shards with asynchronous RPCs, so that shard 1 works
on micro-batch i+1 while shard 2 works on micro-batch i.

Each line that is not the tutorial's ends with "# ours:" and why. What is not the lesson (where
a shard runs, each batch's loss and seconds, the ranks' names, the run's summary, the command
line) is in extras.py, the images in data.py. README.md says what differs from the tutorial and
why; pipelining.py trains the same model with torch.distributed.pipelining.

    python main.py                                          # every rank on this machine
    python main.py --rank R                                 # one rank per terminal, R = 0, 1, 2
"""

# ours: the imports at the top, as in the pytorch/examples script (the tutorial spreads them
# over its steps, and leaves out RRef's)
import os
import sys  # ours: the command's exit status
import threading
import time

import torch
import torch.nn as nn
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.optim as optim
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef

from torchvision.models.resnet import Bottleneck

import rpc_harness  # ours: this project's package: `make run` installs it (or `pip install -e .`)
from data import NUM_CLASSES, class_images  # ours: images of classes that can be learned
from extras import Progress, choose_device, parse_args, zero_init_residuals  # ours: extras.py


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
        worker = rpc.get_worker_info()  # ours: the device, chosen on the shard's worker, whose
        self.device = choose_device(worker.id, torch.cuda.device_count())  # ours: GPUs the master
        print(f"{type(self).__name__} on {worker.name}, {self.device}")  # ours: cannot see

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
    def __init__(self, *args, **kwargs):  # ours: no device: ResNetBase chooses it (above)
        super(ResNetShard1, self).__init__(
            Bottleneck, 64, num_classes=num_classes, *args, **kwargs)  # noqa: B026

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
                nn.init.zeros_(m.bias)  # ours: and nn.init.constant_(m.bias, 0)
        zero_init_residuals(self)  # ours: each block starts as the identity, to train at 0.05

    def forward(self, x_rref):
        x = x_rref.to_here().to(self.device)
        with self._lock:
            out = self.seq(x)
        return out.cpu()


class ResNetShard2(ResNetBase):
    # the last two stages, the pooling and the classifier
    def __init__(self, *args, **kwargs):  # ours: no device: ResNetBase chooses it (above)
        super(ResNetShard2, self).__init__(
            Bottleneck, 512, num_classes=num_classes, *args, **kwargs)  # noqa: B026

        self.seq = nn.Sequential(
            self._make_layer(256, 6, stride=2),
            self._make_layer(512, 3, stride=2),
            nn.AdaptiveAvgPool2d((1, 1)),
        ).to(self.device)

        self.fc = nn.Linear(512 * self._block.expansion, num_classes).to(self.device)
        zero_init_residuals(self)  # ours: each block starts as the identity, to train at 0.05

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
    def __init__(self, split_size, workers, *args, **kwargs):  # ours: (above)
        super(DistResNet50, self).__init__()

        self.split_size = split_size  # ours: (above)

        # shard 1, built on the first worker
        self.p1_rref = rpc.remote(
            workers[0],
            ResNetShard1,
            args = args,  # ours: no device: each shard chooses its own, on its worker
            kwargs = kwargs
        )

        # shard 2, built on the second worker
        self.p2_rref = rpc.remote(
            workers[1],
            ResNetShard2,
            args = args,  # ours: no device: each shard chooses its own, on its worker
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

def run_master(num_split, args):  # ours: the number of micro-batches, and the flags
    split_size = -(-args.batch_size // num_split)  # ours: the size (rounded up) for num_split

    # the shards, on worker1 and worker2
    model = DistResNet50(split_size, ["worker1", "worker2"])  # ours: split_size (DistResNet50)
    loss_fn = nn.CrossEntropyLoss()  # ours: class indices; MSELoss on one-hot labels diverged
    opt = DistributedOptimizer(
        optim.SGD,
        model.parameter_rrefs(),
        lr=args.lr,  # ours: --lr, the tutorial's 0.05 by default
    )

    batches = class_images(args.num_batches, args.batch_size,  # ours: data.py's images, the
                           args.image_size, args.seed)  # ours: (above) same for every num_split
    progress = Progress(num_split)  # ours: each batch's loss and seconds; the summary's figures

    for i, (inputs, labels) in enumerate(batches):  # ours: (above)
        rpc_harness.profile_step()  # ours: --profile's window; nothing without --profile
        print(f"Processing batch {i}")
        progress.start()  # ours: (above)

        # Distributed autograd keeps this step's gradients under context_id, where the
        # DistributedOptimizer finds them.
        with dist_autograd.context() as context_id:
            outputs = model(inputs)
            loss = loss_fn(outputs, labels)  # ours: kept, to print it
            dist_autograd.backward(context_id, [loss])  # ours: (above)
            opt.step(context_id)
        progress.end(i, loss)  # ours: each batch's loss and seconds (extras.py)
    progress.report()  # ours: the summary's figures (extras.py)


# --------- Step 4: Launch RPC Processes --------------------

@rpc_harness.watched  # ours: this rank ends in one line if it fails or loses a peer
def run_worker(rank, world_size, args):  # ours: args, the flags
    os.environ['MASTER_ADDR'] = args.master_addr  # ours: --master_addr, not 'localhost'
    os.environ['MASTER_PORT'] = str(args.master_port)  # ours: --master_port, not '29500'
    torch.manual_seed(args.seed + rank)  # ours: the shards' first weights, on the workers

    # ours: TensorPipe's options, with --rpc_timeout and --rpc_transport; the ranks meet through
    # the harness, which bounds every wait and watches the other ranks (README.md)
    options = rpc_harness.options(args, num_worker_threads=128)  # ours: (above)

    if rank == 0:
        rpc.init_rpc(
            "master",
            rank=rank,
            world_size=world_size,
            rpc_backend_options=options
        )
        run_each_num_split(args)  # ours: every --num_split in this one world (below)
    else:
        rpc.init_rpc(
            f"worker{rank}",
            rank=rank,
            world_size=world_size,
            rpc_backend_options=options
        )
        # a worker does nothing itself: it runs what the master calls on its shard
        pass

    # until every RPC is done
    rpc.shutdown()


def run_each_num_split(args):  # ours: the tutorial's __main__ loop, run by the master
    for num_split in args.num_split:  # ours: (above), in one world, so that --rank runs them all
        tik = time.time()
        run_master(num_split, args)  # ours: (above); the tutorial spawned a world for each
        tok = time.time()
        print(f"number of splits = {num_split}, execution time = {tok - tik}")


# ours: the tutorial's command, whose loop over num_split is now the master's (above)
if __name__ == "__main__":
    args = parse_args()  # ours: the command line, which the tutorial does not have (extras.py)
    rpc_harness.supervise(args)  # ours: this command ends in one line when a rank fails
    mp.set_start_method("spawn")  # ours: --rank's process starts afresh, as mp.spawn's
    world_size = args.world_size  # ours: --world_size, the tutorial's 3 (the only one taken)
    if args.rank is not None:  # ours: one rank (--rank, or torchrun's), as the other tutorials
        p = mp.Process(target=run_worker, args=(args.rank, world_size, args))  # ours: (above)
        p.start()  # ours: (above)
        p.join()  # ours: (above)
        sys.exit(rpc_harness.exit_status(p))  # ours: the rank's status, with its line
    mp.spawn(run_worker, args=(world_size, args), nprocs=world_size, join=True)  # ours: args
