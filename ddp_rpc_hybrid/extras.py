"""What ddp_rpc_hybrid's two programs add beside the tutorial, in plain code: the flags (the
tutorial has none) and their checks, torchrun's environment, each trainer's backend and device,
the bags' indices, each epoch's loss, --profile's few lines of torch.profiler and the run's
summary. main.py (the 2020 revision) and remote_module.py (the 2021 revision) import it, so
that each shows its tutorial's code. Delete it, and the calls marked "# ours", to get the
tutorial back."""

import argparse
import datetime
import hashlib
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
import torch.distributed.rpc as rpc

# Two deprecation warnings that torch prints from inside its own RPC stack, in every run, about
# its own internals; nothing here can act on them. The RPC agent uses its Gloo process group
# "as a ProcessGroup": a filter drops that one.
warnings.filterwarnings("ignore", message=r".*as a ProcessGroup\. This usage is deprecated")
# DistributedOptimizer's TorchScript optimizers: torch warns under simplefilter("always"), which
# overrides every filter, so the message is left out where warnings are shown instead. Every
# other warning is shown as before.
_show_warning = warnings.showwarning


def _show_warning_unless_torchscript_optimizer(message, *args, **kwargs):
    if not str(message).startswith("`TorchScript` support for functional optimizers"):
        _show_warning(message, *args, **kwargs)


warnings.showwarning = _show_warning_unless_torchscript_optimizer
# --profile: torch 2.11 warns, for a profiler with a schedule, that each cycle drops the events
# of the one before; the schedule here has one cycle (repeat=1).
warnings.filterwarnings("ignore", message=r".*Profiler clears events at the end of each cycle")

# Every line of every rank written whole, in one write, as soon as it is printed: the ranks
# share one terminal or file, and where Python writes a line's text and its newline apart
# (PYTHONUNBUFFERED=1), another rank's line can fall between them ("Training done for epoch
# 7Training done for epoch 7"). A terminal shows lines so already; a file or pipe now does too.
if hasattr(sys.stdout, "reconfigure"):
    sys.stdout.reconfigure(line_buffering=True, write_through=False)

NUM_CLASSES = 8  # the outputs of the dense layer, nn.Linear(16, 8) in the tutorial
TABLE_ROWS = 100  # the rows of the table, main.py's NUM_EMBEDDINGS, which the indices name


# --------- The batches --------------------

def bag_indices(rng, target, offsets, num_indices, num_embeddings=TABLE_ROWS):
    """The num_indices indices of the bags that start at `offsets`, drawn from rng (a
    random.Random, or the random module itself): every index has a class (index % NUM_CLASSES),
    and a bag's indices all come from the class of its target (a tensor). The tutorial's
    indices and targets are random, with nothing to learn. The indices go to ps over RPC, so
    they stay on the CPU."""
    ends = offsets[1:] + [num_indices]
    return torch.tensor([rng.randrange(bag_class, num_embeddings, NUM_CLASSES)
                         for bag_class, begin, end in zip(target.tolist(), offsets, ends,
                                                          strict=True)
                         for _ in range(end - begin)])


def get_next_batch(rng, num_batches, device, num_embeddings=TABLE_ROWS):
    """num_batches batches as main.py's get_next_batch draws them (the tutorial's bags: 20 to
    50 indices in bags of 1 to 10; each bag's indices of its target's class), from rng, for
    bench/baselines.py and the tests. Each batch: (indices, offsets, target), the target on
    `device`."""
    for _ in range(num_batches):
        num_indices = rng.randint(20, 50)

        offsets = []
        start = 0
        while start < num_indices:
            offsets.append(start)
            start += rng.randint(1, 10)

        target = torch.tensor([rng.randrange(NUM_CLASSES) for _ in offsets])
        indices = bag_indices(rng, target, offsets, num_indices, num_embeddings)
        yield indices, torch.tensor(offsets), target.to(device)


# --------- Devices --------------------

def choose_backend_and_device(trainer_rank, num_trainers, gpu_count):
    """(backend, device, why) for a trainer: NCCL with trainer R on cuda:R (the tutorial's
    device) when every trainer has a GPU of its own, else Gloo on the CPU. NCCL cannot put two
    trainers on one GPU, and the tutorial's `.cuda(rank)` fails where cuda:R is missing.
    gpu_count is a parameter, so that tests can fake it."""
    if gpu_count >= num_trainers:
        return ("nccl", torch.device(f"cuda:{trainer_rank}"),
                f"each of the {num_trainers} trainers has a GPU of its own")
    if gpu_count == 0:
        return "gloo", torch.device("cpu"), "this machine has no GPU"
    return ("gloo", torch.device("cpu"),
            f"{gpu_count} GPU{'s' if gpu_count > 1 else ''} cannot give each of the "
            f"{num_trainers} trainers its own (NCCL needs one a trainer)")


BACKEND_NAMES = {"nccl": "NCCL", "gloo": "Gloo"}


def trainer_backend(trainer_rank, num_trainers):
    """This trainer's backend, for its process group, after its first line: which backend and
    device it uses, and why. Its GPU, if any, becomes the current CUDA device of this thread."""
    backend, device, why = choose_backend_and_device(trainer_rank, num_trainers,
                                                     torch.cuda.device_count())
    on = "the CPU" if device.type == "cpu" else str(device)
    print(f"trainer{trainer_rank}: {BACKEND_NAMES[backend]} on {on}, as {why}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return backend


def trainer_device(trainer_rank):
    """This trainer's device (choose_backend_and_device; the trainers' process group says how
    many there are), made the current CUDA device of the calling thread: NCCL and DDP work on
    the current device, which is per thread (cuda:0 unless set), and the trainer's loop runs
    on an RPC thread."""
    _, device, _ = choose_backend_and_device(trainer_rank, dist.get_world_size(),
                                             torch.cuda.device_count())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def gpu_ids(device):
    """DDP's device_ids for a module on `device`: the device itself on a GPU (the tutorial's
    device_ids=[device]); on the CPU, None, as DDP requires."""
    return [device] if device.type == "cuda" else None


# --------- --profile --------------------

def profiler(args, name, rank, steps=False):
    """--profile DIR: a started torch.profiler whose trace goes to DIR/<name>.json; None
    without --profile. steps: a rank that loops records its steps 3 to 5 (prof.step() once a
    step); otherwise it records until prof.stop(). Every thread where torch allows it (2.4
    records only the thread that starts the profiler, not RPC's)."""
    if not args.profile:
        return None
    options = {}
    try:
        options["experimental_config"] = torch._C._profiler._ExperimentalConfig(
            profile_all_threads=True)
    except TypeError:
        pass
    if steps:
        options["schedule"] = torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1)
    prof = torch.profiler.profile(on_trace_ready=lambda done: _write_trace(done, args.profile,
                                                                          name), **options)
    prof.preset_metadata_json("rank", json.dumps(rank))  # a merge orders the tracks by rank
    prof.start()
    return prof


def serving_profiler(args, rank, world_size):
    """--profile for a rank that serves (the master, ps), from here to stop_profiler(); None
    for a trainer, which records its steps (Progress), or without --profile."""
    if rank < world_size - 2:
        return None
    return profiler(args, worker_name(rank, world_size), rank)


def _write_trace(prof, folder, name):
    """The trace, written whole (under another name, then renamed), and a line that says so."""
    path = os.path.join(folder, f"{name}.json")
    part = os.path.join(folder, f".{name}.json")
    prof.export_chrome_trace(part)
    os.replace(part, path)
    print(f"{name}: profiled, wrote {path} ({os.path.getsize(path) // 1024} kB)")


def stop_profiler(prof):
    """The end of a rank's --profile, whose trace is then written (None: nothing to do)."""
    if prof is not None:
        prof.stop()


def finish(args, rank, prof):
    """A rank's last lines, after its rpc.shutdown(): the trace of a serving rank's --profile
    (serving_profiler), and on the master the run's summary."""
    stop_profiler(prof)
    if rank == args.world_size - 2:
        write_summary(args)


# --------- The run's figures --------------------

FIGURES = {}  # in the master's process: each rank's figures, by name, for the summary


def record(name, figures):
    """Called on the master over RPC (rpc.rpc_sync("master", extras.record, ...)), and by the
    master itself: keep a rank's latest figures for the summary."""
    FIGURES[name] = figures


def peak_rss_mb():
    """This process's most resident memory so far, in MB (Linux counts ru_maxrss in kB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


class Progress:
    """A trainer's loss, epoch by epoch (its mean over the epoch's batches, printed after the
    tutorial's "Training done for epoch N"), its figures for the summary, sent to the master
    after each epoch, and --profile's steps (`dense`: the trainer's DDP module, whose weights
    DDP keeps the same on every trainer)."""

    def __init__(self, dense, args):
        self.dense = dense
        self.epochs = args.epochs
        self.name = rpc.get_worker_info().name
        self.prof = profiler(args, self.name, rpc.get_worker_info().id, steps=True)
        self.epoch_losses = []
        self.losses = []
        self.started = time.perf_counter()

    def add(self, loss):
        """One iteration's loss, and --profile's step."""
        self.losses.append(loss.item())
        if self.prof is not None:
            self.prof.step()

    def end_epoch(self, epoch):
        """The epoch's mean loss, printed as "trainerR: epoch N loss L"; the figures so far to
        the master; after the last epoch, --profile's trace, if the run was too short to end
        the profiler's window."""
        self.epoch_losses.append(sum(self.losses) / len(self.losses))
        self.losses = []
        print(f"{self.name}: epoch {epoch} loss {self.epoch_losses[-1]:.4f}")
        weights = repr([param.tolist() for param in self.dense.parameters()]).encode()
        rpc.rpc_sync("master", record, args=(self.name, {
            "losses": self.epoch_losses, "backend": dist.get_backend(),
            "train_seconds": round(time.perf_counter() - self.started, 3),
            "dense_weights": hashlib.sha256(weights).hexdigest(), "rss": peak_rss_mb()}))
        if epoch == self.epochs - 1:
            stop_profiler(self.prof)


def _table_weights(table_rref):
    """On ps: a copy of the table's weights, and ps's peak memory."""
    return table_rref.local_value().weight.detach().clone(), peak_rss_mb()


def table_weights(table_rref):
    """The master's copy of the table's weights, from ps (table_rref: the nn.EmbeddingBag)."""
    return rpc.rpc_sync(table_rref.owner(), _table_weights, args=(table_rref,))[0]


def report_table(before, table_rref):
    """The master's figures for the summary: how far the table on ps moved since `before`."""
    after, ps_rss = rpc.rpc_sync(table_rref.owner(), _table_weights, args=(table_rref,))
    record("ps", {"rss": ps_rss})
    record("master", {"table_change": (after - before).abs().max().item(),
                      "rss": peak_rss_mb()})


def write_summary(args):
    """On the master, after its rpc.shutdown(): proof that both halves trained (the same dense
    weights on every trainer, and a table on ps that moved), the Summary line, and
    --summary_json. A file that cannot be written says so after the Summary line: status 1."""
    change = FIGURES["master"]["table_change"]
    trainers = {f"trainer{rank}": FIGURES[f"trainer{rank}"]
                for rank in range(args.world_size - 2)}
    identical = len({report["dense_weights"] for report in trainers.values()}) == 1
    print(f"Dense layer weights identical on {', '.join(trainers)}: {'yes' if identical else 'NO'}")
    print(f"Embedding table on ps changed: {'yes' if change > 0 else 'NO'} "
          f"(largest change {change:.4f})")
    figures = {"example": "ddp_rpc_hybrid", "world_size": args.world_size,
               "trainers": len(trainers), "remote_module": args.remote_module,
               "backend": trainers["trainer0"]["backend"],
               "iterations_per_trainer": dict.fromkeys(trainers,
                                                       args.epochs * args.batches_per_epoch),
               "first_loss": {name: round(r["losses"][0], 4) for name, r in trainers.items()},
               "last_loss": {name: round(r["losses"][-1], 4) for name, r in trainers.items()},
               "dense_weights_identical": identical, "embedding_table_changed": change > 0,
               "embedding_table_max_change": round(change, 4),
               "train_seconds": max(r["train_seconds"] for r in trainers.values()),
               "peak_memory_mb": {name: {"rss": r["rss"]} for name, r in FIGURES.items()},
               "wall_seconds": round(time.time() - args.started, 3)}
    losses = ", ".join(f"{name} {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}"
                       for name, r in trainers.items())
    print(f"Summary: loss {losses}; {figures['wall_seconds']:.1f} s in all")
    if args.summary_json:
        try:
            with open(args.summary_json, "w") as file:
                file.write(json.dumps(figures, indent=2) + "\n")
        except OSError as error:
            print(f"--summary_json {args.summary_json}: not written ({error.strerror or error}); "
                  "the Summary line has the run's figures")
            raise SystemExit(1) from None


# --------- The ranks --------------------

def worker_name(rank, world_size):
    """Each rank's name in RPC: trainer0..trainer{N-1}, master, ps, for N trainers (the
    tutorial: trainer0, trainer1, master, ps)."""
    num_trainers = world_size - 2
    if rank < num_trainers:
        return f"trainer{rank}"
    return "master" if rank == num_trainers else "ps"


# --------- The command line --------------------

def at_least(low):
    """An argparse type: an integer of at least `low`."""
    def parse(text):
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    parse.__name__ = f"integer (>= {low})"  # argparse names the type in its error message
    return parse


def port(text):
    """An argparse type: a port number."""
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number from 1 to 65535, got {value}")
    return value


def parser():
    """argparse's parser for main.py's command line: every default in --help, no abbreviated
    flags (a typo must not pass for another flag), and errors in one line (argparse's usage
    lines left out: --help shows them)."""
    made = argparse.ArgumentParser(allow_abbrev=False,
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    made.error = lambda message: made.exit(2, f"{made.prog}: error: {message}\n")
    return made


def parse_args(parser, argv=None, remote_module=False):
    """The command line: main.py's parser (the tutorial's world size as --world_size) with the
    flags that the tutorial lacks, parsed and checked (check_args). Bad input ends the command
    here in one line, status 2. remote_module: remote_module.py's (the 2021 revision)."""
    revision = "2021 revision, with a RemoteModule" if remote_module else "2020 revision"
    parser.description = ("DistributedDataParallel with distributed RPC: an nn.EmbeddingBag on "
                          "the parameter server ps, an nn.Linear under DDP on the trainers, "
                          f"driven by the master (the tutorial's {revision}).")
    parser.add_argument("--rank", type=at_least(0), default=None,
                        help="run only this rank (0 to N-3: the trainers; N-2: the master; N-1: "
                             "ps), the others in other terminals. Without it, every rank starts "
                             "here (or torchrun's RANK)")
    parser.add_argument("--master_addr", "--master-addr", default="localhost",
                        help="address of rank 0 (trainer0), where every rank meets; other than "
                             "localhost, on a trusted network only")
    parser.add_argument("--master_port", "--master-port", type=port, default=29500,
                        help="port of rank 0 (trainer0), where the trainers' process group "
                             "meets; RPC meets on the next one (the tutorial: 29500 and 29501)")
    parser.add_argument("--epochs", type=at_least(1), default=100, metavar="N",
                        help="epochs a trainer")
    parser.add_argument("--batches_per_epoch", "--batches-per-epoch", type=at_least(1),
                        default=10, metavar="N", help="batches in each epoch")
    parser.add_argument("--seed", type=at_least(0), default=1, metavar="N",
                        help="random seed: the first weights and each trainer's batches")
    parser.add_argument("--summary_json", "--summary-json", default=None, metavar="PATH",
                        help="the master writes the run's figures to this JSON file at the end")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="each rank writes its torch.profiler trace to DIR/<its name>.json "
                             "(the trainers: their steps 3 to 5); rpcrun merges them into "
                             "DIR/timeline.json")
    args = parser.parse_args(argv)
    args.remote_module = remote_module
    return check_args(parser, args)


def check_args(parser, args):
    """What argparse cannot check, before any rank starts or any port opens; and torchrun's
    environment, where --rank is not given and torchrun set RANK and WORLD_SIZE."""
    args.started = time.time()  # the summary's wall seconds count from here
    args.torchrun = args.rank is None and "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if args.torchrun:
        # torchrun's rank, world and address. Its agent's own store holds MASTER_PORT, so this
        # run meets on the next two ports (the process group, then RPC), not through that
        # store: torch 2.13 (and older) makes every rank a client of the agent's store on any
        # port while TORCHELASTIC_USE_AGENT_STORE is set, and RPC's port would have no server.
        args.rank = _environment_number(parser, "RANK")
        args.world_size = _environment_number(parser, "WORLD_SIZE")
        args.master_addr = os.environ.get("MASTER_ADDR", args.master_addr)
        args.master_port = _environment_number(parser, "MASTER_PORT") + 1
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    if args.world_size < 3:
        what = (f"torchrun started {args.world_size} processes: the world size" if args.torchrun
                else "argument --world_size:")
        parser.error(f"{what} must be at least 3 (a trainer, the master and ps), got "
                     f"{args.world_size}")
    if args.rank is not None and args.rank >= args.world_size:
        parser.error(f"--rank {args.rank} is outside a world of {args.world_size} (ranks 0 to "
                     f"{args.world_size - 1})")
    if args.master_port + 1 > 65535:
        parser.error(f"--master_port {args.master_port}: RPC meets on the next port, and "
                     f"{args.master_port + 1} is not a port; choose another --master_port")
    try:
        socket.getaddrinfo(args.master_addr, args.master_port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as error:  # UnicodeError: not a host name at all
        parser.error(f"--master_addr {args.master_addr}: no such host "
                     f"({getattr(error, 'strerror', None) or 'not a valid host name'})")
    if args.rank in (None, 0):  # this command hosts rank 0, which listens on both ports
        for number in (args.master_port, args.master_port + 1):
            try:
                socket.create_server((args.master_addr, number)).close()
            except OSError as error:
                parser.error(f"cannot listen on {args.master_addr}:{number} "
                             f"({os.strerror(error.errno)}): choose another --master_port")
    if args.profile:  # every rank writes its own trace there
        try:
            os.makedirs(args.profile, exist_ok=True)
            tempfile.TemporaryFile(dir=args.profile).close()
        except OSError as error:
            parser.error(f"--profile {args.profile}: cannot write there "
                         f"({error.strerror or error})")
    if args.summary_json and args.rank in (None, args.world_size - 2):  # the master writes it
        folder = os.path.dirname(os.path.abspath(args.summary_json))
        if os.path.isdir(args.summary_json):
            parser.error(f"--summary_json {args.summary_json}: that is a folder, not a file")
        if not os.path.isdir(folder):
            parser.error(f"--summary_json {args.summary_json}: no such folder ({folder})")
        try:
            tempfile.TemporaryFile(dir=folder).close()
        except OSError as error:
            parser.error(f"--summary_json {args.summary_json}: cannot write in {folder} "
                         f"({error.strerror or error})")
        if os.path.exists(args.summary_json) and not os.access(args.summary_json, os.W_OK):
            parser.error(f"--summary_json {args.summary_json}: cannot write that file")
    return args


def _environment_number(parser, name):
    """torchrun's RANK, WORLD_SIZE or MASTER_PORT: a whole number."""
    text = os.environ.get(name, "")
    if not text.strip().isdigit():
        parser.error(f"torchrun's {name} is {text!r}, not a whole number")
    return int(text)


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
