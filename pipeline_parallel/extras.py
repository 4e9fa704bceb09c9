"""What this project adds beside the tutorials' code in main.py and pipelining.py: the run's flags
and the checks that argparse cannot make, torchrun's environment, where a shard runs and how its
blocks start, each batch's loss and seconds, the run's summary, and --profile's few lines of
torch.profiler. Plain torch and the standard library; delete it with the lines that call it."""

import argparse
import json
import os
import resource
import socket
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torchvision.models.resnet import Bottleneck

# torch's RPC stack warns from its own code, not the program's: DistributedOptimizer over
# optim.SGD says "TorchScript support for functional optimizers is deprecated" (torch 2.4 as
# main.py imports it, later ones under simplefilter("always"), so a filter is not enough:
# Python's warnings.showwarning hook leaves that message out), and torch 2.4's RPC warns
# about a ProcessGroupGloo used as a ProcessGroup.
warnings.filterwarnings("ignore", message=r".*as a ProcessGroup\. This usage is deprecated")
_show = warnings.showwarning


def _show_unless_torchscript_optimizer(message, *args, **kwargs):
    if "`TorchScript` support for functional optimizers" not in str(message):
        _show(message, *args, **kwargs)


warnings.showwarning = _show_unless_torchscript_optimizer

# Every line of every rank written whole, in one write, as soon as it is printed: the ranks
# share one terminal or file, and where Python writes a line's text and its newline apart
# (PYTHONUNBUFFERED=1), another rank's line can fall between them.
if hasattr(sys.stdout, "reconfigure"):
    sys.stdout.reconfigure(line_buffering=True, write_through=False)


# --------- The command line --------------------

def at_least(low):
    """An argparse type: an integer of at least `low`."""
    def integer(text):
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {text}")
        return value
    integer.__name__ = f"integer (>= {low})"  # argparse names it when int() fails
    return integer


def positive(text):
    """An argparse type: a number greater than 0 (NaN is refused too)."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0, got {text}")
    return value


def parse_args(parser, world_size, roles, argv=None):
    """The program's command line: its parser (the tutorial's flags: --world_size, --rank,
    --master_addr, --master_port) with this project's flags added, parsed and checked. Bad input
    ends the command here with one line and status 2, before any rank starts or any port opens.
    world_size: the ranks the program runs; roles: what they are, for the message."""
    # argparse's errors in one line, without the usage above it (--help shows that)
    parser.error = lambda message: parser.exit(2, f"{parser.prog}: error: {message}\n")
    parser.add_argument("--num_split", "--num-split", type=at_least(1), nargs="+",
                        default=[1, 2, 4, 8], metavar="N",
                        help="micro-batches per batch; several (1 2 4) run in turn")
    parser.add_argument("--batch_size", "--batch-size", type=at_least(1), default=32,
                        metavar="N", help="images per batch (the tutorial's 120)")
    # >= 64: below, shard 2 ends at 1 x 1 pixel, where batch norm fails on a 1-image micro-batch
    parser.add_argument("--image_size", "--image-size", type=at_least(64), default=64,
                        metavar="PIXELS", help="images' height and width (the tutorial's 128)")
    parser.add_argument("--num_batches", "--num-batches", type=at_least(1), default=20,
                        metavar="N", help="batches for each --num_split (the tutorial's 3)")
    parser.add_argument("--lr", type=positive, default=0.05, metavar="RATE",
                        help="SGD learning rate")
    parser.add_argument("--seed", type=at_least(0), default=1, metavar="N", help="random seed")
    parser.add_argument("--summary_json", "--summary-json", default=None, metavar="PATH",
                        help="rank 0 writes the run's figures to this JSON file at the end")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="each rank writes its torch.profiler trace to DIR/<its name>.json")
    args = parser.parse_args(argv)
    check_args(parser, args, world_size, roles)
    return args


def check_args(parser, args, world_size, roles):
    """What argparse cannot check. Under torchrun (RANK and WORLD_SIZE set, no --rank), its
    rank, world and meeting place stand for --rank, --world_size, --master_addr and
    --master_port, and __main__ runs that one rank."""
    args.started = time.time()  # the summary's wall seconds count from here
    args.torchrun = args.rank is None and "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if args.torchrun:
        if not (os.environ["RANK"].isdigit() and os.environ["WORLD_SIZE"].isdigit()):
            parser.error(f"torchrun's RANK {os.environ['RANK']} and WORLD_SIZE "
                         f"{os.environ['WORLD_SIZE']} are not numbers")
        args.rank, args.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        args.master_addr = os.environ.get("MASTER_ADDR", args.master_addr)
        args.master_port = os.environ.get("MASTER_PORT", args.master_port)
    if args.world_size != world_size:
        started = (f"torchrun started {args.world_size} processes" if args.torchrun
                   else f"not --world_size {args.world_size}")
        parser.error(f"this example runs {world_size} ranks ({roles}), {started}")
    if args.rank is not None and not 0 <= args.rank < world_size:
        parser.error(f"--rank {args.rank} is outside a world of {world_size} "
                     f"(ranks 0 to {world_size - 1})")
    if not (str(args.master_port).isdigit() and 1 <= int(args.master_port) <= 65535):
        parser.error(f"--master_port {args.master_port}: not a port number from 1 to 65535")
    args.master_port = str(int(args.master_port))  # as os.environ takes it
    try:
        family = socket.getaddrinfo(args.master_addr, args.master_port,
                                    type=socket.SOCK_STREAM)[0][0]
    except (OSError, UnicodeError):
        parser.error(f"--master_addr {args.master_addr}: no such host")
    if max(args.num_split) > args.batch_size:
        parser.error(f"--num_split {max(args.num_split)} is more micro-batches than the "
                     f"{args.batch_size} images of a batch (--batch_size)")
    hosts_rank_0 = args.rank in (None, 0)
    if args.summary_json and hosts_rank_0:  # rank 0 writes it
        check_file(parser, args.summary_json)
    if args.profile:
        try:
            os.makedirs(args.profile, exist_ok=True)
        except OSError as err:
            parser.error(f"--profile {args.profile}: cannot make that folder "
                         f"({err.strerror or err})")
        if not os.access(args.profile, os.W_OK | os.X_OK):
            parser.error(f"--profile {args.profile}: cannot write in that folder")
    if hosts_rank_0 and not args.torchrun:  # (under torchrun, its agent holds the port)
        try:
            socket.create_server((args.master_addr, int(args.master_port)), family=family).close()
        except OSError as err:
            parser.error(f"cannot listen on {args.master_addr}:{args.master_port} "
                         f"({err.strerror or err}): choose another --master_port")


def check_file(parser, path):
    """--summary_json: its folder must be there and take a new file, and the file, where it is
    there already, must be a file that can be written."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        parser.error(f"--summary_json {path}: that is a folder, not a file")
    if not os.path.isdir(folder):
        parser.error(f"--summary_json {path}: no such folder ({folder})")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        parser.error(f"--summary_json {path}: cannot write that file")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".summary-check-"):
            pass
    except OSError as err:
        parser.error(f"--summary_json {path}: cannot write in {folder} ({err.strerror or err})")


# --------- main.py's shards --------------------

def choose_device(device, gpu_count=None):
    """The tutorial's device for a shard (cuda:0 for shard 1, cuda:1 for shard 2), on the worker
    that builds it: that GPU where the worker's machine has it, another of its GPUs where it has
    fewer (both shards on cuda:0 with one GPU), else the CPU. Tests fake gpu_count."""
    gpu_count = torch.cuda.device_count() if gpu_count is None else gpu_count
    index = torch.device(device).index or 0
    return torch.device(f"cuda:{index % gpu_count}" if gpu_count else "cpu")


def zero_init_residuals(shard):
    """Every residual block of the shard starts as the identity: the last batch norm of each
    block at 0 (torchvision's zero_init_residual). SGD at the tutorial's 0.05 then trains
    ResNet-50 from scratch without diverging."""
    for m in shard.modules():
        if isinstance(m, Bottleneck):
            nn.init.constant_(m.bn3.weight, 0)


# --------- Each batch's loss and seconds; the summary --------------------

FIGURES = {}  # each setting's figures ("2", or "GPipe 2"), in this process: the summary's
MEMORY = {}  # main.py's master: each rank's peak memory, which it asked for


class Progress:
    """The batches of one setting: a line after each with its loss and seconds, and at the end
    the setting's figures for the summary (seconds a batch, without the first, a warm-up)."""

    def __init__(self, setting):
        self.setting = setting  # how the line starts: "num_split 2", "GPipe, n_microbatches 2"
        self.losses, self.seconds, self.started = [], [], None

    def start(self):
        self.started = time.perf_counter()

    def end(self, i, loss=None):
        """Batch i is done, with this loss (None: this rank has none)."""
        self.seconds.append(time.perf_counter() - self.started)
        if loss is not None:
            self.losses.append(loss.item())
            print(f"{self.setting}, batch {i}: loss {self.losses[-1]:.4f}, "
                  f"{self.seconds[-1]:.3f} s")

    def report(self, key):
        steady = self.seconds[1:] or self.seconds
        figures = {"seconds_per_batch": round(sum(steady) / len(steady), 4)}
        if self.losses:
            figures.update(first_loss=self.losses[0], last_loss=self.losses[-1])
        FIGURES[key] = figures


def peak_memory_mb():
    """This process's most resident memory so far, and its GPU's where it used one, in MB."""
    peak = {"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}  # kB on Linux
    if torch.cuda.is_initialized():
        peak["cuda"] = torch.cuda.max_memory_allocated() // 2**20
    return peak


def write_summary(args, figures, line):
    """Rank 0, at the end: the Summary line, its last, and --summary_json with the figures. A
    file that cannot be written now says so in one line after it, and the rank's status is 1."""
    figures["wall_seconds"] = round(time.time() - args.started, 3)
    print(f"Summary: {line}; {figures['wall_seconds']:.1f} s in all", flush=True)
    if args.summary_json:
        try:
            with open(args.summary_json, "w") as file:
                file.write(json.dumps(figures, indent=2) + "\n")
        except OSError as err:
            print(f"--summary_json {args.summary_json}: not written ({err.strerror or err}); "
                  "the Summary line has the run's figures", file=sys.stderr, flush=True)
            sys.exit(1)


def main_summary(args):
    """main.py's summary: each --num_split's seconds a batch and first and last loss, from the
    master, and each rank's peak memory (MEMORY: its name -> peak_memory_mb())."""
    splits = {key: FIGURES[key] for key in map(str, args.num_split)}
    figures = {"example": "pipeline_parallel", "batch_size": args.batch_size,
               "image_size": args.image_size, "num_batches": args.num_batches,
               "splits": splits, "peak_memory_mb": MEMORY}
    line = ", ".join(f"num_split {n}: {s['seconds_per_batch']:.3f} s a batch, loss "
                     f"{s['first_loss']:.3f} -> {s['last_loss']:.3f}" for n, s in splits.items())
    if len(splits) > 1:
        line += f"; fastest: num_split {min(splits, key=lambda n: splits[n]['seconds_per_batch'])}"
    write_summary(args, figures, line)


def pipelining_summary(args, stages):
    """pipelining.py's summary, from what each stage sent rank 0 (`stages`: one dict a stage,
    its name, peak memory and figures): each schedule's and count's seconds a batch, from the
    last stage, with its first and last loss."""
    last = stages[-1]["figures"]
    schedules = {}
    for key, figures in last.items():
        schedule_name, num_microbatches = key.split()
        schedules.setdefault(schedule_name, {})[num_microbatches] = figures
    figures = {"example": "pipeline_parallel/pipelining", "batch_size": args.batch_size,
               "image_size": args.image_size, "num_batches": args.num_batches,
               "schedules": schedules,
               "peak_memory_mb": {stage["name"]: stage["memory"] for stage in stages}}
    line = ", ".join(f"{key}: {s['seconds_per_batch']:.3f} s a batch, loss "
                     f"{s['first_loss']:.3f} -> {s['last_loss']:.3f}" for key, s in last.items())
    write_summary(args, figures, line)


# --------- The end of main.py's ranks --------------------

def hold_store(args, rank):
    """torch's graceful rpc.shutdown() ends with a barrier on rank 0's store, after which each
    rank reads a count there. Rank 0 may read first and close the store as its rpc.shutdown()
    returns: a rank still reading fails ("Connection reset by peer", seen with a rank a command
    on a busy machine). So rank 0 holds the store (a second TCPStore on its port shares its
    server), and each rank says when it is past rpc.shutdown(). Under torchrun, its agent holds
    the store: nothing to do."""
    if args.torchrun:
        return None
    return dist.TCPStore(args.master_addr, int(args.master_port), is_master=rank == 0,
                         multi_tenant=True)


def finish(args, rank, store):
    """After rpc.shutdown(): rank 0 waits for every rank to be past it, before its store
    closes; this rank's --profile trace; on the master, the summary, its last line."""
    if store is not None:
        if store.add("ranks past rpc.shutdown", 1) == args.world_size:
            store.set("every rank past rpc.shutdown", "")
        if rank == 0:
            store.wait(["every rank past rpc.shutdown"])
    stop_profile()
    if rank == 0:
        main_summary(args)


# --------- --profile DIR --------------------

PROFILER = []  # this rank's profiler, and its name, while it records


def start_profile(args, rank, name, loops=False):
    """--profile: this rank's torch.profiler, recording every thread where this torch can (2.4
    records its own only). A rank that loops (loops=True, profile_step() once a step) records
    steps 3 to 5; one that serves, from now to stop_profile()."""
    if not args.profile:
        return
    try:
        every_thread = {"experimental_config": torch._C._profiler._ExperimentalConfig(
            profile_all_threads=True)}
    except TypeError:  # torch 2.4: no such option
        every_thread = {}
    kinds = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        kinds.append(torch.profiler.ProfilerActivity.CUDA)
    prof = torch.profiler.profile(
        activities=kinds, on_trace_ready=lambda prof: write_trace(prof, args.profile, name),
        schedule=torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1) if loops else None,
        **every_thread)
    prof.preset_metadata_json("rank", json.dumps(rank))  # the merge orders the tracks by it
    prof.start()
    PROFILER[:] = [prof, name]


def profile_step():
    """A looping rank's step: --profile's window moves on."""
    if PROFILER:
        PROFILER[0].step()


def stop_profile():
    """The end of this rank's recording: its trace is written, or a line says why not."""
    if PROFILER:
        prof, name = PROFILER
        prof.stop()  # a looping rank stopped inside its window writes what it recorded
        if PROFILER:  # not written: the run ended before the window opened
            print(f"{name}: profiled nothing: the run ended before its step 3", flush=True)
            PROFILER.clear()


def write_trace(prof, folder, name):
    """The trace, written whole (to .<name>.json, then renamed), and its line."""
    path, part = os.path.join(folder, f"{name}.json"), os.path.join(folder, f".{name}.json")
    prof.export_chrome_trace(part)
    os.replace(part, path)
    PROFILER.clear()
    print(f"{name}: profiled, wrote {path} ({os.path.getsize(path) // 1024} kB)", flush=True)
