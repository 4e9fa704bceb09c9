"""The same pipeline with today's API: main.py's ResNet-50, cut into the same two shards, trained on
the same data with torch.distributed.pipelining, in the order and names of its tutorial,
"Introduction to Distributed Pipeline Parallelism". Each rank is a stage (`stage0`, `stage1`);
a schedule (GPipe, 1F1B) moves the micro-batches between them with send and recv, and the last
stage owns the loss. No master, no RPC. README.md, "The same model with today's API", sets the
two programs side by side. rpc_harness, this project's package, bounds every wait and ends every
rank in one line when one fails; each of its names is explained where it is first used here.

Built from that tutorial (README.md names its revision): its globals, init_distributed,
manual_model_split, its schedule and steps. Each line that is not its code ends with, or
follows, a "# ours:" comment that says why.

    python pipelining.py                                    # every stage on this machine
    python pipelining.py --rank R                           # one stage per terminal, R = 0, 1
    torchrun --nnodes 1 --nproc_per_node 2 pipelining.py    # as the tutorial starts them
"""

import copy  # ours: torch 2.4's example shapes (example_args_for_torch_2_4)
import datetime  # ours: the bound on each send and receive
import inspect  # ours: what this torch's PipelineStage and schedules take
import os
import sys  # ours: the command's exit status
import time  # ours: each batch's seconds

import torch
import torch.distributed as dist
import torch.multiprocessing as mp  # ours: the launch without torchrun
import torch.nn as nn
import torch.optim as optim  # ours: a step (the page makes none)
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe  # ours: 1F1B
from torchvision.models import resnet50  # ours: main.py's model (the page's: a Transformer)

try:  # ours: this project's package, or one line that says how to install it
    import rpc_harness
except ModuleNotFoundError:  # ours: (above)
    raise SystemExit("rpc_harness, this project's package, is missing: install it with "
                     "`pip install -e PATH`, PATH being the repository's folder (the one that "
                     "holds pyproject.toml), or run `make run` there") from None

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


def init_distributed(this_rank, world_size, args):  # ours: the rank, world and flags
    global rank, device, pp_group, stage_index, num_stages
    # ours: the page reads its rank and world size, and init_process_group() where to meet,
    # from what torchrun sets; here from the command line (under torchrun, torchrun's values).
    os.environ['MASTER_ADDR'] = args.master_addr  # ours: (above)
    os.environ['MASTER_PORT'] = str(args.master_port)  # ours: (above)
    rank = this_rank  # ours: (above)
    # ours: NCCL on cuda:R, or Gloo on the CPU (the page: cuda:R whenever CUDA exists, and
    # init_process_group's default backend)
    backend, device = choose_backend_and_device(rank, world_size, torch.cuda.device_count())
    if device.type == "cuda":  # ours: (above)
        torch.cuda.set_device(device)  # ours: (above)
    # ours: rpc_harness.init_method(args): the ranks meet through rpc_harness, where
    # MASTER_ADDR and MASTER_PORT say (as the default env:// would), with bounded waits, and
    # every rank ends in one line when one is lost. timeout: the bound of each send, receive
    # and collective, --rpc_timeout (torch's default is 30 minutes; 10 with NCCL).
    dist.init_process_group(backend, rank=rank, world_size=world_size,  # ours: (above)
                            init_method=rpc_harness.init_method(args),
                            timeout=datetime.timedelta(seconds=args.rpc_timeout))

    # This group can be a sub-group in the N-D parallel case
    pp_group = dist.new_group()
    stage_index = rank
    num_stages = world_size


# Step 1: Partition the model

def manual_model_split(model, example_input_microbatch) -> PipelineStage:  # ours: examples
    examples = example_args_for_torch_2_4(model, example_input_microbatch)  # ours: (above)
    if stage_index == 0:
        # prepare the first stage model
        model.shard2 = None  # ours: this model's half (the page deletes Transformer layers)
    elif stage_index == 1:
        # prepare the second stage model
        model.shard1 = None  # ours: (above)

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

    losses_of_batches, seconds = [], []
    for i, (x, y) in enumerate(class_images(args.num_batches, args.batch_size, args.image_size,
                                            args.seed)):
        rpc_harness.profile_step()  # --profile's window; nothing without --profile
        started = time.perf_counter()
        opt.zero_grad()
        if stage_index == 0:
            schedule.step(x.to(device))
        elif stage_index == num_stages - 1:
            losses = []
            schedule.step(target=y.to(device), losses=losses)
        mean_of_microbatches_for_torch_2_4(model, num_microbatches)
        opt.step()
        seconds.append(time.perf_counter() - started)
        if stage_index == num_stages - 1:
            losses_of_batches.append(torch.stack(losses).mean().item())
            print(f"{schedule_name}, n_microbatches {num_microbatches}, batch {i}: loss "
                  f"{losses_of_batches[-1]:.4f}, {seconds[-1]:.3f} s")
    report(schedule_name, num_microbatches, losses_of_batches, seconds)  # the summary's figures


# Step 3: Launch the distributed processes

# ours: every rank runs this (the page's __main__ calls init_distributed, then trains once):
# each --schedule and --num_split in turn
@rpc_harness.watched  # ours: this rank ends in one line if it fails or loses a peer
def run_worker(rank, world_size, args):
    init_distributed(rank, world_size, args)
    print(f"stage {stage_index} of {num_stages} on {device}")
    for schedule_name in args.schedule:
        for num_microbatches in args.num_split:
            if schedule_name == "1F1B" and num_microbatches < num_stages:
                continue  # refused by 1F1B; the command line said so
            train(schedule_name, num_microbatches, args)
    dist.destroy_process_group()


# --------- ours: torch 2.4, devices, names, the summary ---------

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


ONE_F_ONE_B_NEEDS = (f"1F1B over Gloo needs torch 2.8 or later, not {torch.__version__}: before, "
                     "it waited for only one of each batch of sends and receives, and hung "
                     "(pytorch/pytorch#132644)")


def gloo_refused_at_start(gpu_count):
    """Why this torch cannot run the schedules over Gloo, or None. torch 2.9's schedules start by
    sending each neighbour an int64 and receiving a float32 (PipelineStage's
    _get_init_p2p_neighbors_ops), and Gloo, which checks sizes, aborts the process ("8 vs 4");
    2.8 and 2.10 do not (found by make versions)."""
    version = tuple(int(part) for part in torch.__version__.split(".")[:2])
    if version != (2, 9) or choose_backend_and_device(0, 2, gpu_count)[0] == "nccl":
        return None
    return (f"pipelining.py cannot run over Gloo on torch {torch.__version__}: its schedules "
            "start with a send and a receive of different sizes, which Gloo refuses; use torch "
            "2.8, or 2.10 or later (or a GPU per stage, with NCCL)")


def one_f_one_b_works(gpu_count):
    version = tuple(int(part) for part in torch.__version__.split(".")[:2])
    return version >= (2, 8) or choose_backend_and_device(0, 2, gpu_count)[0] == "nccl"


def choose_backend_and_device(stage_rank, num_stages, gpu_count):
    """NCCL with stage R on cuda:R when every stage has a GPU of its own (NCCL refuses two
    ranks on one GPU), else Gloo on the CPU. Tests fake gpu_count."""
    if gpu_count >= num_stages:
        return "nccl", torch.device(f"cuda:{stage_rank}")
    return "gloo", torch.device("cpu")


def stage_name(rank, world_size):
    """Each rank's name, which the harness's messages and the summary use."""
    return f"stage{rank}"


def every_stage(rank, world_size):
    """Every rank is a stage: each computes (they share the cores) and loops over the batches
    (--profile records its steps)."""
    return True


def report(schedule_name, num_microbatches, losses, seconds):
    """Seconds per batch, without the first batch (warm-up), and the
    last stage's losses, for the run's summary, which rank 0 writes at the end."""
    steady = seconds[1:] or seconds
    figures = {"seconds_per_batch": round(sum(steady) / len(steady), 4)}
    if losses:  # the last stage's
        figures.update(first_loss=losses[0], last_loss=losses[-1])
    rpc_harness.report(**{f"{schedule_name} {num_microbatches}": figures})


def write_summary(args, reports):
    """The run's figures and its line: each schedule's and count's seconds a batch and first
    and last loss, from what the last stage reported."""
    runs = reports[stage_name(args.world_size - 1, args.world_size)]
    schedules = {}
    for key, figures in runs.items():
        schedule_name, num_microbatches = key.split()
        schedules.setdefault(schedule_name, {})[num_microbatches] = figures
    return ({"example": "pipeline_parallel/pipelining", "batch_size": args.batch_size,
             "image_size": args.image_size, "num_batches": args.num_batches,
             "schedules": schedules},
            ", ".join(f"{key}: {s['seconds_per_batch']:.3f} s a batch, loss "
                      f"{s['first_loss']:.3f} -> {s['last_loss']:.3f}" for key, s in runs.items()))


# --------- ours: the tutorial's launch, with a command line --------------------

def parse_args(argv=None):
    """The command line (the tutorial has none: torchrun starts its 2 ranks), with this
    project's flags, checked: bad input ends the command here in one line, status 2."""
    # rpc_harness.ArgumentParser: argparse's, with every default in --help and errors in one
    # line (status 2). rpc_harness.int_at_least(N), port_number and positive_float: argument
    # types that refuse what a plain int or float would let through.
    parser = rpc_harness.ArgumentParser(description=(
        "The pipeline of main.py with torch.distributed.pipelining: a ResNet-50 in two stages, "
        "stage0 and stage1, each a rank, trained with each --schedule and --num_split in turn."))
    at_least = rpc_harness.int_at_least
    parser.add_argument("--world_size", "--world-size", type=at_least(2), default=2,
                        help="total number of processes: stage0 (rank 0) and stage1")
    parser.add_argument("--rank", type=at_least(0), default=None,
                        help="rank of this process, which is its stage. Without it, every rank "
                             "starts here (or torchrun's RANK)")
    parser.add_argument("--master_addr", "--master-addr",
                        default=os.environ.get("MASTER_ADDR", "localhost"),
                        help="address of rank 0, where every rank meets (localhost, or "
                             "$MASTER_ADDR, which torchrun sets)")
    parser.add_argument("--master_port", "--master-port", type=rpc_harness.port_number,
                        default=os.environ.get("MASTER_PORT", "29500"),
                        help="port of rank 0, where every rank meets (29500, or $MASTER_PORT, "
                             "which torchrun sets)")
    # This example's settings (those of main.py, and --schedule); then the
    # flags that every example of this project has (timeouts, --seed, --summary_json,
    # --profile), but --rpc_transport: there is no RPC here.
    parser.add_argument("--schedule", nargs="+", choices=SCHEDULES, default=None,
                        help="pipeline schedules, timed in turn. Default: GPipe and 1F1B (GPipe "
                             "alone where 1F1B hangs: over Gloo before torch 2.8)")
    parser.add_argument("--num_split", "--num-split", type=at_least(1), nargs="+",
                        default=[1, 2, 4, 8], metavar="N",
                        help="micro-batches per batch (n_microbatches), each timed in turn; 1F1B "
                             "needs at least one per stage, and runs only those")
    parser.add_argument("--batch_size", "--batch-size", type=at_least(1), default=32,
                        metavar="N", help="images per batch; every --num_split must divide it")
    # >= 64: below, shard 2 ends at 1 x 1 pixel, where batch norm fails on a 1-image micro-batch
    parser.add_argument("--image_size", "--image-size", type=at_least(64), default=64,
                        metavar="PIXELS", help="height and width of the images")
    parser.add_argument("--num_batches", "--num-batches", type=at_least(1), default=20,
                        metavar="N", help="batches trained for each schedule and --num_split")
    parser.add_argument("--lr", type=rpc_harness.positive_float, default=0.05, metavar="RATE",
                        help="SGD learning rate")
    rpc_harness.add_arguments(parser, rpc_transport=None)
    args = parser.parse_args(argv)
    # rpc_harness.check_args: what argparse cannot check (the world, the rank, the address and
    # port, --profile's folder); torchrun's RANK and WORLD_SIZE stand for --rank and
    # --world_size; args.harness records what rpc_harness needs in every rank.
    rpc_harness.check_args(parser, args, stage_name, computes=every_stage, loops=every_stage,
                           summary=write_summary)
    check_schedules(parser, args)
    return args


def check_schedules(parser, args):
    """Two stages; counts of micro-batches that divide a batch; the
    schedules that this torch and these devices can run (args.schedule, when unset)."""
    if args.world_size != 2:
        parser.error(f"this example runs 2 ranks, one a stage (stage0 and stage1), not "
                     f"--world_size {args.world_size}")
    uneven = [n for n in args.num_split if args.batch_size % n]
    if uneven:
        parser.error(f"--num_split {uneven[0]} does not divide the {args.batch_size} images of a "
                     f"batch (--batch_size): a stage's micro-batches must all have one shape")
    refused = gloo_refused_at_start(torch.cuda.device_count())
    if refused:
        parser.error(refused)
    works = one_f_one_b_works(torch.cuda.device_count())
    if args.schedule is None:
        args.schedule = list(SCHEDULES) if works else ["GPipe"]
    elif "1F1B" in args.schedule and not works:
        parser.error(ONE_F_ONE_B_NEEDS)
    if args.schedule == ["1F1B"] and max(args.num_split) < args.world_size:
        parser.error(f"--schedule 1F1B needs at least {args.world_size} micro-batches (one per "
                     f"stage), not --num_split {max(args.num_split)}")
    if "1F1B" in args.schedule and min(args.num_split) < args.world_size:
        print(f"1F1B runs with {args.world_size} micro-batches or more (one per stage) only")


# ours: the command (the page starts its ranks with torchrun, which still works here)
if __name__ == "__main__":
    args = parse_args()
    # When a rank fails or is killed, or on Ctrl-C or SIGTERM, this command stops the ranks it
    # started and says why in one line.
    rpc_harness.supervise(args)
    # spawn, mp.spawn's own way: the rank that --rank names starts in a fresh interpreter too
    mp.set_start_method("spawn")

    # The tutorial starts its ranks with `torchrun --nnodes 1 --nproc_per_node 2
    # pipelining_tutorial.py`, which still works here (each torchrun process runs the rank that
    # RANK names, below); without torchrun, this command starts them.
    processes = []
    world_size = args.world_size
    if args.rank is None:
        # Every rank on this machine, as the RPC tutorials start theirs.
        mp.spawn(run_worker, args=(world_size, args), nprocs=world_size, join=True)
    else:
        # The one rank that --rank (or torchrun) names, in a process of its own, as the
        # parameter-server tutorial starts its ranks.
        p = mp.Process(target=run_worker, args=(args.rank, world_size, args))
        p.start()
        processes.append(p)

        for p in processes:
            p.join()
        # The rank's exit status is the command's; rpc_harness.exit_status says, in one line,
        # when a signal killed the rank (which then could not say it).
        sys.exit(rpc_harness.exit_status(p))
