"""Combining Distributed DataParallel with Distributed RPC Framework: the tutorial's code,
runnable. With N trainers (world size N + 2): ranks 0..N-1 are the trainers, rank N the master,
rank N+1 the parameter server `ps`, which holds an nn.EmbeddingBag; each trainer looks up
embeddings there through RPC and runs an nn.Linear replicated under DDP. README.md says what
differs from the tutorial and why; launch.py starts the ranks and bounds every wait.
`python main.py`, or `--rank R` in each terminal."""

import random
import time

import launch  # before torch: it sets what torch reads when it is imported

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
            launch.profile_step()  # not in the tutorial: --profile's window (launch.py)
        print("Training done for epoch {}".format(epoch))
        epoch_losses.append(sum(losses) / len(losses))
        print(f"trainer{rank}: epoch {epoch} loss {epoch_losses[-1]:.4f}")
    return {"losses": epoch_losses, "train_seconds": time.perf_counter() - started,
            "backend": dist.get_backend(),
            "dense_weights": [param.detach().cpu() for param in model.parameters()]}


def run_worker(rank, world_size, args):
    num_trainers = world_size - 2  # the tutorial's two trainers, master rank 2 and ps rank 3

    if rank == num_trainers:
        # tutorial: rpc.init_rpc("master", rank=rank, world_size=world_size, ...)
        launch.init_rpc_with_timeout("master", rank=rank, world_size=world_size)

        # the embedding table, built on ps
        emb_rref = rpc.remote(
            "ps",
            torch.nn.EmbeddingBag,
            args=(NUM_EMBEDDINGS, EMBEDDING_DIM),
            kwargs={"mode": "sum"})
        table_before = rpc.rpc_sync("ps", _get_embedding_weights, args=(emb_rref,))

        # Run the training loop on trainers, each with its own rank (the tutorial passes the
        # master's). timeout=0: training takes as long as it takes (launch.py bounds the rest).
        futs = []
        for trainer_rank in range(num_trainers):
            trainer_name = "trainer{}".format(trainer_rank)
            fut = rpc.rpc_async(
                trainer_name, _run_trainer, args=(emb_rref, trainer_rank, args), timeout=0)
            futs.append(fut)

        # wait until every trainer is done
        results = {f"trainer{r}": fut.wait() for r, fut in enumerate(futs)}
        table_after = rpc.rpc_sync("ps", _get_embedding_weights, args=(emb_rref,))
    elif rank < num_trainers:
        # the trainers' own process group, for DDP
        backend, device = choose_backend_and_device(rank, num_trainers, torch.cuda.device_count())
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # tutorial: dist.init_process_group(backend="gloo", rank=rank, world_size=2)
        launch.init_process_group_with_timeout(
            f"trainer{rank}", backend=backend, rank=rank, world_size=num_trainers)

        # then RPC with everyone
        trainer_name = "trainer{}".format(rank)
        # tutorial: rpc.init_rpc(trainer_name, rank=rank, world_size=world_size, ...)
        launch.init_rpc_with_timeout(trainer_name, rank=rank, world_size=world_size)

        # the training loop arrives from the master, as an RPC
    else:
        torch.manual_seed(args.seed)  # the table's initial weights
        # tutorial: rpc.init_rpc("ps", rank=rank, world_size=world_size, ...)
        launch.init_rpc_with_timeout("ps", rank=rank, world_size=world_size)
        # ps only answers the calls of the master and the trainers

    # block until every rank is done
    launch.finish_and_shutdown()  # tutorial: rpc.shutdown()
    if rank < num_trainers:
        dist.destroy_process_group()
    elif rank == num_trainers:
        write_summary(args, results, table_before, table_after)


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


def doing(rank, world_size):  # what a rank does, said once it has joined
    if rank < world_size - 2:
        return "training the dense layer under DDP, once master starts the loop"
    return "starting the training loop" if rank == world_size - 2 else "holding the table"


def write_summary(args, results, table_before, table_after):  # and proof that both halves trained
    first = next(iter(results.values()))
    identical = all(torch.equal(mine, theirs) for result in results.values()
                    for mine, theirs in zip(result["dense_weights"], first["dense_weights"],
                                            strict=True))
    change = (table_after - table_before).abs().max().item()
    print(f"Dense layer weights identical on {', '.join(results)}: {'yes' if identical else 'NO'}")
    print(f"Embedding table on ps changed: {'yes' if change > 0 else 'NO'} "
          f"(largest change {change:.4f})")
    launch.write_summary(
        {"example": "ddp_rpc_hybrid", "world_size": args.world_size, "trainers": len(results),
         "remote_module": args.remote_module, "backend": first["backend"],
         "iterations_per_trainer": dict.fromkeys(results, args.epochs * args.batches_per_epoch),
         "first_loss": {name: round(r["losses"][0], 4) for name, r in results.items()},
         "last_loss": {name: round(r["losses"][-1], 4) for name, r in results.items()},
         "dense_weights_identical": identical, "embedding_table_changed": change > 0,
         "embedding_table_max_change": round(change, 4),
         "train_seconds": round(max(r["train_seconds"] for r in results.values()), 3)},
        "loss " + ", ".join(f"{name} {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}"
                            for name, r in results.items()))


def parse_args(argv=None):
    parser = launch.ArgumentParser(
        description="DistributedDataParallel with distributed RPC: an nn.EmbeddingBag on the "
                    "parameter server ps, an nn.Linear under DDP on the trainers, driven by the "
                    "master. --init_timeout also bounds each of DDP's allreduces.")
    # auto (shared memory): each iteration is a few tiny messages, latency-bound.
    launch.add_launch_arguments(parser, world_size=4, min_world_size=3,
                                roles="N-2 trainers (ranks 0 to N-3), the master (rank N-2) and "
                                      "the parameter server ps (rank N-1)", rpc_transport="auto")
    add = parser.add_argument
    add("--epochs", type=launch.int_at_least(1), default=100, metavar="N", help="epochs a trainer")
    add("--batches_per_epoch", "--batches-per-epoch", type=launch.int_at_least(1), default=10,
        metavar="N", help="batches in each epoch")
    add("--remote_module", "--remote-module", action="store_true",
        help="the tutorial's 2021 revision: the table as a RemoteModule (remote_module.py)")
    return launch.parse_args(parser, argv, min_world_size=3)


def main(argv=None):
    args = parse_args(argv)
    if args.remote_module:
        import remote_module  # the 2021 revision; it imports from here
    # heavy: the ranks that get the cores' threads; a model this small gains nothing from them.
    # tutorial: mp.spawn(run_worker, args=(world_size, ), nprocs=world_size, join=True)
    launch.start(args, remote_module.run_worker if args.remote_module else run_worker,
                 worker_name, doing, heavy=lambda *_: False, steps=lambda rank, n: rank < n - 2)


if __name__ == "__main__":
    main()
