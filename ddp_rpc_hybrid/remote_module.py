"""The 2021 revision of the tutorial (pytorch/tutorials#1513, the code of
pytorch/examples#908), which the tutorial's page shows today. The table on ps becomes a
torch.distributed.nn.RemoteModule: `RemoteModule("ps", ...)` creates it there, its `forward`
runs there, and `remote_parameters()` gives the RRefs that DistributedOptimizer needs, in place
of main.py's `emb_rref`, `emb_rref.rpc_sync().forward` and `_retrieve_embedding_parameters`.
Everything else is main.py's: the batches, devices, seeds, log lines, and the trainers and ps,
which do the same in both revisions. README.md shows the two side by side.

    python remote_module.py                         # 2 trainers, the master, ps
"""

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
from torch.distributed.nn import RemoteModule
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef
from torch.nn.parallel import DistributedDataParallel as DDP

from main import (
    EMBEDDING_DIM,
    NUM_EMBEDDINGS,
    _get_embedding_weights,
    choose_backend_and_device,
    get_next_batch,
    parse_args,
    report_table,
    report_trainer,
)
from main import run_worker as run_trainer_or_ps


class HybridModel(torch.nn.Module):
    """The sparse part, a RemoteModule that holds the nn.EmbeddingBag on ps, and the dense part,
    an nn.Linear replicated on every trainer under DistributedDataParallel."""

    def __init__(self, remote_emb_module, device):
        super().__init__()
        self.remote_emb_module = remote_emb_module
        device_ids = [device] if device.type == "cuda" else None  # a CPU module takes none
        self.fc = DDP(torch.nn.Linear(16, 8).to(device), device_ids=device_ids)
        self.device = device

    def forward(self, indices, offsets):
        emb_lookup = self.remote_emb_module.forward(indices, offsets)
        return self.fc(emb_lookup.to(self.device))


def _run_trainer(remote_emb_module, rank, args):
    """main.py's _run_trainer, with the RemoteModule."""
    torch.manual_seed(args.seed)  # DDP copies trainer0's initial dense weights to the others
    _, device = choose_backend_and_device(rank, dist.get_world_size(), torch.cuda.device_count())
    if device.type == "cuda":
        torch.cuda.set_device(device)  # this RPC thread's current device, for NCCL and DDP

    # Setup the model.
    model = HybridModel(remote_emb_module, device)

    # Retrieve all model parameters as rrefs for DistributedOptimizer: the table's,
    model_parameter_rrefs = model.remote_emb_module.remote_parameters()
    # and the local ones. Not model.parameters(): it would call remote_emb_module.parameters(),
    # which a RemoteModule does not support.
    for param in model.fc.parameters():
        model_parameter_rrefs.append(RRef(param))

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
            with dist_autograd.context() as context_id:
                output = model(indices, offsets)
                loss = criterion(output, target)
                dist_autograd.backward(context_id, [loss])
                opt.step(context_id)
            losses.append(loss.item())
        print("Training done for epoch {}".format(epoch))
        epoch_losses.append(sum(losses) / len(losses))
        print(f"trainer{rank}: epoch {epoch} loss {epoch_losses[-1]:.4f}")
    # not in the tutorial: the summary's figures
    report_trainer(epoch_losses, time.perf_counter() - started, model.fc.parameters())


def run_worker(rank, world_size, args):
    num_trainers = world_size - 2
    if rank != num_trainers:
        return run_trainer_or_ps(rank, world_size, args)  # the same in both revisions

    rpc.init_rpc(
        "master",
        rank=rank,
        world_size=world_size,
        rpc_backend_options=rpc_harness.options())

    remote_emb_module = RemoteModule(
        "ps",
        torch.nn.EmbeddingBag,
        args=(NUM_EMBEDDINGS, EMBEDDING_DIM),
        kwargs={"mode": "sum"},
    )
    table = remote_emb_module.get_module_rref()  # the nn.EmbeddingBag itself, on ps
    table_before = rpc.rpc_sync("ps", _get_embedding_weights, args=(table,))

    # Run the training loop on trainers, each with its own rank (timeout=0: see main.py).
    futs = []
    for trainer_rank in range(num_trainers):
        trainer_name = "trainer{}".format(trainer_rank)
        fut = rpc.rpc_async(
            trainer_name, _run_trainer, args=(remote_emb_module, trainer_rank, args), timeout=0)
        futs.append(fut)

    # Wait for all training to finish.
    for fut in futs:
        fut.wait()
    # not in the tutorial: how far the table moved, for the summary
    report_table(table_before, rpc.rpc_sync("ps", _get_embedding_weights, args=(table,)))

    # block until all rpcs finish
    rpc.shutdown()


def main(argv=None):
    args = parse_args(argv, revision="2021")
    # tutorial: mp.spawn(run_worker, args=(world_size, ), nprocs=world_size, join=True)
    rpc_harness.spawn(run_worker, args=(args.world_size, args), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
