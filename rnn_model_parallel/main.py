"""Getting Started with Distributed RPC Framework, the distributed RNN: the tutorial's code, in
its order, with the imports and docstrings of the pytorch/examples script distributed/rpc/rnn/
main.py. ps (rank 0) holds the embedding table and the decoder of rnn.RNNModel (rnn.py), and
each trainer its LSTM; the trainer's forward and backward passes cross to ps through RPC and
distributed autograd.

Each line that is not the tutorial's ends with "# ours:" and why, or sits in a block under a
comment that says so. What is not the lesson (this project's flags and checks, torchrun's
environment, each epoch's loss, --profile and the run's summary) is in extras.py, the trainer's
data in data.py. README.md maps the tutorial's sections to this file.

    python main.py --epochs 4                            # every rank on this machine
    python main.py --rank 1                              # one rank per terminal
    torchrun --nproc_per_node=2 main.py                  # one rank per torchrun worker
"""

import argparse  # ours: the command line, which the tutorial does not have
import os
import sys  # ours: the command's exit status

# ours: extras before torch's modules, so that its warning filters are in place when torch
# 2.4 warns, on importing torch.distributed.optim, that TorchScript's optimizers are deprecated
import extras  # ours: this project's flags and checks, each epoch's loss, --profile, summary
# isort: split

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.optim as optim
from torch.distributed.optim import DistributedOptimizer

import rnn
from data import next_token_windows, training_data  # ours: the trainer's data (data.py)


def _run_trainer(args, prof):  # ours: the flags; --profile's profiler
    r"""
    The trainer creates a distributed RNNModel and a DistributedOptimizer. Then,
    it performs training using the tokens of data.py (the tutorial's: random input data).
    """
    # ours: the sizes are flags (the tutorial's values by default, but one LSTM layer: README.md
    # says why); ntoken and the tokens, cut into `nindices` sequences, come from the data
    batch = args.bptt
    ntoken, source = training_data(args)
    ninp = args.emsize
    nhid = args.nhid
    nindices = args.batch_size
    nlayers = args.nlayers
    hidden = (
        torch.randn(nlayers, nindices, nhid),
        torch.randn(nlayers, nindices, nhid)
    )

    model = rnn.RNNModel('ps', ntoken, ninp, nhid, nlayers, args.dropout)  # ours: --dropout

    # setup distributed optimizer
    opt = DistributedOptimizer(
        optim.SGD,
        model.parameter_rrefs(),
        lr=args.lr,  # ours: --lr
    )

    criterion = torch.nn.CrossEntropyLoss()

    def get_next_batch():
        # ours: windows of `batch` steps over the tokens, in order; the target, the next token
        yield from next_token_windows(source, batch, args.max_batches)

    progress = extras.Progress(ntoken, model)  # ours: where the parts are; each epoch's loss
    # train for 10 iterations
    for epoch in range(args.epochs):  # ours: --epochs, the tutorial's 10 by default
        # create distributed autograd context
        for data, target in get_next_batch():
            with dist_autograd.context() as context_id:
                hidden[0].detach_()
                hidden[1].detach_()
                output, hidden = model(data, hidden)
                output, target = output.view(-1, ntoken), target.view(-1)  # ours: a class a token
                loss = criterion(output, target)
                # run distributed backward pass
                dist_autograd.backward(context_id, [loss])
                # run distributed optimizer
                opt.step(context_id)
                # not necessary to zero grads as each iteration creates a different
                # distributed autograd context which hosts different grads
            progress.add(loss, target)  # ours: the epoch's loss, for the line below
            prof.step()  # ours: --profile records steps 3 to 5; nothing without it
        print("Training epoch {}".format(epoch))
        progress.end_epoch(epoch)  # ours: the epoch's loss and perplexity
    rpc.rpc_sync("ps", extras.report, args=(progress.figures(),))  # ours: to ps, for the summary


def run_worker(rank, world_size, args):  # ours: args
    r"""
    A wrapper function that initializes RPC, calls the function, and shuts down
    RPC.
    """
    torch.manual_seed(args.seed)  # ours: --seed, so that a run repeats
    os.environ['MASTER_ADDR'] = args.master_addr  # ours: --master_addr, not 'localhost'
    os.environ['MASTER_PORT'] = args.master_port  # ours: --master_port, not '29500'
    prof = extras.profile(args, rank, world_size)  # ours: --profile DIR; nothing without it
    # ours: any rank but ps trains (the tutorial: rank 1, its one trainer), as "trainer", or with
    # several trainers trainer1, trainer2...
    if rank != 0:
        rpc.init_rpc(extras.worker_name(rank, world_size), rank=rank, world_size=world_size)
        _run_trainer(args, prof)
    else:
        rpc.init_rpc("ps", rank=rank, world_size=world_size)
        # parameter server does nothing
        pass

    store = extras.hold_store(args, rank)  # ours: rank 0's store, kept for rpc.shutdown()
    # block until all rpcs finish
    rpc.shutdown()
    extras.release_store(args, rank, store)  # ours: (extras.hold_store says why)
    extras.finish(args, prof)  # ours: --profile's trace; on ps, the summary as its last line


if __name__ == "__main__":
    # ours: the tutorial's world size as a flag, beside extras.py's flags (--rank, --epochs...)
    parser = argparse.ArgumentParser(description=extras.DESCRIPTION)
    parser.add_argument("--world_size", "--world-size", type=int, default=2, metavar="N",
                        help="number of processes: ps (rank 0) and the trainers")
    extras.add_arguments(parser)
    args = parser.parse_args()
    extras.check_args(parser, args)
    world_size = args.world_size
    # ours: with --rank (or under torchrun), this one rank, in a process of its own as the other
    # tutorials start it (mp.Process); its status is the command's, 128 + N where signal N
    # killed it, as a shell shows
    if args.rank is not None:
        mp.set_start_method("spawn")
        p = mp.Process(target=run_worker, args=(args.rank, world_size, args))
        p.start()
        p.join()
        sys.exit(p.exitcode if p.exitcode >= 0 else 128 - p.exitcode)
    mp.spawn(run_worker, args=(world_size, args), nprocs=world_size, join=True)
