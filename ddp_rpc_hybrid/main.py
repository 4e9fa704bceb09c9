"""Combining Distributed DataParallel with Distributed RPC Framework: the tutorial's code,
runnable. With N trainers (world size N + 2): ranks 0..N-1 are the trainers, rank N the master,
rank N+1 the parameter server `ps`, which holds an nn.EmbeddingBag; each trainer looks up
embeddings there through RPC and runs an nn.Linear replicated under DDP. README.md says what
differs from the tutorial and why; rpc_harness starts the ranks and bounds every wait;
remote_module.py runs the tutorial's 2021 revision. `python main.py`, or `--rank R` in each
terminal."""

import hashlib
import random
import time

try:
    import rpc_harness  # first: it sets what torch reads when it loads
except ModuleNotFoundError:
    raise SystemExit("rpc_harness is missing: run `make run` in the repository once, then use "
                     ".venv/bin/python (README.md)") from None

# isort: split
import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import optim
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef
from torch.nn.parallel import DistributedDataParallel as DDP

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
            rpc_harness.profile_step()  # not in the tutorial: --profile's window
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


def run_worker(rank, world_size, args):
    num_trainers = world_size - 2  # the tutorial's two trainers, master rank 2 and ps rank 3

    rpc_backend_options = rpc_harness.options()

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
        dist.init_process_group(
                backend=backend, rank=rank, world_size=num_trainers,
                init_method=rpc_harness.INIT_METHOD)

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


def parse_args(argv=None, revision="2020"):
    parser = rpc_harness.ArgumentParser(
        description="DistributedDataParallel with distributed RPC: an nn.EmbeddingBag on the "
                    f"parameter server ps, an nn.Linear under DDP on the trainers, driven by the "
                    f"master (the tutorial's {revision} revision).")
    # auto (shared memory): each iteration is a few tiny messages, latency-bound.
    rpc_harness.add_arguments(parser, world_size=4, min_world_size=3,
                              roles="N-2 trainers (ranks 0 to N-3), the master (rank N-2) and the "
                                    "parameter server ps (rank N-1)", rpc_transport="auto")
    add = parser.add_argument
    add("--epochs", type=rpc_harness.int_at_least(1), default=100, metavar="N",
        help="epochs a trainer")
    add("--batches_per_epoch", "--batches-per-epoch", type=rpc_harness.int_at_least(1),
        default=10, metavar="N", help="batches in each epoch")
    # heavy: none, a model this small gains nothing from threads; loops: the trainers'
    args = rpc_harness.parse_args(parser, argv, worker_name, heavy=lambda *_: False,
                                  loops=lambda rank, n: rank < n - 2, summary=write_summary)
    args.remote_module = revision == "2021"
    return args


def main(argv=None):
    args = parse_args(argv)
    # tutorial: mp.spawn(run_worker, args=(world_size, ), nprocs=world_size, join=True)
    rpc_harness.spawn(run_worker, args=(args.world_size, args), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
