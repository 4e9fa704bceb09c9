"""Getting Started with Distributed RPC Framework, the distributed RNN: the tutorial's code, in
its order. ps (rank 0) holds the embedding table and the decoder of rnn.RNNModel (rnn.py), and
each trainer its LSTM; the trainer's forward and backward passes cross to ps through RPC and
distributed autograd.

Each line that is not the tutorial's ends with "# ours:" and why. What is not the lesson (the
command line, which the tutorial does not have, each epoch's loss, the run's summary) is in
extras.py, the data in data.py. README.md maps the tutorial's sections to this file.

    python main.py --epochs 4                               # every rank on this machine
    python main.py --rank 1                                 # one rank per terminal
"""

# ours: the imports of the pytorch/examples script's main.py (the tutorial shows none)
import os
import sys  # ours: the command's exit status

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.optim as optim
from torch.distributed.optim import DistributedOptimizer

import rnn
import rpc_harness  # ours: this project's package: `make run` installs it (or `pip install -e .`)
from data import batchify, next_token_windows, training_data  # ours: a text, or made-up tokens
from extras import Progress, parse_args, worker_name  # ours: what is not the lesson (extras.py)


def _run_trainer(args):  # ours: args, the sizes and the data
    # The trainer builds the distributed RNNModel and a DistributedOptimizer, and trains it.
    ntoken, tokens, about = training_data(args)  # ours: the tutorial's random tokens, real
    print(about)  # ours: (above)
    source = batchify(tokens, args.batch_size)  # ours: (above)
    batch = args.bptt  # ours: the sizes are flags (README.md says which differ, and why)
    ninp = args.emsize  # ours: (above)

    nhid = args.nhid  # ours: (above)
    nindices = args.batch_size  # ours: (above)
    nlayers = args.nlayers  # ours: (above)
    hidden = (
        torch.randn(nlayers, nindices, nhid),
        torch.randn(nlayers, nindices, nhid)
    )

    model = rnn.RNNModel('ps', ntoken, ninp, nhid, nlayers, args.dropout)  # ours: --dropout
    print(f"Embedding table on ps ({model.table_device}), LSTM local, decoder on ps")  # ours

    # the distributed optimizer, over the parameters on ps and here
    opt = DistributedOptimizer(
        optim.SGD,
        model.parameter_rrefs(),
        lr=args.lr,  # ours: --lr
    )

    criterion = torch.nn.CrossEntropyLoss()

    def get_next_batch():
        # ours: windows of `batch` steps over the text; the target, the token that comes next
        yield from next_token_windows(source, batch, args.max_batches)  # ours: (above)

    progress = Progress(ntoken)  # ours: each epoch's loss; the summary's figures (extras.py)
    for epoch in range(args.epochs):  # ours: --epochs, the tutorial's 10 by default
        # each iteration in a distributed autograd context of its own
        for data, target in get_next_batch():
            rpc_harness.profile_step()  # ours: --profile's window; nothing without --profile
            with dist_autograd.context() as context_id:
                hidden[0].detach_()
                hidden[1].detach_()
                output, hidden = model(data, hidden)
                loss = criterion(output.view(-1, ntoken), target.view(-1))  # ours: a class a token
                # the backward pass, across ps and this trainer
                dist_autograd.backward(context_id, [loss])
                # the step, where each parameter lives
                opt.step(context_id)
                # no zero_grad: each iteration's context holds its own gradients
            progress.add(loss, target)  # ours: (above)
        print("Training epoch {}".format(epoch))
        progress.end_epoch(epoch)  # ours: (above)
    progress.report()  # ours: (above)


@rpc_harness.watched  # ours: this rank ends in one line if it fails or loses a peer
def run_worker(rank, world_size, args):  # ours: args
    # Every process runs this: it joins RPC, does its part, and leaves RPC.
    os.environ['MASTER_ADDR'] = args.master_addr  # ours: --master_addr, not 'localhost'
    os.environ['MASTER_PORT'] = str(args.master_port)  # ours: --master_port, not '29500'
    if rank != 0:  # ours: any rank but ps trains (the tutorial: rank 1, its one trainer)
        torch.manual_seed(args.seed + rank)  # ours: each trainer's own LSTM and state
        rpc.init_rpc(worker_name(rank, world_size), rank=rank, world_size=world_size,  # ours
                     rpc_backend_options=rpc_harness.options(args))  # ours: the harness's
        _run_trainer(args)  # ours: args
    else:
        rpc.init_rpc("ps", rank=rank, world_size=world_size,  # ours: below
                     rpc_backend_options=rpc_harness.options(args))  # ours: the harness's
        # ps does nothing itself: it hosts the parts that the trainers create there
        pass

    # until every RPC is done
    rpc.shutdown()


if __name__ == "__main__":
    args = parse_args()  # ours: the world size and the sizes as flags (extras.py)
    rpc_harness.supervise(args)  # ours: this command ends in one line when a rank fails
    mp.set_start_method("spawn")  # ours: --rank's process starts afresh, as mp.spawn's
    world_size = args.world_size  # ours: --world_size, the tutorial's 2 by default
    if args.rank is not None:  # ours: one rank (--rank, or torchrun's), as the other tutorials
        p = mp.Process(target=run_worker, args=(args.rank, world_size, args))  # ours
        p.start()  # ours: (above)
        p.join()  # ours: (above)
        sys.exit(rpc_harness.exit_status(p))  # ours: the rank's status, with its line
    mp.spawn(run_worker, args=(world_size, args), nprocs=world_size, join=True)  # ours: args
