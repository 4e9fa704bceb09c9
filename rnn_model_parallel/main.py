"""Getting Started with Distributed RPC Framework, the distributed RNN: the tutorial's code, in
its order. ps (rank 0) holds the embedding table and the decoder of rnn.RNNModel (rnn.py), and
each trainer its LSTM; the trainer's forward and backward passes cross to ps through RPC and
distributed autograd.

Each line that is not the tutorial's ends with "# ours:" and why, or sits in a block under a
comment that says so. What is not the lesson (the command line, which the tutorial does not
have, the data, each epoch's loss, the run's summary) is in extras.py, the data itself in
data.py. README.md maps the tutorial's sections to this file.

    python main.py --epochs 4                               # every rank on this machine
    python main.py --rank 1                                 # one rank per terminal
"""

# ours: the imports of the pytorch/examples script's main.py (the tutorial shows none)
import os

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.optim as optim
from torch.distributed.optim import DistributedOptimizer

import rnn
import rpc_harness  # ours: this project's package: `make run` installs it (or `pip install -e .`)
import extras  # ours: what is not the lesson: the data, each epoch's loss, the summary, the flags
from data import next_token_windows  # ours: windows over the tokens, each with the next token


def _run_trainer(args):  # ours: args, the sizes and the data
    # The trainer creates a distributed RNNModel and a DistributedOptimizer. Then, it trains
    # it, here on a text (or tokens that follow a rule), where the tutorial's data is random.
    # ours: the sizes are flags (README.md says which defaults differ, and why); ntoken and the
    # tokens, cut into `nindices` sequences, from --corpus or the synthetic task (extras.py)
    batch = args.bptt
    ntoken, source = extras.training_data(args)
    ninp = args.emsize

    nhid = args.nhid  # ours: (above)
    nindices = args.batch_size  # ours: (above)
    nlayers = args.nlayers  # ours: (above)
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
            rpc_harness.profile_step()  # ours: --profile's window; nothing without --profile
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
            progress.add(loss, target)  # ours: (above)
        print("Training epoch {}".format(epoch))
        progress.end_epoch(epoch)  # ours: the epoch's loss, and the summary's figures so far


@rpc_harness.watched  # ours: this rank ends in one line if it fails or loses a peer
def run_worker(rank, world_size, args):  # ours: args
    # A wrapper function that initializes RPC, calls the function, and shuts down RPC.
    os.environ['MASTER_ADDR'] = args.master_addr  # ours: --master_addr, not 'localhost'
    os.environ['MASTER_PORT'] = str(args.master_port)  # ours: --master_port, not '29500'
    # ours: any rank but ps trains (the tutorial: rank 1, its one trainer), with a seed and a
    # model of its own, named "trainer", or trainer1, trainer2...; the harness's options
    if rank != 0:
        torch.manual_seed(args.seed + rank)
        rpc.init_rpc(extras.worker_name(rank, world_size), rank=rank, world_size=world_size,
                     rpc_backend_options=rpc_harness.options(args))
        _run_trainer(args)
    else:
        rpc.init_rpc("ps", rank=rank, world_size=world_size,  # ours: below
                     rpc_backend_options=rpc_harness.options(args))  # ours: the harness's
        # parameter server does nothing
        pass

    # block until all rpcs finish
    rpc.shutdown()


if __name__ == "__main__":
    args = extras.parse_args()  # ours: the world size and the sizes as flags
    rpc_harness.supervise(args)  # ours: this command ends in one line when a rank fails
    mp.set_start_method("spawn")  # ours: --rank's process starts afresh, as mp.spawn's
    world_size = args.world_size  # ours: --world_size, the tutorial's 2 by default
    # ours: one rank (--rank, or torchrun's), as the other tutorials start it
    if args.rank is not None:
        p = mp.Process(target=run_worker, args=(args.rank, world_size, args))
        p.start()
        p.join()
        raise SystemExit(rpc_harness.exit_status(p))  # ours: the rank's status, with its line
    mp.spawn(run_worker, args=(world_size, args), nprocs=world_size, join=True)  # ours: args
