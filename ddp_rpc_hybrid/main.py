"""Combining Distributed DataParallel with Distributed RPC Framework: the tutorial's code,
runnable. With N trainers (world size N + 2): ranks 0..N-1 are the trainers, rank N the master,
rank N+1 the parameter server `ps`, which holds an nn.EmbeddingBag; each trainer looks up
embeddings there through RPC and runs an nn.Linear replicated under DDP. README.md says what
differs from the tutorial and why; remote_module.py runs the tutorial's 2021 revision.
rpc_harness, this project's package, bounds every wait and ends every rank in one line when one
fails; each of its names is explained where main.py first uses it.

    python main.py                                          # every rank on this machine
    python main.py --world_size=4 --rank=3                  # one rank per terminal
"""

import datetime
import hashlib
import os
import random
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
from torch import optim
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef
from torch.nn.parallel import DistributedDataParallel as DDP

try:
    import rpc_harness
except ModuleNotFoundError:
    raise SystemExit("rpc_harness, this project's package, is missing: install it with "
                     "`pip install -e PATH`, PATH being the repository's folder (the one that "
                     "holds pyproject.toml), or run `make run` there") from None

NUM_EMBEDDINGS = 100
EMBEDDING_DIM = 16
NUM_CLASSES = 8  # the outputs of the dense layer, nn.Linear(16, 8) in the tutorial


class HybridModel(torch.nn.Module):
    """A sparse part, the nn.EmbeddingBag on the parameter server (reached through emb_rref), and
    a dense part, an nn.Linear replicated on every trainer under DistributedDataParallel."""

    def __init__(self, emb_rref, device):
        super().__init__()
        self.emb_rref = emb_rref
        # device_ids names the GPU of this replica; a CPU module takes none.
        device_ids = [device] if device.type == "cuda" else None
        self.fc = DDP(torch.nn.Linear(16, 8).to(device), device_ids=device_ids)
        self.device = device

    def forward(self, indices, offsets):
        emb_lookup = self.emb_rref.rpc_sync().forward(indices, offsets)
        return self.fc(emb_lookup.to(self.device))


def _retrieve_embedding_parameters(emb_rref):
    param_rrefs = []
    for param in emb_rref.local_value().parameters():
        param_rrefs.append(RRef(param))
    return param_rrefs


def get_next_batch(rng, num_batches, device):
    """The tutorial's random bags (20 to 50 indices in bags of 1 to 10), drawn from rng, except
    that every index has a class (index % NUM_CLASSES) and a bag's indices all come from its
    target's class: random targets leave nothing to learn. Module-level, to be tested alone."""
    for _ in range(num_batches):
        num_indices = rng.randint(20, 50)

        # Generate offsets.
        offsets = []
        start = 0
        while start < num_indices:
            offsets.append(start)
            start += rng.randint(1, 10)
        ends = offsets[1:] + [num_indices]

        target = [rng.randrange(NUM_CLASSES) for _ in offsets]
        indices = [rng.randrange(bag_class, NUM_EMBEDDINGS, NUM_CLASSES)
                   for bag_class, begin, end in zip(target, offsets, ends, strict=True)
                   for _ in range(end - begin)]
        # The indices go to ps over RPC, so they stay on the CPU; the target meets the output.
        yield torch.tensor(indices), torch.tensor(offsets), torch.tensor(target, device=device)


def _run_trainer(emb_rref, rank, args):
    """A trainer's loop, started by the master: the lookup on ps, then nn.Linear here; DDP
    averages the dense gradients, distributed autograd takes the table's to ps."""
    torch.manual_seed(args.seed)  # DDP copies trainer0's initial dense weights to the others
    _, device = choose_backend_and_device(rank, dist.get_world_size(), torch.cuda.device_count())
    if device.type == "cuda":
        torch.cuda.set_device(device)  # this RPC thread's current device, for NCCL and DDP

    # the model: the table on ps, the dense layer here under DDP
    model = HybridModel(emb_rref, device)

    # RRefs to every parameter, for DistributedOptimizer: the table's, from ps,
    model_parameter_rrefs = rpc.rpc_sync(
        "ps", _retrieve_embedding_parameters, args=(emb_rref,))
    # and the local ones (model.parameters() has only these).
    for param in model.parameters():
        model_parameter_rrefs.append(RRef(param))

    # the distributed optimizer, over both
    opt = DistributedOptimizer(
        optim.SGD,
        model_parameter_rrefs,
        lr=0.05,
    )

    criterion = torch.nn.CrossEntropyLoss()
    rng = random.Random(args.seed * 1000 + rank)  # each trainer draws batches of its own

    epoch_losses, started = [], time.perf_counter()
    for epoch in range(args.epochs):
        losses = []
        for indices, offsets, target in get_next_batch(rng, args.batches_per_epoch, device):
            # Not in the tutorial: a step of --profile's window (nothing without --profile).
            rpc_harness.profile_step()
            # each iteration in a distributed autograd context of its own
            with dist_autograd.context() as context_id:
                output = model(indices, offsets)
                loss = criterion(output, target)
                # the backward pass, across ps and the trainers
                dist_autograd.backward(context_id, [loss])
                # the step, where each parameter lives
                opt.step(context_id)
                # No zero_grad: each iteration's context holds its own gradients.
            losses.append(loss.item())
        print("Training done for epoch {}".format(epoch))
        epoch_losses.append(sum(losses) / len(losses))
        print(f"trainer{rank}: epoch {epoch} loss {epoch_losses[-1]:.4f}")
    # not in the tutorial: the summary's figures
    report_trainer(epoch_losses, time.perf_counter() - started, model.fc.parameters())


@rpc_harness.watched  # not in the tutorial: one line when this rank ends early
def run_worker(rank, world_size, args):
    # Where the ranks meet: --master_addr and --master_port (the tutorial's localhost and 29500).
    os.environ['MASTER_ADDR'] = args.master_addr
    os.environ['MASTER_PORT'] = str(args.master_port)
    num_trainers = world_size - 2  # the tutorial's two trainers, master rank 2 and ps rank 3

    # rpc_harness.options(args): TensorPipe's options, meeting through rpc_harness, which joins the
    # ranks where MASTER_ADDR and MASTER_PORT say (as the default env:// would), with bounded waits
    # (the tutorial's init_method is tcp://localhost:29501). The join installs in this rank the
    # harness's loop (Ctrl-C, SIGTERM, the watch over the other ranks, which ends every rank in one
    # line when one is lost or fails), its share of the cores and whole lines (README.md: "What the
    # harness changes").
    rpc_backend_options = rpc_harness.options(args)

    if rank == num_trainers:
        rpc.init_rpc(
                "master",
                rank=rank,
                world_size=world_size,
                rpc_backend_options=rpc_backend_options)

        # the embedding table, built on ps
        emb_rref = rpc.remote(
                "ps",
                torch.nn.EmbeddingBag,
                args=(NUM_EMBEDDINGS, EMBEDDING_DIM),
                kwargs={"mode": "sum"})
        table_before = rpc.rpc_sync("ps", _get_embedding_weights, args=(emb_rref,))

        # Run the training loop on trainers, each with its own rank (the tutorial passes the
        # master's). timeout=0: training takes as long as it takes (the harness bounds the rest).
        futs = []
        for trainer_rank in range(num_trainers):
            trainer_name = "trainer{}".format(trainer_rank)
            fut = rpc.rpc_async(
                    trainer_name, _run_trainer, args=(emb_rref, trainer_rank, args), timeout=0)
            futs.append(fut)

        # Wait for all training to finish.
        for fut in futs:
            fut.wait()
        # not in the tutorial: how far the table moved, for the summary
        report_table(table_before, rpc.rpc_sync("ps", _get_embedding_weights, args=(emb_rref,)))
    elif rank < num_trainers:
        # the trainers' own process group, for DDP
        backend, device = choose_backend_and_device(rank, num_trainers, torch.cuda.device_count())
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # rpc_harness.init_method(args): the same meeting as options(args), over the same
        # store: one port for RPC and for the trainers' process group. Not in the tutorial:
        # timeout, the bound of each collective (DDP's allreduce), --rpc_timeout as every RPC's
        # (torch's default is 30 minutes).
        dist.init_process_group(
                backend=backend, rank=rank, world_size=num_trainers,
                init_method=rpc_harness.init_method(args),
                timeout=datetime.timedelta(seconds=args.rpc_timeout))

        # Initialize RPC.
        trainer_name = "trainer{}".format(rank)
        rpc.init_rpc(
                trainer_name,
                rank=rank,
                world_size=world_size,
                rpc_backend_options=rpc_backend_options)

        # Trainer just waits for RPCs from master.
    else:
        torch.manual_seed(args.seed)  # the table's initial weights
        rpc.init_rpc(
                "ps",
                rank=rank,
                world_size=world_size,
                rpc_backend_options=rpc_backend_options)
        # parameter server do nothing
        pass

    # block until all rpcs finish
    rpc.shutdown()
    if rank < num_trainers:
        # Not in the tutorial: the trainers' process group ends too, as torch asks of every
        # process group (rpc_harness counts a rank as done only once neither RPC nor a process
        # group is left). After rpc.shutdown(), not before: a trainer gets here at once, and
        # the _run_trainer that the master starts here uses the group (DDP) until then.
        dist.destroy_process_group()


# --------- Not in the tutorial: devices, names, the summary, the command line -------------

def choose_backend_and_device(trainer_rank, num_trainers, gpu_count):
    """NCCL with trainer R on cuda:R (the tutorial's) when every trainer has a GPU of its own,
    else Gloo on the CPU. Tests fake gpu_count."""
    if gpu_count >= num_trainers:
        return "nccl", torch.device(f"cuda:{trainer_rank}")
    return "gloo", torch.device("cpu")


def _get_embedding_weights(emb_rref):  # on ps: a copy of the table, to show that it trained
    return emb_rref.local_value().weight.detach().clone()


def worker_name(rank, world_size):  # trainer0..trainer{N-1}, master, ps, for N trainers
    num_trainers = world_size - 2
    if rank < num_trainers:
        return f"trainer{rank}"
    return "master" if rank == num_trainers else "ps"


def report_trainer(losses, seconds, dense_parameters):
    """A trainer's figures, and its dense weights' digest, which DDP keeps the same on all."""
    # rpc_harness.report: not in the tutorial, figures for the run's summary, which rank 0
    # writes at the end (_run_trainer returns nothing, as the tutorial's).
    weights = b"".join(param.detach().cpu().numpy().tobytes() for param in dense_parameters)
    rpc_harness.report(losses=losses, train_seconds=round(seconds, 3), backend=dist.get_backend(),
                       dense_weights=hashlib.sha256(weights).hexdigest())


def report_table(before, after):  # the master's: how far the table on ps moved
    rpc_harness.report(table_change=(after - before).abs().max().item())


def write_summary(args, reports):  # and proof that both halves trained
    change = reports.pop("master")["table_change"]
    trainers = {name: report for name, report in reports.items() if name != "ps"}
    first = next(iter(trainers.values()))
    identical = len({report["dense_weights"] for report in trainers.values()}) == 1
    print(f"Dense layer weights identical on {', '.join(trainers)}: {'yes' if identical else 'NO'}")
    print(f"Embedding table on ps changed: {'yes' if change > 0 else 'NO'} "
          f"(largest change {change:.4f})")
    return ({"example": "ddp_rpc_hybrid", "world_size": args.world_size, "trainers": len(trainers),
             "remote_module": args.remote_module, "backend": first["backend"],
             "iterations_per_trainer": dict.fromkeys(trainers,
                                                     args.epochs * args.batches_per_epoch),
             "first_loss": {name: round(r["losses"][0], 4) for name, r in trainers.items()},
             "last_loss": {name: round(r["losses"][-1], 4) for name, r in trainers.items()},
             "dense_weights_identical": identical, "embedding_table_changed": change > 0,
             "embedding_table_max_change": round(change, 4),
             "train_seconds": max(r["train_seconds"] for r in trainers.values())},
            "loss " + ", ".join(f"{name} {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}"
                                for name, r in trainers.items()))


def computes_much(rank, world_size):
    """No rank: a model this small gains nothing from intra-op threads, so each gets one."""
    return False


def trains(rank, world_size):
    """The ranks that loop over batches, whose steps --profile records: the trainers."""
    return rank < world_size - 2


# --------- The tutorial's __main__ --------------------

def parse_args(argv=None):
    """The tutorial's command line, with this project's flags, checked (bad input ends the
    command here in one line, status 2). remote_module.py builds on make_parser()."""
    parser = make_parser("the tutorial's 2020 revision")
    args = parser.parse_args(argv)
    check_args(parser, args)
    args.remote_module = False  # the table as an RRef (remote_module.py: a RemoteModule)
    return args


def make_parser(revision):
    # rpc_harness.ArgumentParser: argparse's, with every default in --help and errors in one
    # line (status 2). rpc_harness.int_at_least(N) and port_number: argument types that refuse
    # what a plain int would let through. The tutorial has no flags: these are its constants.
    parser = rpc_harness.ArgumentParser(
        description="DistributedDataParallel with distributed RPC: an nn.EmbeddingBag on the "
                    "parameter server ps, an nn.Linear under DDP on the trainers, driven by the "
                    f"master ({revision}).")
    parser.add_argument(
        "--world_size", "--world-size",
        type=rpc_harness.int_at_least(3),
        default=4,
        help="""Total number of processes: N-2 trainers (ranks 0 to N-3), the master
        (rank N-2) and the parameter server ps (rank N-1).""")
    parser.add_argument(
        "--rank",
        type=rpc_harness.int_at_least(0),
        default=None,
        help="""Global rank of this process. Without it, every rank starts here (or
        torchrun's RANK).""")
    parser.add_argument(
        "--master_addr", "--master-addr",
        type=str,
        default=os.environ.get("MASTER_ADDR", "localhost"),
        help="""Address of rank 0, where every rank meets (or $MASTER_ADDR).""")
    parser.add_argument(
        "--master_port", "--master-port",
        type=rpc_harness.port_number,
        default=os.environ.get("MASTER_PORT", "29500"),
        help="""Port of rank 0, where every rank meets (or $MASTER_PORT).""")
    # Not in the tutorial: the length of training; then the flags that every example of this
    # project has (timeouts, --seed, --summary_json, --profile).
    parser.add_argument(
        "--epochs",
        type=rpc_harness.int_at_least(1),
        default=100,
        metavar="N",
        help="epochs a trainer")
    parser.add_argument(
        "--batches_per_epoch", "--batches-per-epoch",
        type=rpc_harness.int_at_least(1),
        default=10,
        metavar="N",
        help="batches in each epoch")
    # auto (shared memory): each iteration is a few tiny messages, latency-bound.
    rpc_harness.add_arguments(parser, rpc_transport="auto")
    return parser


def check_args(parser, args):
    """Not in the tutorial: what argparse cannot check. rpc_harness.check_args: the world, the
    rank, the address and port, --profile's folder; torchrun's RANK and WORLD_SIZE stand for
    --rank and --world_size; and args.harness records what rpc_harness needs in every rank
    (README: "What the harness changes")."""
    rpc_harness.check_args(parser, args, worker_name, computes=computes_much, loops=trains,
                           summary=write_summary)


if __name__ == "__main__":
    args = parse_args()
    # Not in the tutorial: when a rank fails or is killed, or on Ctrl-C or SIGTERM, this
    # command stops the ranks it started and says why in one line.
    rpc_harness.supervise(args)
    # spawn, as mp.spawn starts its ranks: the rank that --rank names starts afresh too, not as
    # a fork of this process
    mp.set_start_method("spawn")

    processes = []
    if args.rank is None:
        # 2 trainers, 1 parameter server, 1 master (the tutorial's world_size = 4: --world_size).
        mp.spawn(run_worker, args=(args.world_size, args), nprocs=args.world_size, join=True)
    else:
        # Not in the tutorial: the one rank that --rank (or torchrun) names, in a process of its
        # own, as the parameter-server tutorial starts its ranks.
        p = mp.Process(target=run_worker, args=(args.rank, args.world_size, args))
        p.start()
        processes.append(p)

        for p in processes:
            p.join()
        # Not in the tutorial: the rank's exit status is the command's; rpc_harness.exit_status
        # says, in one line, when a signal killed the rank (which then could not say it).
        sys.exit(rpc_harness.exit_status(p))
