"""Combining Distributed DataParallel with Distributed RPC Framework, the tutorial's 2021
revision (pytorch/tutorials#1513, the code of pytorch/examples#908), which its page shows
today: its code, in its order. The table on ps becomes a torch.distributed.nn.RemoteModule:
`RemoteModule("ps", ...)` creates it there, its `forward` runs there, and `remote_parameters()`
gives the RRefs that DistributedOptimizer needs, in place of main.py's `emb_rref`,
`emb_rref.rpc_sync().forward` and `_retrieve_embedding_parameters`. The rest is main.py's.

Each line that is not the tutorial's ends with "# ours:" and why, as in main.py; what is not
the lesson is in extras.py, which both share. README.md shows the two revisions side by side.

    python remote_module.py                                 # 2 trainers, the master, ps
    python remote_module.py --world_size=4 --rank=3         # one rank per terminal
"""

import os  # ours: MASTER_ADDR and MASTER_PORT, set in __main__ (the tutorial: run_worker)
import random
import sys  # ours: the command's exit status

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.optim as optim
from torch.distributed.nn import RemoteModule
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef
from torch.nn.parallel import DistributedDataParallel as DDP

import rpc_harness  # ours: this project's package: `make run` installs it (or `pip install -e .`)
from extras import Progress, get_next_batch, parse_args, process_group_timeout  # ours: extras.py
from extras import report_table, table_weights, trainer_backend, trainer_device  # ours: (above)

NUM_EMBEDDINGS = 100
EMBEDDING_DIM = 16


class HybridModel(torch.nn.Module):
    # The sparse part, a RemoteModule that holds the nn.EmbeddingBag on ps, and the dense part,
    # an nn.Linear that every trainer holds a replica of, kept the same on all by
    # DistributedDataParallel.

    def __init__(self, remote_emb_module, device):
        super(HybridModel, self).__init__()
        self.remote_emb_module = remote_emb_module
        device = trainer_device(device)  # ours: the rank's GPU (the tutorial's device), or the CPU
        self.fc = DDP(torch.nn.Linear(16, 8).to(device),  # ours: .to: the CPU too; device_ids
                      device_ids=[device] if device.type == "cuda" else None)  # ours: GPU's only
        self.device = device

    def forward(self, indices, offsets):
        emb_lookup = self.remote_emb_module.forward(indices, offsets)
        return self.fc(emb_lookup.to(self.device))  # ours: .to, not .cuda: the CPU too


def _run_trainer(remote_emb_module, rank, args):  # ours: args, the run's length and seed
    # A trainer's loop, which the master starts: the lookup on ps, then nn.Linear here. In the
    # backward pass, DDP averages the dense gradients across the trainers, and distributed
    # autograd takes the table's to ps.

    # the model: the table on ps, the dense layer here under DDP
    model = HybridModel(remote_emb_module, rank)

    # RRefs to every parameter, for DistributedOptimizer: the table's, from the RemoteModule,
    model_parameter_rrefs = model.remote_emb_module.remote_parameters()

    # and the dense layer's. Not model.parameters(): it would ask the RemoteModule for its
    # parameters(), which it does not support (remote_parameters() is its way).
    for param in model.fc.parameters():
        model_parameter_rrefs.append(RRef(param))

    # the distributed optimizer, over both
    opt = DistributedOptimizer(
        optim.SGD,
        model_parameter_rrefs,
        lr=0.05,
    )

    criterion = torch.nn.CrossEntropyLoss()
    rng = random.Random(args.seed * 1000 + rank)  # ours: batches of its own, the same every run
    progress = Progress(model.fc)  # ours: each epoch's loss; the summary's figures (extras.py)

    for epoch in range(args.epochs):  # ours: --epochs, the tutorial's 100 by default
        for indices, offsets, target in get_next_batch(  # ours: the tutorial's bags, made
                rng, args.batches_per_epoch, model.device, NUM_EMBEDDINGS):  # ours: learnable
            rpc_harness.profile_step()  # ours: --profile's window; nothing without --profile
            # each iteration in a distributed autograd context of its own
            with dist_autograd.context() as context_id:
                output = model(indices, offsets)
                loss = criterion(output, target)

                # the backward pass, across ps and the trainers
                dist_autograd.backward(context_id, [loss])

                # the step, where each parameter lives
                opt.step(context_id)

                # no zero_grad: each iteration's context holds its own gradients
            progress.add(loss)  # ours: for the epoch's mean loss
        print("Training done for epoch {}".format(epoch))
        progress.end_epoch(epoch)  # ours: "trainerR: epoch N loss L", and the figures so far


@rpc_harness.watched  # ours: this rank ends in one line if it fails or loses a peer
def run_worker(rank, world_size, args):  # ours: args
    # Every rank runs this: it joins RPC (the trainers, their process group first), does its
    # part, and leaves.
    num_trainers = world_size - 2  # ours: --world_size's trainers (the tutorial: 2)
    rpc_backend_options = rpc_harness.options(args)  # ours: the harness's meeting (not :29501)

    # Ranks 0..N-1 are the trainers, N the master, N+1 ps (the tutorial's N: 2).
    if rank == num_trainers:  # ours: the master (the tutorial: rank 2)
        rpc.init_rpc(
            "master",
            rank=rank,
            world_size=world_size,
            rpc_backend_options=rpc_backend_options,
        )

        remote_emb_module = RemoteModule(
            "ps",
            torch.nn.EmbeddingBag,
            args=(NUM_EMBEDDINGS, EMBEDDING_DIM),
            kwargs={"mode": "sum"},
        )
        table = remote_emb_module.get_module_rref()  # ours: the summary's: how far the table
        table_before = table_weights(table)  # ours: moves (the nn.EmbeddingBag itself, on ps)

        # the training loop on every trainer
        futs = []
        for trainer_rank in range(num_trainers):  # ours: every trainer (the tutorial: [0, 1])
            trainer_name = "trainer{}".format(trainer_rank)
            fut = rpc.rpc_async(
                trainer_name, _run_trainer, args=(remote_emb_module, trainer_rank, args),  # ours
                timeout=0,  # ours: args, above; no time limit on training (the harness bounds it)
            )
            futs.append(fut)

        # until every trainer is done
        for fut in futs:
            fut.wait()
        report_table(table_before, table)  # ours: (above)
    elif rank < num_trainers:  # ours: the trainers (the tutorial: rank <= 1)
        # the trainers' own process group, for DDP
        backend = trainer_backend(rank, num_trainers)  # ours: NCCL on cuda:R, or Gloo
        dist.init_process_group(
            backend=backend, rank=rank, world_size=num_trainers,  # ours: the tutorial: gloo, 2;
            init_method=rpc_harness.init_method(args),  # ours: and tcp://localhost:29500
            timeout=process_group_timeout(args),  # ours: --rpc_timeout bounds DDP's allreduce
        )

        # then RPC
        trainer_name = "trainer{}".format(rank)
        rpc.init_rpc(
            trainer_name,
            rank=rank,
            world_size=world_size,
            rpc_backend_options=rpc_backend_options,
        )

        # a trainer waits for the master's RPC
    else:
        rpc.init_rpc(
            "ps",
            rank=rank,
            world_size=world_size,
            rpc_backend_options=rpc_backend_options,
        )
        # ps does nothing itself: it answers the trainers
        pass

    # until every RPC is done
    rpc.shutdown()
    if rank < num_trainers:  # ours: the trainers' process group ends too, after their
        dist.destroy_process_group()  # ours: loop (it uses it until rpc.shutdown() returns)


if __name__ == "__main__":
    args = parse_args(remote_module=True)  # ours: main.py's command line (extras.py)
    os.environ["MASTER_ADDR"] = args.master_addr  # ours: where the ranks meet (the tutorial:
    os.environ["MASTER_PORT"] = str(args.master_port)  # ours: localhost, ports 29500 and 29501)
    rpc_harness.supervise(args)  # ours: this command ends in one line when a rank fails
    mp.set_start_method("spawn")  # ours: --rank's process starts afresh, as mp.spawn's
    world_size = args.world_size  # ours: --world_size, the tutorial's 4 by default
    if args.rank is not None:  # ours: one rank (--rank, or torchrun's), as the other tutorials
        p = mp.Process(target=run_worker, args=(args.rank, world_size, args))  # ours: (above)
        p.start()  # ours: (above)
        p.join()  # ours: (above)
        sys.exit(rpc_harness.exit_status(p))  # ours: the rank's status, with its line
    mp.spawn(run_worker, args=(world_size, args), nprocs=world_size, join=True)  # ours: args
