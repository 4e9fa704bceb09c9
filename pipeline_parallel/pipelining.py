"""The same pipeline with today's API: main.py's ResNet-50, cut into the same two shards, trained on
the same data with torch.distributed.pipelining, in the order and names of its tutorial,
"Introduction to Distributed Pipeline Parallelism". Each rank is a stage (`stage0`, `stage1`);
a schedule (GPipe, 1F1B) moves the micro-batches between them with send and recv, and the last
stage owns the loss. No master, no RPC: a process group, as the tutorial joins it.

Built from that tutorial (README.md names its revision): its globals, init_distributed,
manual_model_split, its schedule and steps. Each line that is not its code ends with, or
follows, a "# ours:" comment that says why; extras.py holds the run's flags, the summary and
--profile, as for main.py.

    python pipelining.py                                    # every stage on this machine
    python pipelining.py --world_size=2 --rank=R            # one stage per terminal, R = 0, 1
    torchrun --nnodes 1 --nproc_per_node 2 pipelining.py    # as the tutorial starts them
"""

import argparse  # ours: the command line
import copy  # ours: torch 2.4's example shapes (example_args_for_torch_2_4)
import inspect  # ours: what this torch's PipelineStage and schedules take
import os
import sys  # ours: the command's exit status

import torch
import torch.distributed as dist
import torch.multiprocessing as mp  # ours: the launch without torchrun
import torch.nn as nn
import torch.optim as optim  # ours: a step (the page makes none)
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe  # ours: 1F1B
from torchvision.models import resnet50  # ours: main.py's model (the page's: a Transformer)

import extras  # ours: the run's flags, the summary, --profile
from data import NUM_CLASSES, class_images  # ours: main.py's images

# Setup: the model, then the globals of the distributed run


# ours: main.py's model, whole, in its two shards (the page's: a Transformer of its own)
class ResNet50(nn.Module):
    """torchvision's ResNet-50 as main.py's two shards, whole (the tutorial's Transformer here)."""

    def __init__(self):
        super().__init__()
        resnet = resnet50(num_classes=NUM_CLASSES, zero_init_residual=True)
        # main.py's ResNetShard1: the stem and the first two stages
        self.shard1 = nn.Sequential(resnet.conv1, resnet.bn1, resnet.relu, resnet.maxpool,
                                    resnet.layer1, resnet.layer2)
        # main.py's ResNetShard2: the last two stages and the classifier
        self.shard2 = nn.Sequential(resnet.layer3, resnet.layer4, resnet.avgpool, nn.Flatten(),
                                    resnet.fc)

    def forward(self, x):
        # A shard deleted by the split is None and skipped, so that each stage runs its own
        x = self.shard1(x) if self.shard1 is not None else x
        return self.shard2(x) if self.shard2 is not None else x


SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}  # ours: both, by --schedule

# ours: the page's globals, set to None (it writes `global rank, device, ...` here, which does
# nothing at a module's top level)
rank = device = pp_group = stage_index = num_stages = None


def init_distributed():
    global rank, device, pp_group, stage_index, num_stages
    rank = int(os.environ["RANK"])  # ours: the global rank (the page's LOCAL_RANK: one machine)
    world_size = int(os.environ["WORLD_SIZE"])
    # ours: NCCL with stage R on cuda:R where every stage has a GPU, else Gloo on the CPU (the
    # page: cuda:R wherever CUDA is, and torch's default backends)
    backend, device = choose_backend_and_device(rank, world_size, torch.cuda.device_count())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend)

    # This group can be a sub-group in the N-D parallel case
    pp_group = dist.new_group()
    stage_index = rank
    num_stages = world_size


# Step 1: Partition the model

def manual_model_split(model, example_input_microbatch) -> PipelineStage:  # ours: examples
    examples = example_args_for_torch_2_4(model, example_input_microbatch)  # ours: torch 2.4
    if stage_index == 0:
        # prepare the first stage model
        model.shard2 = None  # ours: this model's half (the page deletes Transformer layers)
    elif stage_index == 1:
        # prepare the second stage model
        model.shard1 = None  # ours: this model's half (the page deletes Transformer layers)

    stage = PipelineStage(
        model,
        stage_index,
        num_stages,
        device,
        group=pp_group,  # ours: the group, as the page's tracer split passes it
        **examples,  # ours: torch 2.4 wants them (example_args_for_torch_2_4)
    )
    return stage


# Step 2: Define the main execution

# ours: the page's `if __name__ == "__main__":` body, as a function that trains for one
# schedule and count of micro-batches: main.py's model, images, loss and learning rate, batch
# after batch, with a step (the page runs one step of its schedule on dummy data)
def train(schedule_name, num_microbatches, args):
    torch.manual_seed(args.seed)  # the same whole model on every stage, before the split
    model = ResNet50()

    # the shape of a micro-batch of images (the tutorial: x.chunk(num_microbatches)[0])
    example_input_microbatch = torch.empty(args.batch_size // num_microbatches, 3,
                                           args.image_size, args.image_size)
    stage = manual_model_split(model, example_input_microbatch)
    model.to(device)
    # each stage updates its own shard (the RPC version: one DistributedOptimizer over both)
    opt = optim.SGD(model.parameters(), lr=args.lr)

    loss_fn = nn.CrossEntropyLoss()
    schedule = SCHEDULES[schedule_name](stage, n_microbatches=num_microbatches, loss_fn=loss_fn)

    progress = extras.Progress(f"{schedule_name}, n_microbatches {num_microbatches}")
    for i, (x, y) in enumerate(class_images(args.num_batches, args.batch_size, args.image_size,
                                            args.seed)):
        progress.start()
        opt.zero_grad()
        losses = None
        if rank == 0:
            schedule.step(x.to(device))
        elif rank == 1:
            losses = []
            schedule.step(target=y.to(device), losses=losses)
        mean_of_microbatches_for_torch_2_4(model, num_microbatches)
        opt.step()
        progress.end(i, losses and torch.stack(losses).mean())  # the last stage's line
        extras.profile_step()  # a step done: --profile records steps 3 to 5
    progress.report(f"{schedule_name} {num_microbatches}")  # the summary's figures


# Step 3: Launch the distributed processes

# ours: every rank runs this, as torchrun would start it: what torchrun sets in the environment
# (the page reads its rank and world there, and init_process_group() where to meet); then
# each --schedule and --num_split in turn (the page trains once); the summary, on rank 0
def run_worker(rank, world_size, args):
    os.environ['MASTER_ADDR'] = args.master_addr
    os.environ['MASTER_PORT'] = args.master_port
    os.environ['RANK'] = str(rank)
    os.environ['WORLD_SIZE'] = str(world_size)
    init_distributed()
    print(f"stage {stage_index} of {num_stages} on {device}")
    extras.start_profile(args, rank, f"stage{rank}", loops=True)
    for schedule_name, num_microbatches in args.runs:
        train(schedule_name, num_microbatches, args)
    stages = send_figures_to_rank_0(rank, world_size)
    dist.destroy_process_group()
    extras.stop_profile()
    if rank == 0:
        extras.pipelining_summary(args, stages)


def send_figures_to_rank_0(rank, world_size):
    """Each stage's name, peak memory and figures, sent to rank 0 for the summary: on rank 0,
    the list of every stage's, in rank order; elsewhere None.

    Sent with send and receive, not gather_object: before torch 2.8, destroy_process_group()
    right after a Gloo collective such as gather_object could hang for ever. It held the GIL
    while it waited for Gloo's threads, and one of them could still need the GIL to free the
    collective's tensors (fixed in torch by pytorch/pytorch#154976). Gloo's send and receive
    run outside those threads."""
    figures = {"name": f"stage{rank}", "memory": extras.peak_memory_mb(),
               "figures": extras.FIGURES}
    if rank != 0:
        dist.send_object_list([figures], dst=0)
        return None
    stages = [figures]
    for peer in range(1, world_size):
        received = [None]
        dist.recv_object_list(received, src=peer)
        stages.append(received[0])
    return stages


# --------- ours: torch 2.4 and the other torch versions, devices --------------------

def example_args_for_torch_2_4(model, example_input_microbatch):
    """torch 2.4's PipelineStage wants its input and output as examples, where later versions
    infer them at the first step: their shapes, from a copy of the whole model on the meta
    device (shapes without data or arithmetic)."""
    if inspect.signature(PipelineStage).parameters["input_args"].default is None:
        return {}
    meta = copy.deepcopy(model).to("meta")
    between = meta.shard1(example_input_microbatch.to("meta"))
    output = meta.shard2(between)
    inputs = [example_input_microbatch, between][stage_index]
    outputs = [between, output][stage_index]
    return {"input_args": torch.empty(inputs.shape), "output_args": torch.empty(outputs.shape)}


SCHEDULES_SCALE_GRADS = "scale_grads" in inspect.signature(ScheduleGPipe).parameters  # once


def mean_of_microbatches_for_torch_2_4(model, num_microbatches):
    """Later versions divide the gradients that the micro-batches summed by their number
    (scale_grads), so that a step follows the mean loss of the batch, as main.py's; 2.4 not."""
    if not SCHEDULES_SCALE_GRADS:
        for p in model.parameters():
            if p.grad is not None:
                p.grad /= num_microbatches


def torch_minor(version=None):
    """(2, 8) for torch 2.8.0+cu128 (the version string: this torch's, unless given)."""
    return tuple(int(part) for part in (version or torch.__version__).split(".")[:2])


# The torch minors whose GPipe, as 1F1B on every torch, needs a micro-batch per stage at least:
# their schedules refuse fewer ("Number of microbatches (1) must be greater than or equal to the
# number of stages (2)"). Each minor from 2.4 to 2.15 was run with one micro-batch and two
# stages (README.md).
GPIPE_NEEDS_ONE_PER_STAGE = ((2, 7), (2, 10))  # first and last such minor
GPIPE_RUNS_FEWER = "torch 2.4 to 2.6 or 2.11 or later"  # what runs it with fewer


def fewest_microbatches(schedule_name, stages, version=None):
    """The fewest micro-batches a batch that this torch's schedule takes with `stages` stages."""
    first, last = GPIPE_NEEDS_ONE_PER_STAGE
    if schedule_name == "1F1B" or first <= torch_minor(version) <= last:
        return stages
    return 1


def gloo_refused_at_start(gpu_count):
    """Why this torch cannot run the schedules over Gloo, or None. torch 2.9's schedules start by
    sending each neighbour an int64 and receiving a float32 (PipelineStage's
    _get_init_p2p_neighbors_ops), and Gloo, which checks sizes, aborts the process ("8 vs 4");
    2.8 and 2.10 do not (found by make versions)."""
    if torch_minor() != (2, 9) or choose_backend_and_device(0, 2, gpu_count)[0] == "nccl":
        return None
    return (f"pipelining.py cannot run over Gloo on torch {torch.__version__}: its schedules "
            "start with a send and a receive of different sizes, which Gloo refuses; use torch "
            "2.8, or 2.10 or later (or a GPU per stage, with NCCL)")


def one_f_one_b_works(gpu_count):
    """1F1B over Gloo hangs before torch 2.8: it waited for only one of each batch of sends and
    receives (pytorch/pytorch#132644). NCCL runs it."""
    return torch_minor() >= (2, 8) or choose_backend_and_device(0, 2, gpu_count)[0] == "nccl"


def choose_backend_and_device(stage_rank, num_stages, gpu_count):
    """NCCL with stage R on cuda:R when every stage has a GPU of its own (NCCL refuses two
    ranks on one GPU), else Gloo on the CPU. Tests fake gpu_count."""
    if gpu_count >= num_stages:
        return "nccl", torch.device(f"cuda:{stage_rank}")
    return "gloo", torch.device("cpu")


def check_schedules(parser, args, gpu_count):
    """Two stages; counts of micro-batches that divide a batch; the schedules that this torch
    and these devices can run, and with how many micro-batches: args.runs, each (schedule,
    count) that runs, in turn. What this torch cannot run at all is refused in one line; a count
    that one schedule cannot take is skipped, saying so in one line."""
    uneven = [n for n in args.num_split if args.batch_size % n]
    if uneven:
        parser.error(f"--num_split {uneven[0]} does not divide the {args.batch_size} images of a "
                     f"batch (--batch_size): a stage's micro-batches must all have one shape")
    refused = gloo_refused_at_start(gpu_count)
    if refused:
        parser.error(refused)
    works = one_f_one_b_works(gpu_count)
    if args.schedule is None:
        args.schedule = list(SCHEDULES) if works else ["GPipe"]
    elif "1F1B" in args.schedule and not works:
        parser.error(f"1F1B over Gloo needs torch 2.8 or later, not {torch.__version__}: before, "
                     "it waited for only one of each batch of sends and receives, and hung "
                     "(pytorch/pytorch#132644)")
    fewest = {name: fewest_microbatches(name, args.world_size) for name in args.schedule}
    args.runs = [(name, n) for name in args.schedule for n in args.num_split if n >= fewest[name]]
    short = [name for name in args.schedule if min(args.num_split) < fewest[name]]
    if not short:
        return
    few = " ".join(str(n) for n in args.num_split if n < args.world_size)
    needs = (f"{' and '.join(short)} {'takes' if len(short) == 1 else 'take'} at least "
             f"{args.world_size} micro-batches (one per stage)")
    if "GPipe" in short:  # this torch's GPipe; every torch's 1F1B
        needs = f"on torch {torch.__version__}, {needs}"
    elsewhere = f"GPipe on {GPIPE_RUNS_FEWER}" if "GPipe" in short else ""
    if not args.runs:
        parser.error(f"--num_split {few}: {needs}: use --num_split {args.world_size} or more"
                     + (f", or {elsewhere}" if elsewhere else ""))
    print(f"--num_split {few} skipped for {' and '.join(short)}: {needs}"
          + (f"; GPipe runs it on {GPIPE_RUNS_FEWER}" if elsewhere else ""))


# ours: the command (the page starts its ranks with torchrun, which still works here)
if __name__ == "__main__":
    # the command line (the page has none: torchrun starts its 2 ranks); extras.py adds the
    # run's flags and checks them all
    parser = argparse.ArgumentParser(
        allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="main.py's pipeline with torch.distributed.pipelining: a ResNet-50 in two "
                    "stages, each a rank, trained with each --schedule and --num_split in turn.")
    parser.add_argument("--world_size", "--world-size", type=int, default=2,
                        help="stage0 (rank 0) and stage1")
    parser.add_argument("--rank", type=int, default=None,
                        help="run this rank alone; unset: every rank (or torchrun's)")
    parser.add_argument("--master_addr", "--master-addr", default="localhost",
                        help="rank 0's address, where the ranks meet")
    parser.add_argument("--master_port", "--master-port", default="29500",
                        help="rank 0's port")
    parser.add_argument("--schedule", nargs="+", choices=SCHEDULES, default=None,
                        help="pipeline schedules, in turn (unset: GPipe and 1F1B, or GPipe alone "
                             "where 1F1B hangs: over Gloo before torch 2.8)")
    args = extras.parse_args(parser, 2, "stage0 and stage1, a stage each")
    check_schedules(parser, args, torch.cuda.device_count())

    world_size = args.world_size
    if args.rank is None:
        # Every rank on this machine, as the RPC tutorials start theirs.
        mp.spawn(run_worker, args=(world_size, args), nprocs=world_size, join=True)
    else:
        # The one rank that --rank (or torchrun) names, in a process of its own, as the
        # parameter-server tutorial starts its ranks; its exit status is the command's (a
        # signal N: 128 + N, as a shell says)
        p = mp.Process(target=run_worker, args=(args.rank, world_size, args))
        p.start()
        p.join()
        sys.exit(p.exitcode if p.exitcode >= 0 else 128 - p.exitcode)
