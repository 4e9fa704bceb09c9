"""What ddp_rpc_hybrid's two programs add beside the tutorial: the command line (the tutorial
has none), the ranks' names, each trainer's device and backend, the batches, each epoch's loss
and the run's summary. main.py (the 2020 revision) and remote_module.py (the 2021 revision)
import it, so that each shows its tutorial's code."""

import datetime
import hashlib
import time

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

import rpc_harness  # this project's package: `make run` installs it (or `pip install -e .`)

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
    """num_batches batches of the tutorial's random bags (20 to 50 indices in bags of 1 to 10),
    drawn from rng, each bag's indices of its target's class (bag_indices): the batches of
    main.py's get_next_batch, for remote_module.py and bench/baselines.py. Each batch:
    (indices, offsets, target), the target on `device`, where it meets the output."""
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
    """NCCL with trainer R on cuda:R (the tutorial's device) when every trainer has a GPU of its
    own, else Gloo on the CPU. gpu_count is a parameter, so that tests can fake it."""
    if gpu_count >= num_trainers:
        return "nccl", torch.device(f"cuda:{trainer_rank}")
    return "gloo", torch.device("cpu")


def trainer_backend(trainer_rank, num_trainers):
    """This trainer's backend (choose_backend_and_device), for its process group; its GPU, if
    any, becomes the current CUDA device of the calling thread (see trainer_device)."""
    backend, device = choose_backend_and_device(trainer_rank, num_trainers,
                                                torch.cuda.device_count())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return backend


def gpu_ids(device):
    """DDP's device_ids for a module on `device`: the device itself on a GPU (the tutorial's
    device_ids=[device]); on the CPU, None, as DDP requires."""
    return [device] if device.type == "cuda" else None


def trainer_device(trainer_rank):
    """This trainer's device (choose_backend_and_device; the trainers' process group says how
    many there are), made the current CUDA device of the calling thread: NCCL and DDP work on
    the current device, which is per thread (cuda:0 unless set), and the trainer's loop runs
    on an RPC thread."""
    _, device = choose_backend_and_device(trainer_rank, dist.get_world_size(),
                                          torch.cuda.device_count())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def process_group_timeout(args):
    """The bound of each collective of the trainers' process group (DDP's allreduce):
    --rpc_timeout, as every RPC's (torch's default is 30 minutes)."""
    return datetime.timedelta(seconds=args.rpc_timeout)


# --------- The run's figures --------------------

class Progress:
    """A trainer's loss, epoch by epoch (its mean over the epoch's batches, printed after the
    tutorial's "Training done for epoch N"), and its figures for the summary, which include a
    digest of the weights of `dense`, the trainer's DDP module."""

    def __init__(self, dense):
        self.dense = dense
        self.name = rpc.get_worker_info().name
        self.epoch_losses = []
        self.losses = []
        self.started = time.perf_counter()

    def add(self, loss):
        """One iteration's loss."""
        self.losses.append(loss.item())

    def end_epoch(self, epoch):
        """The epoch's mean loss, printed as "trainerR: epoch N loss L"; then the figures so far
        for the run's summary (report: the last epoch's stand)."""
        self.epoch_losses.append(sum(self.losses) / len(self.losses))
        self.losses = []
        print(f"{self.name}: epoch {epoch} loss {self.epoch_losses[-1]:.4f}")
        self.report()

    def report(self):
        """The figures for the run's summary, which rank 0 writes at the end: the losses, the
        time, the backend, and the dense weights' digest, which DDP keeps the same on every
        trainer."""
        weights = b"".join(param.detach().cpu().numpy().tobytes()
                           for param in self.dense.parameters())
        rpc_harness.report(losses=self.epoch_losses,
                           train_seconds=round(time.perf_counter() - self.started, 3),
                           backend=dist.get_backend(),
                           dense_weights=hashlib.sha256(weights).hexdigest())


def _table_weights(table_rref):
    """On ps: a copy of the table's weights."""
    return table_rref.local_value().weight.detach().clone()


def table_weights(table_rref):
    """The master's copy of the table's weights, from ps (table_rref: the nn.EmbeddingBag)."""
    return rpc.rpc_sync(table_rref.owner(), _table_weights, args=(table_rref,))


def report_table(before, table_rref):
    """The master's figure for the summary: how far the table on ps moved since `before`."""
    rpc_harness.report(table_change=(table_weights(table_rref) - before).abs().max().item())


def write_summary(args, reports):
    """The run's figures, and proof that both halves trained: the same dense weights on every
    trainer (DDP), and a table on ps that moved (distributed autograd and the optimizer)."""
    change = reports.pop("master")["table_change"]
    trainers = {name: report for name, report in reports.items() if name != "ps"}
    first = next(iter(trainers.values()))
    identical = len({report["dense_weights"] for report in trainers.values()}) == 1
    print(f"Dense layer weights identical on {', '.join(trainers)}: {'yes' if identical else 'NO'}")
    print(f"Embedding table on ps changed: {'yes' if change > 0 else 'NO'} "
          f"(largest change {change:.4f})")
    figures = {"example": "ddp_rpc_hybrid", "world_size": args.world_size,
               "trainers": len(trainers), "remote_module": args.remote_module,
               "backend": first["backend"],
               "iterations_per_trainer": dict.fromkeys(trainers,
                                                       args.epochs * args.batches_per_epoch),
               "first_loss": {name: round(r["losses"][0], 4) for name, r in trainers.items()},
               "last_loss": {name: round(r["losses"][-1], 4) for name, r in trainers.items()},
               "dense_weights_identical": identical, "embedding_table_changed": change > 0,
               "embedding_table_max_change": round(change, 4),
               "train_seconds": max(r["train_seconds"] for r in trainers.values())}
    line = "loss " + ", ".join(f"{name} {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}"
                               for name, r in trainers.items())
    return figures, line


# --------- The ranks --------------------

def worker_name(rank, world_size):
    """Each rank's name in RPC, which the harness's lines use too: trainer0..trainer{N-1},
    master, ps, for N trainers (the tutorial: trainer0, trainer1, master, ps)."""
    num_trainers = world_size - 2
    if rank < num_trainers:
        return f"trainer{rank}"
    return "master" if rank == num_trainers else "ps"


def computes_little(rank, world_size):
    """No rank computes much: a model this small gains nothing from intra-op threads, so each
    rank gets one."""
    return False


def trains(rank, world_size):
    """The ranks that loop over batches, whose steps --profile records: the trainers."""
    return rank < world_size - 2


# --------- The command line --------------------

def parse_args(argv=None, remote_module=False):
    """The command line (the tutorial has none: its world size, address and port as flags),
    with this example's and this project's flags, checked: bad input ends the command here in
    one line, status 2. remote_module: remote_module.py's (the 2021 revision)."""
    revision = ("the tutorial's 2021 revision, with a RemoteModule" if remote_module
                else "the tutorial's 2020 revision")
    # rpc_harness.ArgumentParser: argparse's, with every default in --help, each flag with
    # hyphens too, and errors in one line (status 2); int_at_least(N) and port_number: argument
    # types that refuse what a plain int would let through.
    parser = rpc_harness.ArgumentParser(
        description="DistributedDataParallel with distributed RPC: an nn.EmbeddingBag on the "
                    "parameter server ps, an nn.Linear under DDP on the trainers, driven by the "
                    f"master ({revision}).")
    parser.add_argument(
        "--world_size",
        type=rpc_harness.int_at_least(3),
        default=4,
        help="total number of processes: N-2 trainers (ranks 0 to N-3), the master (rank N-2) "
             "and the parameter server ps (rank N-1)")
    parser.add_argument(
        "--rank",
        type=rpc_harness.int_at_least(0),
        default=None,
        help="rank of this process. Without it, every rank starts here (or torchrun's RANK)")
    parser.add_argument(
        "--master_addr",
        default="localhost",
        help="address of rank 0 (trainer0), where every rank meets; other than localhost, on "
             "a trusted network only")
    parser.add_argument(
        "--master_port",
        type=rpc_harness.port_number,
        default=29500,
        help="port of rank 0 (trainer0), where every rank meets")
    # Not in the tutorial: the length of training (the tutorial's by default); then the flags
    # that every example of this project has (timeouts, --seed, --summary_json, --profile).
    # auto (shared memory): each iteration is a few tiny messages, latency-bound.
    parser.add_argument(
        "--epochs",
        type=rpc_harness.int_at_least(1),
        default=100,
        metavar="N",
        help="epochs a trainer")
    parser.add_argument(
        "--batches_per_epoch",
        type=rpc_harness.int_at_least(1),
        default=10,
        metavar="N",
        help="batches in each epoch")
    rpc_harness.add_arguments(parser, rpc_transport="auto")
    args = parser.parse_args(argv)
    # rpc_harness.check_args: the world (at least a trainer, the master and ps), the rank, the
    # address and port, --profile's folder; torchrun's RANK, WORLD_SIZE, MASTER_ADDR and
    # MASTER_PORT stand for the flags; and args.harness records what rpc_harness needs in
    # every rank (docs/harness.md).
    rpc_harness.check_args(parser, args, worker_name, computes=computes_little, loops=trains,
                           summary=write_summary, min_world_size=3)
    args.remote_module = remote_module  # for the summary: which revision ran
    return args
