"""What rnn_model_parallel's main.py adds beside the tutorial, in plain code: this project's flags
and the checks that argparse cannot make, torchrun's environment, the ranks' names, each epoch's
loss, --profile's few lines of torch.profiler, and the run's summary. main.py calls it from lines
marked "# ours:"; delete those lines and this file, and the tutorial's code is left (with the
data of data.py)."""

import argparse
import datetime
import json
import math
import os
import resource
import socket
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from data import SYNTHETIC_NTOKEN, check_corpus

# init_rpc uses its agent's Gloo process group through an API that torch itself deprecated in
# 2.0, and warns so in every rank: nothing that the tutorial's code can change.
warnings.filterwarnings("ignore", message=r".*as a ProcessGroup\. This usage is deprecated")
# DistributedOptimizer runs optim.SGD as one of torch's functional optimizers, which were written
# for TorchScript: torch warns that this is deprecated, from its own code, which the tutorial's
# reader can do nothing about. torch shows it under simplefilter("always"), which no filter
# stops, so Python's documented hook, warnings.showwarning, leaves that one message out.
_show_warning = warnings.showwarning


def _show_unless_torchscript_optimizer(message, *args, **kwargs):
    if "`TorchScript` support for functional optimizers" not in str(message):
        _show_warning(message, *args, **kwargs)


warnings.showwarning = _show_unless_torchscript_optimizer

# Every line of every rank written whole, in one write, as soon as it is printed: the ranks
# share one terminal or file, and where Python writes a line's text and its newline apart
# (PYTHONUNBUFFERED=1), another rank's line can fall between them. A terminal shows lines so
# already; a file or pipe now does too.
if hasattr(sys.stdout, "reconfigure"):
    sys.stdout.reconfigure(line_buffering=True, write_through=False)

DESCRIPTION = (
    "Distributed RNN: ps (rank 0) holds the embedding table and the decoder, each trainer an "
    f"LSTM (and a model of its own). Without --corpus, a synthetic task of {SYNTHETIC_NTOKEN} "
    "tokens; with it, a word-level language model of a text file.")


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


def positive_float(text):
    """An argparse type: a number greater than 0."""
    value = float(text)
    if not value > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be greater than 0, got {text}")
    return value


def probability(text):
    """An argparse type: a number from 0 to less than 1 (dropout's)."""
    value = float(text)
    if not 0 <= value < 1:  # NaN too
        raise argparse.ArgumentTypeError(f"must be from 0 to less than 1, got {text}")
    return value


def port(text):
    """An argparse type: a port number, kept as text, as os.environ['MASTER_PORT'] takes it."""
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number from 1 to 65535, got {text}")
    return str(value)


positive_float.__name__ = "number (> 0)"
probability.__name__ = "number (0 to < 1)"
port.__name__ = "port"


def add_arguments(parser):
    """The flags this project adds beside the tutorial's world size: one rank a command and
    where the ranks meet, the data, the run's length and the model's sizes (the tutorial's by
    default, where they learn), the seed, the summary's file and --profile. Each with its
    hyphenated spelling too. And on main.py's parser: every default in --help, no abbreviated
    flags (a typo must not pass for another flag), errors in one line (no usage lines)."""
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    parser.allow_abbrev = False
    parser.error = lambda message: parser.exit(2, f"{parser.prog}: error: {message}\n")
    parser.add_argument("--rank", type=at_least(0), default=None, metavar="R",
                        help="this process's rank: 0 for ps, 1.. for the trainers; without it, "
                             "every rank starts here (or torchrun's RANK)")
    parser.add_argument("--master_addr", "--master-addr", default="localhost", metavar="ADDR",
                        help="address of ps (rank 0), where every rank meets; other than "
                             "localhost, on a trusted network only")
    parser.add_argument("--master_port", "--master-port", type=port, default="29500",
                        metavar="PORT", help="port that rank 0 listens on, where every rank meets")
    parser.add_argument("--corpus", default=None, metavar="PATH",
                        help="a plain-text file (UTF-8; vocabulary from the file, <eos> at line "
                             "ends); sizes that work: --emsize 64 --nhid 64 --bptt 35 "
                             "--batch_size 20 --epochs 5")
    parser.add_argument("--epochs", type=at_least(1), default=10, metavar="N",
                        help="passes over the data")
    parser.add_argument("--max_batches", "--max-batches", type=at_least(1), default=None,
                        metavar="N", help="end each epoch after this many batches (short runs)")
    parser.add_argument("--bptt", type=at_least(1), default=5, metavar="N",
                        help="time steps per batch (the tutorial's `batch`)")
    parser.add_argument("--batch_size", "--batch-size", type=at_least(1), default=3,
                        metavar="N", help="sequences per batch (the tutorial's `nindices`)")
    parser.add_argument("--emsize", type=at_least(1), default=2, metavar="N",
                        help="size of the embeddings (the tutorial's `ninp`)")
    parser.add_argument("--nhid", type=at_least(1), default=3, metavar="N",
                        help="hidden units per LSTM layer")
    parser.add_argument("--nlayers", type=at_least(1), default=1, metavar="N",
                        help="LSTM layers (the tutorial's 4 do not learn)")
    parser.add_argument("--dropout", type=probability, default=0.0, metavar="P",
                        help="dropout of the embeddings, between LSTM layers and before the "
                             "decoder")
    parser.add_argument("--lr", type=positive_float, default=1.0, metavar="RATE",
                        help="SGD learning rate")
    parser.add_argument("--seed", type=at_least(0), default=1, metavar="N",
                        help="random seed of every rank and of the synthetic data")
    parser.add_argument("--summary_json", "--summary-json", default=None, metavar="PATH",
                        help="write the run's figures to this JSON file at the end")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="write each rank's torch.profiler trace to DIR/<its name>.json: "
                             "a trainer's steps 3 to 5, ps's whole run")


def check_args(parser, args):
    """What argparse cannot check, before any rank starts or any port opens: bad input ends the
    command here in one line, status 2. Under torchrun (RANK and WORLD_SIZE set, no --rank),
    the rank, world size and meeting point are torchrun's. args.started: the command's start,
    for the summary's wall seconds (args travels to the ranks)."""
    args.started = time.time()
    args.torchrun = args.rank is None and "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if args.torchrun:
        try:
            args.rank = int(os.environ["RANK"])
            args.world_size = int(os.environ["WORLD_SIZE"])
            args.master_port = port(os.environ.get("MASTER_PORT", args.master_port))
        except (ValueError, argparse.ArgumentTypeError):
            parser.error("torchrun's RANK, WORLD_SIZE and MASTER_PORT must be numbers, got "
                         f"{os.environ['RANK']}, {os.environ['WORLD_SIZE']} and "
                         f"{os.environ.get('MASTER_PORT')}")
        args.master_addr = os.environ.get("MASTER_ADDR", args.master_addr)
        if args.world_size < 2:
            parser.error(f"torchrun started {args.world_size} process(es): ps and at least one "
                         "trainer make 2 (--nproc_per_node=2 or more)")
    if args.world_size < 2:
        parser.error(f"argument --world_size: must be at least 2 (ps and a trainer), got "
                     f"{args.world_size}")
    if args.rank is not None and args.rank >= args.world_size:
        parser.error(f"--rank {args.rank} is outside a world of {args.world_size} "
                     f"(ranks 0 to {args.world_size - 1})")
    if args.corpus is not None and args.rank != 0:  # only the trainers read it
        problem = check_corpus(args.corpus, args.batch_size)
        if problem:
            parser.error(problem)
    if args.summary_json and args.rank in (None, 0):  # ps writes it
        check_file(parser, "--summary_json", args.summary_json)
    if args.profile:
        check_folder(parser, "--profile", args.profile)
    check_address(parser, args)


def check_file(parser, flag, path):
    """A file that the run writes at its end: its folder must be there and take a file (one is
    made and removed), and the file, where it is there already, must be writable."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        parser.error(f"{flag} {path}: that is a folder, not a file")
    if not os.path.isdir(folder):
        parser.error(f"{flag} {path}: no such folder ({folder})")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        parser.error(f"{flag} {path}: cannot write that file")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".check-"):
            pass
    except OSError as error:
        parser.error(f"{flag} {path}: cannot write in {folder} ({error.strerror or error})")


def check_folder(parser, flag, folder):
    """A folder that the ranks write in, made if missing."""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as error:
        parser.error(f"{flag} {folder}: cannot make that folder ({error.strerror or error})")
    if not os.access(folder, os.W_OK | os.X_OK):
        parser.error(f"{flag} {folder}: cannot write in that folder")


def check_address(parser, args):
    """--master_addr must resolve; where this command hosts rank 0 (rank 0, or every rank, not
    under torchrun, whose agent holds the port), --master_port must take a listener."""
    address, number = args.master_addr, int(args.master_port)
    try:
        family = socket.getaddrinfo(address, number, type=socket.SOCK_STREAM)[0][0]
    except (OSError, UnicodeError) as error:  # UnicodeError: not a host name at all
        parser.error(f"--master_addr {address}: no such host "
                     f"({getattr(error, 'strerror', None) or error})")
    if args.torchrun or args.rank not in (None, 0):
        return
    try:
        socket.create_server((address, number), family=family).close()
    except OSError as error:
        parser.error(f"cannot listen on {address}:{number} ({error.strerror or error}): "
                     "choose another --master_port")


def worker_name(rank, world_size):
    """Each rank's name in RPC: the tutorial's "ps" and "trainer"; with several trainers,
    trainer1, trainer2..."""
    if rank == 0:
        return "ps"
    if world_size == 2:
        return "trainer"
    return f"trainer{rank}"


# --------- Each epoch's loss --------------------

def peak_memory_mb():
    """This process's most resident memory so far (Linux: kB), and its GPU's where it used one,
    in MB."""
    peak = {"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}
    if torch.cuda.is_initialized():
        peak["cuda"] = torch.cuda.max_memory_allocated() // 2**20
    return peak


class Progress:
    """A trainer's loss, epoch by epoch (its mean per target token, printed after the
    tutorial's "Training epoch N"), and its figures for the summary. It starts by saying where
    the parts of `model`, the trainer's RNNModel, are."""

    def __init__(self, ntoken, model):
        print(f"Embedding table on ps ({model.table_device}), LSTM local, decoder on ps")
        self.name = rpc.get_worker_info().name
        self.ntoken = ntoken
        self.losses = []
        self.iterations = 0
        self.loss_sum = 0.0
        self.targets = 0
        self.started = time.perf_counter()

    def add(self, loss, target):
        """One iteration's loss, over its target tokens."""
        self.loss_sum += loss.item() * target.numel()
        self.targets += target.numel()
        self.iterations += 1

    def end_epoch(self, epoch):
        """The epoch's mean loss, and its perplexity."""
        self.losses.append(self.loss_sum / self.targets)
        self.loss_sum = 0.0
        self.targets = 0
        loss = self.losses[-1]
        print(f"{self.name}: epoch {epoch} loss {loss:.4f} perplexity {math.exp(loss):.2f}")

    def figures(self):
        """This trainer's figures for the run's summary, which ps writes at the end."""
        return {"name": self.name, "losses": self.losses, "iterations": self.iterations,
                "ntoken": self.ntoken, "peak_memory_mb": peak_memory_mb(),
                "train_seconds": round(time.perf_counter() - self.started, 3)}


# --------- --profile DIR --------------------

class NotProfiling:
    """What profile() returns without --profile: nothing to do."""

    def step(self):
        pass

    def stop(self):
        pass


def profile(args, rank, world_size):
    """This rank's torch.profiler, started: a trainer calls step() once a step and records its
    steps 3 to 5; ps, which only serves, records until stop(). The trace goes to
    DIR/<the rank's RPC name>.json, written whole."""
    if not args.profile:
        return NotProfiling()
    name = worker_name(rank, world_size)

    def write(prof):
        path = os.path.join(args.profile, f"{name}.json")
        part = os.path.join(args.profile, f".{name}.json")
        prof.export_chrome_trace(part)
        os.replace(part, path)
        prof.written = True
        print(f"{name}: profiled, wrote {path} ({os.path.getsize(path) // 1024} kB)", flush=True)

    try:  # every thread, the RPC threads that run ps's work included
        options = {"experimental_config":
                   torch._C._profiler._ExperimentalConfig(profile_all_threads=True)}
    except TypeError:  # torch 2.4 records only the thread that starts the profiler
        options = {}
    if rank != 0:
        options["schedule"] = torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1)
    prof = torch.profiler.profile(on_trace_ready=write, **options)
    prof.preset_metadata_json("rank", json.dumps(rank))  # rpcrun orders the tracks by rank
    prof.rank_name, prof.written = name, False
    prof.start()
    return prof


# --------- The summary --------------------

FIGURES = {}  # in ps's process: each trainer's figures, by its name (report)


def report(figures):
    """Runs on ps, called by each trainer (rpc.rpc_sync) before its rpc.shutdown()."""
    FIGURES[figures["name"]] = figures


def finish(args, prof):
    """After rpc.shutdown(): this rank's --profile trace, and on ps, the summary as its last
    line and --summary_json. A file that cannot be written then: one line, status 1."""
    prof.stop()
    if args.profile and not prof.written:  # a trainer that ran fewer than 2 steps
        print(f"{prof.rank_name}: --profile wrote no trace, as the run ended before its step 3",
              flush=True)
    if not FIGURES:
        return
    reports = dict(sorted(FIGURES.items()))
    losses = {name: report["losses"] for name, report in reports.items()}
    first = sum(trainer_losses[0] for trainer_losses in losses.values()) / len(losses)
    last = sum(trainer_losses[-1] for trainer_losses in losses.values()) / len(losses)
    memory = {"ps": peak_memory_mb()}
    memory.update((name, report["peak_memory_mb"]) for name, report in reports.items())
    summary = {"example": "rnn_model_parallel", "data": args.corpus or "synthetic",
               "ntoken": next(iter(reports.values()))["ntoken"], "trainers": len(losses),
               "losses": losses, "first_loss": first, "last_loss": last,
               "last_perplexity": math.exp(last),
               "iterations": sum(report["iterations"] for report in reports.values()),
               "train_seconds": max(report["train_seconds"] for report in reports.values()),
               "seed": args.seed, "peak_memory_mb": memory,
               "wall_seconds": round(time.time() - args.started, 3)}
    print(f"Summary: loss {first:.4f} -> {last:.4f}, perplexity {math.exp(first):.2f} -> "
          f"{math.exp(last):.2f} over {len(losses)} trainer(s); {summary['wall_seconds']:.1f} s "
          "in all", flush=True)
    if args.summary_json:
        try:
            with open(args.summary_json, "w") as file:
                file.write(json.dumps(summary, indent=2) + "\n")
        except OSError as error:
            print(f"--summary_json {args.summary_json}: not written "
                  f"({error.strerror or error}); the Summary line has the run's figures",
                  file=sys.stderr, flush=True)
            sys.exit(1)


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
