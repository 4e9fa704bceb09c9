"""Combining Distributed DataParallel with Distributed RPC Framework, the tutorial's first
revision (2020): its code, in the order of the pytorch/examples script it came from (the model
first; the page shows run_worker first). With N trainers (world size N + 2): ranks 0..N-1 are the
trainers, rank N the master, rank N+1 the parameter server ps, which holds an nn.EmbeddingBag;
each trainer looks its bags up there through RPC and runs an nn.Linear replicated under DDP.
remote_module.py is the 2021 revision, with a RemoteModule.

Each line that is not the tutorial's ends with "# ours:" and why, or sits in a block under a
comment that says so. What is not the lesson (the command line, which the tutorial does not
have, the ranks' names, each trainer's device, the bags' indices, each epoch's loss and the
run's summary) is in extras.py. README.md says what differs from the tutorial and why.

    python main.py                                          # every rank on this machine
    python main.py --world_size=4 --rank=3                  # one rank per terminal
"""

import os
import random

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
from torch.distributed.optim import DistributedOptimizer
import torch.distributed.rpc as rpc
from torch.distributed.rpc import RRef
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
import torch.optim as optim

import rpc_harness  # ours: this project's package: `make run` installs it (or `pip install -e .`)
import extras  # ours: what is not the lesson: devices, the bags' indices, the summary, the flags

NUM_EMBEDDINGS = 100
EMBEDDING_DIM = 16


class HybridModel(torch.nn.Module):
    # The sparse part, the nn.EmbeddingBag on ps (emb_rref), and the dense part, an nn.Linear
    # that every trainer holds a replica of, kept the same on all by DistributedDataParallel.

    def __init__(self, emb_rref, device):
        super(HybridModel, self).__init__()
        self.emb_rref = emb_rref
        # ours: the trainer's GPU (the tutorial's cuda:device) or, without one, the CPU: .to,
        # not .cuda, and device_ids for a GPU only
        device = extras.trainer_device(device)
        self.fc = DDP(torch.nn.Linear(16, 8).to(device), device_ids=extras.gpu_ids(device))
        self.device = device

    def forward(self, indices, offsets):
        emb_lookup = self.emb_rref.rpc_sync().forward(indices, offsets)
        return self.fc(emb_lookup.to(self.device))  # ours: .to, not .cuda: the CPU too


def _retrieve_embedding_parameters(emb_rref):  # ours: the script's one line, for the page's loop
    return [RRef(p) for p in emb_rref.local_value().parameters()]  # ours: (above)


def _run_trainer(emb_rref, rank, args):  # ours: args, the run's length and seed
    # A trainer's loop, which the master starts: the lookup on ps, then nn.Linear here. In the
    # backward pass, DDP averages the dense gradients across the trainers, and distributed
    # autograd takes the table's to ps.

    # the model: the table on ps, the dense layer here under DDP
    model = HybridModel(emb_rref, rank)

    # RRefs to every parameter, for DistributedOptimizer: the table's, from ps,
    model_parameter_rrefs = rpc.rpc_sync(
            "ps", _retrieve_embedding_parameters, args=(emb_rref,))

    # and the local ones (model.parameters() holds only these)
    for param in model.parameters():
        model_parameter_rrefs.append(RRef(param))

    # the distributed optimizer, over both
    opt = DistributedOptimizer(
        optim.SGD,
        model_parameter_rrefs,
        lr=0.05,
    )

    criterion = torch.nn.CrossEntropyLoss()
    random.seed(args.seed * 1000 + rank)  # ours: this trainer's own batches, the same every run

    # the tutorial's random bags: 20 to 50 indices, in bags of 1 to 10
    def get_next_batch(rank):
        for _ in range(args.batches_per_epoch):  # ours: --batches_per_epoch, the tutorial's 10
            num_indices = random.randint(20, 50)

            # the bags' offsets
            offsets = []
            start = 0
            batch_size = 0
            while start < num_indices:
                offsets.append(start)
                start += random.randint(1, 10)
                batch_size += 1

            offsets_tensor = torch.LongTensor(offsets)
            # ours: each bag's target first (.to, not .cuda(rank): the CPU too), then its
            # indices, all of the target's class: random ones leave nothing to learn
            target = torch.LongTensor([random.randrange(8) for _ in offsets]).to(model.device)
            indices = extras.bag_indices(random, target, offsets, num_indices, NUM_EMBEDDINGS)
            yield indices, offsets_tensor, target

    progress = extras.Progress(model.fc)  # ours: each epoch's loss; the summary's figures

    for epoch in range(args.epochs):  # ours: --epochs, the tutorial's 100 by default
        for indices, offsets, target in get_next_batch(rank):
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
                rpc_backend_options=rpc_backend_options)

        # the embedding table, built on ps
        emb_rref = rpc.remote(
                "ps",
                torch.nn.EmbeddingBag,
                args=(NUM_EMBEDDINGS, EMBEDDING_DIM),
                kwargs={"mode": "sum"})
        table_before = extras.table_weights(emb_rref)  # ours: for the summary: how far it moves

        # the training loop on every trainer
        futs = []
        for trainer_rank in range(num_trainers):  # ours: every trainer (the tutorial: [0, 1])
            trainer_name = "trainer{}".format(trainer_rank)
            # ours: the trainer's own rank, not the master's; args; no time limit on training
            fut = rpc.rpc_async(
                    trainer_name, _run_trainer, args=(emb_rref, trainer_rank, args), timeout=0)
            futs.append(fut)

        # until every trainer is done
        for fut in futs:
            fut.wait()
        extras.report_table(table_before, emb_rref)  # ours: (above)
    elif rank < num_trainers:  # ours: the trainers (the tutorial: rank <= 1)
        # the trainers' own process group, for DDP
        # ours: NCCL on cuda:R, or Gloo (the tutorial: gloo), for the N trainers (the tutorial:
        # 2); the store of RPC's meeting, on one port; --rpc_timeout bounds DDP's allreduce
        dist.init_process_group(
            backend=extras.trainer_backend(rank, num_trainers), rank=rank, world_size=num_trainers,
            init_method=rpc_harness.init_method(args), timeout=extras.process_group_timeout(args))

        # then RPC
        trainer_name = "trainer{}".format(rank)
        rpc.init_rpc(
                trainer_name,
                rank=rank,
                world_size=world_size,
                rpc_backend_options=rpc_backend_options)

        # a trainer waits for the master's RPC
    else:
        rpc.init_rpc(
                "ps",
                rank=rank,
                world_size=world_size,
                rpc_backend_options=rpc_backend_options)
        # ps does nothing itself: it answers the trainers
        pass

    # until every RPC is done
    rpc.shutdown()
    if rank < num_trainers:  # ours: the trainers' process group ends too, after their
        dist.destroy_process_group()  # ours: loop (it uses it until rpc.shutdown() returns)


if __name__=="__main__":
    args = extras.parse_args()  # ours: the world size and this project's flags
    os.environ['MASTER_ADDR'] = args.master_addr  # ours: where the ranks meet (the tutorial:
    os.environ['MASTER_PORT'] = str(args.master_port)  # ours: localhost, ports 29500 and 29501)
    rpc_harness.supervise(args)  # ours: this command ends in one line when a rank fails
    mp.set_start_method("spawn")  # ours: --rank's process starts afresh, as mp.spawn's
    world_size = args.world_size  # ours: --world_size, the tutorial's 4 by default
    if args.rank is not None:  # ours: one rank (--rank, or torchrun's), as the other tutorials
        p = mp.Process(target=run_worker, args=(args.rank, world_size, args))  # ours: (above)
        p.start()  # ours: (above)
        p.join()  # ours: (above)
        raise SystemExit(rpc_harness.exit_status(p))  # ours: the rank's status, with its line
    mp.spawn(run_worker, args=(world_size, args), nprocs=world_size, join=True)  # ours: args
