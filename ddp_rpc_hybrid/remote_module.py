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
    torchrun --nproc_per_node=4 remote_module.py            # torchrun starts the ranks
"""

import os  # ours: MASTER_ADDR and MASTER_PORT, set in __main__
import random
import sys  # ours: the command's exit status

# ours: extras before torch's modules, so that its warning filters are in place when torch
# 2.4 warns, on importing torch.distributed.optim, that TorchScript's optimizers are deprecated
import extras  # ours: what is not the lesson: the flags, devices, the bags, the summary
# isort: split

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.optim as optim
from torch.distributed.nn import RemoteModule
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef
from torch.distributed.rpc import TensorPipeRpcBackendOptions
from torch.nn.parallel import DistributedDataParallel as DDP


NUM_EMBEDDINGS = 100
EMBEDDING_DIM = 16


class HybridModel(torch.nn.Module):
    r"""
    The model consists of a sparse part and a dense part.
    1) The dense part is an nn.Linear module that is replicated across all trainers using
    DistributedDataParallel.
    2) The sparse part is a Remote Module that holds an nn.EmbeddingBag on the parameter server.
    This remote model can get a Remote Reference to the embedding table on the parameter server.
    """

    def __init__(self, remote_emb_module, device):
        super(HybridModel, self).__init__()
        self.remote_emb_module = remote_emb_module
        # ours: the trainer's GPU (the tutorial's cuda:device) or, without one each, the CPU:
        # .to, not .cuda, and device_ids for a GPU only
        device = extras.trainer_device(device)
        self.fc = DDP(torch.nn.Linear(16, 8).to(device), device_ids=extras.gpu_ids(device))
        self.device = device

    def forward(self, indices, offsets):
        emb_lookup = self.remote_emb_module.forward(indices, offsets)
        return self.fc(emb_lookup.to(self.device))  # ours: .to, not .cuda: the CPU too


def _run_trainer(remote_emb_module, rank, args):  # ours: args, the run's length and seed
    r"""
    Each trainer runs a forward pass which involves an embedding lookup on the
    parameter server and running nn.Linear locally. During the backward pass,
    DDP is responsible for aggregating the gradients for the dense part
    (nn.Linear) and distributed autograd ensures gradients updates are
    propagated to the parameter server.
    """

    # Setup the model.
    model = HybridModel(remote_emb_module, rank)

    # Retrieve all model parameters as rrefs for DistributedOptimizer.

    # Retrieve parameters for embedding table.
    model_parameter_rrefs = model.remote_emb_module.remote_parameters()

    # model.fc.parameters() only includes local parameters.
    # NOTE: Cannot call model.parameters() here,
    # because this will call remote_emb_module.parameters(),
    # which supports remote_parameters() but not parameters().
    for param in model.fc.parameters():
        model_parameter_rrefs.append(RRef(param))

    # Setup distributed optimizer
    opt = DistributedOptimizer(
        optim.SGD,
        model_parameter_rrefs,
        lr=0.05,
    )

    criterion = torch.nn.CrossEntropyLoss()
    random.seed(args.seed * 1000 + rank)  # ours: this trainer's own batches, the same every run

    def get_next_batch(rank):
        for _ in range(args.batches_per_epoch):  # ours: --batches_per_epoch, the tutorial's 10
            num_indices = random.randint(20, 50)

            # Generate offsets.
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

    progress = extras.Progress(model.fc, args)  # ours: each epoch's loss; --profile's steps

    # Train for 100 epochs
    for epoch in range(args.epochs):  # ours: --epochs, the tutorial's 100 by default
        # create distributed autograd context
        for indices, offsets, target in get_next_batch(rank):
            with dist_autograd.context() as context_id:
                output = model(indices, offsets)
                loss = criterion(output, target)

                # Run distributed backward pass
                dist_autograd.backward(context_id, [loss])

                # Tun distributed optimizer
                opt.step(context_id)

                # Not necessary to zero grads as each iteration creates a different
                # distributed autograd context which hosts different grads
            progress.add(loss)  # ours: for the epoch's mean loss, and --profile's step
        print("Training done for epoch {}".format(epoch))
        progress.end_epoch(epoch)  # ours: "trainerR: epoch N loss L"; the figures to the master


def run_worker(rank, world_size, args):  # ours: args
    r"""
    A wrapper function that initializes RPC, calls the function, and shuts down
    RPC.
    """
    torch.manual_seed(args.seed)  # ours: the same first weights every run
    prof = extras.serving_profiler(args, rank, world_size)  # ours: --profile: master's, ps's

    # We need to use different port numbers in TCP init_method for init_rpc and
    # init_process_group to avoid port conflicts.
    rpc_backend_options = TensorPipeRpcBackendOptions()
    # ours: --master_addr, and the port after --master_port (the tutorial: localhost:29501)
    rpc_backend_options.init_method = "tcp://{}:{}".format(args.master_addr, args.master_port + 1)
    num_trainers = world_size - 2  # ours: --world_size's trainers (the tutorial: 2)

    # Rank 2 is master, 3 is ps and 0 and 1 are trainers.
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
        # ours: for the summary: how far the table (the nn.EmbeddingBag itself, on ps) moves
        table = remote_emb_module.get_module_rref()
        table_before = extras.table_weights(table)

        # Run the training loop on trainers.
        futs = []
        for trainer_rank in range(num_trainers):  # ours: every trainer (the tutorial: [0, 1])
            trainer_name = "trainer{}".format(trainer_rank)
            # ours: args; no time limit on training
            fut = rpc.rpc_async(
                trainer_name, _run_trainer, args=(remote_emb_module, trainer_rank, args),
                timeout=0,
            )
            futs.append(fut)

        # Wait for all training to finish.
        for fut in futs:
            fut.wait()
        extras.report_table(table_before, table)  # ours: the table's change, for the summary
    elif rank < num_trainers:  # ours: the trainers (the tutorial: rank <= 1)
        # Initialize process group for Distributed DataParallel on trainers.
        # ours: NCCL on cuda:R or Gloo, saying which and why (the tutorial: gloo), for the N
        # trainers (the tutorial: 2); env://, as main.py (the tutorial: tcp://localhost:29500)
        dist.init_process_group(
            backend=extras.trainer_backend(rank, num_trainers), rank=rank, world_size=num_trainers
        )

        # Initialize RPC.
        trainer_name = "trainer{}".format(rank)
        rpc.init_rpc(
            trainer_name,
            rank=rank,
            world_size=world_size,
            rpc_backend_options=rpc_backend_options,
        )

        # Trainer just waits for RPCs from master.
    else:
        rpc.init_rpc(
            "ps",
            rank=rank,
            world_size=world_size,
            rpc_backend_options=rpc_backend_options,
        )
        # parameter server do nothing
        pass

    # ours: rank 0's store of RPC's join, kept for rpc.shutdown() (extras.hold_store)
    store = extras.hold_store(args, rank, args.master_port + 1)
    # block until all rpcs finish
    rpc.shutdown()
    extras.release_store(args, rank, store)  # ours: (extras.hold_store says why)
    # ours: the trainers' process group ends too (torch asks for it); then --profile's trace
    # (the master's, ps's) and the master's summary
    if rank < num_trainers:
        dist.destroy_process_group()
    extras.finish(args, rank, prof)


if __name__ == "__main__":
    # 2 trainers, 1 parameter server, 1 master.
    # ours: the command line: the tutorial's world size as a flag, and extras.py's flags (one
    # rank a terminal, torchrun, the run's length, the summary), checked; where ranks meet
    parser = extras.parser()
    parser.add_argument("--world_size", "--world-size", type=int, default=4,
                        help="ranks: N-2 trainers (ranks 0 to N-3), the master, ps")
    args = extras.parse_args(parser, remote_module=True)
    os.environ["MASTER_ADDR"] = args.master_addr
    os.environ["MASTER_PORT"] = str(args.master_port)
    world_size = args.world_size
    # ours: with --rank (or under torchrun), this one rank, in a process of its own as the
    # other tutorials start it (mp.Process); its status is the command's, 128 + N where signal
    # N killed it, as a shell shows
    if args.rank is not None:
        mp.set_start_method("spawn")
        p = mp.Process(target=run_worker, args=(args.rank, world_size, args))
        p.start()
        p.join()
        sys.exit(p.exitcode if p.exitcode >= 0 else 128 - p.exitcode)
    mp.spawn(run_worker, args=(world_size, args), nprocs=world_size, join=True)
