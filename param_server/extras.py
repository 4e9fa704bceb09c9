"""What param_server's programs add beside the tutorials, in plain code: this project's flags and
the checks that argparse cannot make, torchrun's environment, --profile's few lines, and the
run's summary. main.py and batch.py call it in lines marked "# ours:"; delete those lines and
this file, and the tutorial's code is left (with the data of data.py)."""

import argparse
import datetime
import json
import os
import resource
import socket
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from data import DATA_DIR, SYNTHETIC_TEST_SIZE, SYNTHETIC_TRAIN_SIZE, check_mnist

# Two deprecation warnings that torch's RPC stack prints from its own code, which a reader of
# the tutorial can do nothing about: RPC's agent uses a Gloo backend as a ProcessGroup...
warnings.filterwarnings("ignore", message=r".*as a ProcessGroup\. This usage is deprecated")
# ...and DistributedOptimizer's functional optimizers were written for TorchScript. torch shows
# that one under simplefilter("always"), which no filter stops, so warnings.showwarning (Python's
# documented hook) leaves that one message out.
_show_warning = warnings.showwarning


def _show_unless_torchscript_optimizer(message, *args, **kwargs):
    if not str(message).startswith("`TorchScript` support for functional optimizers"):
        _show_warning(message, *args, **kwargs)


warnings.showwarning = _show_unless_torchscript_optimizer

# Every line of every rank written whole, in one write, as soon as it is printed: the ranks
# share one terminal or file, and where Python writes a line's text and its newline apart
# (PYTHONUNBUFFERED=1), another rank's line can fall between them. A terminal shows lines so
# already; a file or pipe now does too.
if hasattr(sys.stdout, "reconfigure"):
    sys.stdout.reconfigure(line_buffering=True, write_through=False)


# --------- The flags --------------------

def at_least(low):
    """An integer argument of at least `low`: argparse's `type=`."""

    def parse(text):
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {text}")
        return value

    parse.__name__ = f"integer (>= {low})"  # argparse's "invalid integer (>= 1) value: 'x'"
    return parse


def positive_float(text):
    value = float(text)
    if not value > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be greater than 0, got {text}")
    return value


positive_float.__name__ = "number (> 0)"


def add_arguments(parser):
    """main.py's and batch.py's flags besides the tutorial's: the data and the run's length,
    --seed, --summary_json and --profile. And on the tutorial's parser: every default in --help,
    no abbreviated flags (a typo must not pass for another flag), errors in one line (argparse's
    usage lines left out)."""
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    parser.allow_abbrev = False
    parser.error = lambda message: parser.exit(2, f"{parser.prog}: error: {message}\n")
    add_data_arguments(parser)
    parser.add_argument("--seed", type=at_least(0), default=1, help="random seed")
    parser.add_argument("--summary_json", "--summary-json", metavar="PATH",
                        help="write the run's figures to this JSON file at the end")
    parser.add_argument("--profile", metavar="DIR",
                        help="write each rank's torch.profiler trace to DIR/<its name>.json "
                             "(a trainer's steps 3 to 5; the server's whole run)")


def add_data_arguments(parser):
    """The data and the length of a run, in every program of this example."""
    parser.add_argument("--dataset", choices=("mnist", "synthetic"), default="mnist",
                        help="MNIST (downloaded into --data_dir if missing), or generated digits "
                             f"({SYNTHETIC_TRAIN_SIZE} to train on, {SYNTHETIC_TEST_SIZE} to test)")
    parser.add_argument("--data_dir", "--data-dir", default=str(DATA_DIR), metavar="PATH",
                        help="folder holding MNIST/raw/")
    parser.add_argument("--epochs", type=at_least(1), default=1, metavar="N",
                        help="passes over the data")
    parser.add_argument("--max_batches", "--max-batches", type=at_least(1), metavar="N",
                        help="end each trainer's epoch after this many batches (for short runs)")
    parser.add_argument("--batch_size", "--batch-size", type=at_least(1), default=32,
                        metavar="N", help="batch size")
    parser.add_argument("--log_interval", "--log-interval", type=at_least(1), default=5,
                        metavar="N", help="print the loss every this many batches")


def add_step_arguments(parser):
    """batch.py's and actors.py's learning rate (main.py keeps the tutorial's, 0.03)."""
    parser.add_argument("--lr", type=positive_float, metavar="RATE",
                        help="SGD learning rate (unset: 0.03 times the number of gradients "
                             "that each step averages)")


# --------- What argparse cannot check --------------------

def check_args(parser, args):
    """Before any rank starts or any port opens: bad input ends the command in one line, status
    2. Under torchrun (RANK and WORLD_SIZE set, no --rank): its rank, world and store, so that
    __main__ runs that rank as if --rank had been given. args.started: the summary's clock."""
    args.started = time.time()
    args.torchrun = args.rank is None and "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if args.torchrun:
        if not os.environ["WORLD_SIZE"].isdigit():
            parser.error(f"torchrun's WORLD_SIZE is {os.environ['WORLD_SIZE']}, not a number")
        args.rank, args.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        args.master_addr = os.environ.get("MASTER_ADDR", args.master_addr)
        args.master_port = os.environ.get("MASTER_PORT", args.master_port)
    if args.world_size < 2:
        where = "torchrun's WORLD_SIZE" if args.torchrun else "argument --world_size"
        parser.error(f"{where}: must be at least 2 (a server and a trainer), got "
                     f"{args.world_size}")
    if args.rank is not None and args.rank < 0:
        parser.error(f"argument --rank: must be at least 0, got {args.rank}")
    if args.rank is not None and args.rank >= args.world_size:
        parser.error(f"--rank {args.rank} is outside a world of {args.world_size} "
                     f"(ranks 0 to {args.world_size - 1})")
    if not (str(args.master_port).isdigit() and 1 <= int(args.master_port) <= 65535):
        parser.error(f"argument --master_port: must be a port number from 1 to 65535, got "
                     f"{args.master_port}")
    if args.rank in (None, 0):  # the parameter server's machine: its model and its figures
        check_gpus(parser, getattr(args, "num_gpus", 0), torch.cuda.device_count())
        if args.summary_json:
            check_file(parser, "--summary_json", args.summary_json)
    if args.dataset == "mnist" and args.rank != 0:  # the trainers read it
        check_mnist_folder(parser, args.data_dir)
    if args.profile:
        check_folder(parser, "--profile", args.profile)
    if args.rank in (None, 0) and not args.torchrun:  # this command hosts rank 0's store
        check_port(parser, args.master_addr, int(args.master_port))


def check_gpus(parser, num_gpus, gpu_count):
    """--num_gpus: 0, 1 or 2 (the tutorial's `assert num_gpus <= 3` let 3 through), and no more
    than the parameter server's machine has. gpu_count is a parameter, so that tests can fake
    it."""
    if not 0 <= num_gpus <= 2:
        parser.error(f"--num_gpus must be 0, 1 or 2, got {num_gpus}")
    if num_gpus > gpu_count:
        parser.error(f"--num_gpus {num_gpus} asks for more GPUs than the parameter server's "
                     f"machine has ({gpu_count})")


def check_mnist_folder(parser, data_dir):
    """MNIST in data_dir, or downloadable there: otherwise one line saying what is wrong. The
    default folder (data/ beside this one) is made if missing, as the tutorial's '../data'."""
    if data_dir == str(DATA_DIR):
        DATA_DIR.mkdir(exist_ok=True)
    if not Path(data_dir).is_dir():
        parser.error(f"--data_dir {data_dir}: no such folder")
    problem = check_mnist(data_dir)
    if problem:
        parser.error(problem)


def check_file(parser, flag, path):
    """A file that the run writes at its end: its folder must be there and take a file."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        parser.error(f"{flag} {path}: that is a folder, not a file")
    if not os.path.isdir(folder):
        parser.error(f"{flag} {path}: no such folder ({folder})")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".check-"):
            pass
    except OSError as err:
        parser.error(f"{flag} {path}: cannot write in {folder} ({err.strerror or err})")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        parser.error(f"{flag} {path}: cannot write that file")


def check_folder(parser, flag, folder):
    """A folder to write in, made if missing."""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as err:
        parser.error(f"{flag} {folder}: cannot make that folder ({err.strerror or err})")
    if not os.access(folder, os.W_OK | os.X_OK):
        parser.error(f"{flag} {folder}: cannot write in that folder")


def check_port(parser, addr, port):
    """Rank 0's store listens on --master_addr:--master_port: try it now, and close."""
    try:
        family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0][0]
        socket.create_server((addr, port), family=family).close()
    except (OSError, UnicodeError) as err:
        reason = getattr(err, "strerror", None) or str(err)
        parser.error(f"cannot listen on {addr}:{port} ({reason}): choose another --master_port")


# --------- --profile DIR --------------------

class NoProfile:
    """Without --profile: a profiler that does nothing."""

    def step(self):
        pass

    def stop(self):
        pass


def profiler(args, name, rank, loops=True):
    """--profile DIR: a started torch.profiler of this rank, which writes DIR/<name>.json. A rank
    that loops (loops=True) records its steps 3 to 5 (prof.step() once a step); one that serves
    records until prof.stop(). Every thread where this torch can (2.4 records only its own)."""
    if not args.profile:
        return NoProfile()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    try:
        every_thread = {"experimental_config": torch._C._profiler._ExperimentalConfig(
            profile_all_threads=True)}
    except TypeError:  # an older torch
        every_thread = {}
    schedule = torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1) if loops else None
    prof = torch.profiler.profile(activities=activities, schedule=schedule, **every_thread,
                                  on_trace_ready=lambda prof: write_trace(prof, args.profile, name))
    prof.preset_metadata_json("rank", json.dumps(rank))  # for a merge, in rank order
    prof.start()
    return prof


def write_trace(prof, folder, name):
    """The trace, written whole (a killed rank leaves none, not half of one)."""
    path = Path(folder) / f"{name}.json"
    part = path.with_name(f".{name}.json")
    prof.export_chrome_trace(str(part))
    os.replace(part, path)
    print(f"{name}: profiled, wrote {path} ({path.stat().st_size // 1024} kB)", flush=True)


# --------- The summary --------------------

# This process's figures (a trainer's), and those that the other ranks sent to this one (the
# coordinating rank's), by rank name: rpc.rpc_sync(<its name>, extras.report, args=(...)).
measured = {}
reports = {}


def peak_memory_mb():
    """This process's most resident memory so far, in MB (ru_maxrss: kB on Linux, bytes on
    macOS), and its GPU's where it used one."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = {"rss": rss // (2**20 if sys.platform == "darwin" else 2**10)}
    if torch.cuda.is_initialized():
        peak["cuda"] = torch.cuda.max_memory_allocated() // 2**20
    return peak


def report(name, figures):
    """Run on the coordinating rank, through RPC: a rank's figures, for the summary."""
    reports[name] = figures


def figures():
    """What this rank measured, with its peak memory, for report()."""
    return {**measured, "peak_memory_mb": peak_memory_mb()}


def write_summary(args, reports, mode="tutorial", more=None, more_line=""):
    """The run's figures and its summary line, from what each trainer reported (its accuracy,
    batches and training seconds); batch.py and actors.py add their own (`more`, `more_line`)."""
    trainers = {name: report for name, report in sorted(reports.items()) if "accuracy" in report}
    accuracy = sum(r["accuracy"] for r in trainers.values()) / len(trainers)
    samples = sum(r["batches"] for r in trainers.values()) * args.batch_size
    seconds = max(r["train_seconds"] for r in trainers.values())
    figures = {"example": "param_server", "mode": mode, "dataset": args.dataset,
               "world_size": args.world_size, "trainers": len(trainers), "epochs": args.epochs,
               "accuracy": accuracy, "samples": samples,
               "samples_per_second": round(samples / seconds, 1), "train_seconds": seconds,
               "accuracy_per_trainer": {name: r["accuracy"] for name, r in trainers.items()},
               "batches_per_trainer": {name: r["batches"] for name, r in trainers.items()},
               **(more or {})}
    line = (f"accuracy {accuracy:.4f} over {len(trainers)} trainer(s), "
            f"{samples / seconds:.1f} samples/s in training{more_line}")
    return figures, line


def print_summary(args, name, summarize=write_summary):
    """The coordinating rank's last line, once its rpc.shutdown() has returned: "Summary: ...;
    N s in all", and with --summary_json the run's figures, each rank's peak memory and the wall
    seconds. A file that cannot be written: one line after the Summary line, status 1."""
    memory = {name: peak_memory_mb()}
    by_rank = {}
    for other, figures_of_other in reports.items():
        figures_of_other = dict(figures_of_other)
        if "peak_memory_mb" in figures_of_other:
            memory[other] = figures_of_other.pop("peak_memory_mb")
        by_rank[other] = figures_of_other
    if not any("accuracy" in figures_of_rank for figures_of_rank in by_rank.values()):
        print("Summary: not written: no trainer sent its figures", file=sys.stderr)
        sys.exit(1)
    summary, line = summarize(args, by_rank)
    summary["peak_memory_mb"] = memory
    summary["wall_seconds"] = round(time.time() - args.started, 3)
    print(f"Summary: {line}; {summary['wall_seconds']:.1f} s in all", flush=True)
    if args.summary_json:
        try:
            Path(args.summary_json).write_text(json.dumps(summary, indent=2) + "\n")
        except OSError as error:
            sys.exit(f"--summary_json {args.summary_json}: not written "
                     f"({error.strerror or error}); the Summary line has the run's figures")


# --------- ours: torch's store, kept until every rank is past rpc.shutdown() --------------------

def hold_store(args, rank, port=None):
    """torch's graceful rpc.shutdown() ends with a barrier on the store where the ranks met, in
    rank 0's process, after which each rank reads a count there once more. Rank 0 may be first
    past it and end, closing the store under a rank still reading it: that rank's
    rpc.shutdown() fails ("Connection reset by peer", seen on a busy machine). So every rank
    opens the store once more before rpc.shutdown() (rank 0's shares its server, as torch's
    multi-tenant stores of one port do), and rank 0 keeps it until every rank says it is past
    rpc.shutdown() (release_store). Under torchrun, its agent holds the store: nothing to do."""
    if getattr(args, "torchrun", False):
        return None
    return dist.TCPStore(args.master_addr, int(port or args.master_port), is_master=rank == 0,
                         multi_tenant=True, timeout=datetime.timedelta(seconds=60))


def release_store(args, rank, store):
    """After rpc.shutdown(): say so in the store; rank 0 waits until every rank has (60 s at
    most), before its store closes."""
    if store is None:
        return
    if store.add("ranks past rpc.shutdown", 1) == args.world_size:
        store.set("every rank past rpc.shutdown", "")
    if rank == 0:
        store.wait(["every rank past rpc.shutdown"])
