"""The 2021 revision of the tutorial (pytorch/tutorials#1513, the code of
pytorch/examples#908), which the tutorial's page shows today. The table on ps becomes a
torch.distributed.nn.RemoteModule: `RemoteModule("ps", ...)` creates it there, its `forward`
runs there, and `remote_parameters()` gives the RRefs that DistributedOptimizer needs, in place
of main.py's `emb_rref`, `emb_rref.rpc_sync().forward` and `_retrieve_embedding_parameters`.
Everything else is main.py's: the batches, devices, seeds, log lines, the command line, and the
trainers and ps, which do the same in both revisions. README.md shows the two side by side.

    python remote_module.py                                 # 2 trainers, the master, ps
    python remote_module.py --world_size=4 --rank=3         # one rank per terminal
"""

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
from torch.distributed.nn import RemoteModule
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef
from torch.nn.parallel import DistributedDataParallel as DDP

try:
    import rpc_harness
except ModuleNotFoundError:
    raise SystemExit("rpc_harness, this project's package, is missing: install it with "
                     "`pip install -e PATH`, PATH being the repository's folder (the one that "
                     "holds pyproject.toml), or run `make run` there") from None

from main import (
    EMBEDDING_DIM,
    NUM_EMBEDDINGS,
    _get_embedding_weights,
    check_args,
    choose_backend_and_device,
    get_next_batch,
    make_parser,
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
            # Not in the tutorial: a step of --profile's window (nothing without --profile).
            rpc_harness.profile_step()
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


@rpc_harness.watched  # not in the tutorial: one line when this rank ends early
def run_worker(rank, world_size, args):
    # Where the ranks meet: --master_addr and --master_port, as in main.py (this revision's
    # init_methods name tcp://localhost:29500 and tcp://localhost:29501).
    os.environ['MASTER_ADDR'] = args.master_addr
    os.environ['MASTER_PORT'] = str(args.master_port)
    num_trainers = world_size - 2
    if rank != num_trainers:
        return run_trainer_or_ps(rank, world_size, args)  # the same in both revisions

    # rpc_harness.options(args): TensorPipe's options, meeting through rpc_harness (main.py
    # says more).
    rpc.init_rpc(
        "master",
        rank=rank,
        world_size=world_size,
        rpc_backend_options=rpc_harness.options(args))

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


# --------- The tutorial's __main__ --------------------

def parse_args(argv=None):
    """main.py's command line, checked as main.py checks it (bad input ends the command here in
    one line, status 2)."""
    parser = make_parser("the tutorial's 2021 revision, with a RemoteModule")
    args = parser.parse_args(argv)
    check_args(parser, args)
    args.remote_module = True  # the table as a RemoteModule (main.py: an RRef)
    return args


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
