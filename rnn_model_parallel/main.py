"""Getting Started with Distributed RPC Framework, the distributed RNN, runnable: ps (rank 0)
holds the embedding table and decoder of rnn.RNNModel, the trainer its LSTM. README.md says what
differs from the tutorial; rnn.py holds the model, data.py the data. rpc_harness, this
project's package, bounds every wait and ends every rank in one line when one fails; each of its
names is explained where main.py first uses it.

    python main.py --epochs 4                               # every rank on this machine
    python main.py --rank 1                                 # one rank per terminal
"""

import math
import os
import sys
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
from torch import optim
from torch.distributed.optim import DistributedOptimizer

try:
    import rpc_harness
except ModuleNotFoundError:
    raise SystemExit("rpc_harness, this project's package, is missing: install it with "
                     "`pip install -e PATH`, PATH being the repository's folder (the one that "
                     "holds pyproject.toml), or run `make run` there") from None

import rnn
from data import SYNTHETIC_NTOKEN, batchify, check_corpus, next_token_windows, training_data


def _run_trainer(name, args):
    ntoken, tokens, about = training_data(args)
    print(about)
    # The tutorial's (batch, nindices) = (5, 3) is 5 time steps of 3 sequences for nn.LSTM:
    # --bptt and --batch_size here, word_language_model's names.
    source = batchify(tokens, args.batch_size)
    ninp = args.emsize

    nhid = args.nhid
    nindices = args.batch_size
    nlayers = args.nlayers
    hidden = (
        torch.randn(nlayers, nindices, nhid),
        torch.randn(nlayers, nindices, nhid)
    )

    model = rnn.RNNModel('ps', ntoken, ninp, nhid, nlayers, args.dropout)
    print(f"Embedding table on ps ({model.table_device}), LSTM local, decoder on ps")

    # the distributed optimizer, over the parameters on ps and here
    opt = DistributedOptimizer(
        optim.SGD,
        model.parameter_rrefs(),
        lr=args.lr,
    )

    criterion = torch.nn.CrossEntropyLoss()

    def get_next_batch():
        # windows of --bptt steps, in order; the target is the next token at every position
        yield from next_token_windows(source, args.bptt, args.max_batches)

    # Not in the tutorial: each epoch's mean loss per target token, and the time spent.
    losses = []
    iterations = 0
    started = time.perf_counter()
    for epoch in range(args.epochs):
        loss_sum = 0.0
        targets = 0
        for data, target in get_next_batch():
            # Not in the tutorial: a step of --profile's window (nothing without --profile).
            rpc_harness.profile_step()
            # each iteration in a distributed autograd context of its own
            with dist_autograd.context() as context_id:
                hidden[0].detach_()
                hidden[1].detach_()
                output, hidden = model(data, hidden)
                loss = criterion(output.view(-1, ntoken), target.view(-1))
                # the backward pass, across ps and this trainer
                dist_autograd.backward(context_id, [loss])
                # the step, where each parameter lives
                opt.step(context_id)
                # no zero_grad: each iteration's context holds its own gradients
            loss_sum += loss.item() * target.numel()
            targets += target.numel()
            iterations += 1
        print("Training epoch {}".format(epoch))
        losses.append(loss_sum / targets)
        print(f"{name}: epoch {epoch} loss {losses[-1]:.4f} perplexity {math.exp(losses[-1]):.2f}")
    # Not in the tutorial: the figures for the run's summary, which rank 0 writes at the end.
    rpc_harness.report(losses=losses, iterations=iterations, ntoken=ntoken,
                       train_seconds=round(time.perf_counter() - started, 3))


@rpc_harness.watched  # not in the tutorial: one line when this rank ends early
def run_worker(rank, world_size, args):
    os.environ['MASTER_ADDR'] = args.master_addr
    os.environ['MASTER_PORT'] = str(args.master_port)
    if rank != 0:
        torch.manual_seed(args.seed + rank)
        # rpc_harness.options(args): TensorPipe's options, meeting through rpc_harness, which joins
        # the ranks where MASTER_ADDR and MASTER_PORT say (as the default env:// would), with
        # bounded waits. The join installs in this rank the harness's loop (Ctrl-C, SIGTERM, the
        # watch over the other ranks, which ends every rank in one line when one is lost or fails),
        # its share of the cores and whole lines (README.md: "What the harness changes").
        rpc.init_rpc(worker_name(rank, world_size), rank=rank, world_size=world_size,
                     rpc_backend_options=rpc_harness.options(args))
        _run_trainer(worker_name(rank, world_size), args)
    else:
        torch.manual_seed(args.seed)  # the weights and the dropout of the parts on ps
        rpc.init_rpc("ps", rank=rank, world_size=world_size,
                     rpc_backend_options=rpc_harness.options(args))
        # parameter server does nothing: it hosts the parts the trainers create there
        pass

    # block until all rpcs finish
    rpc.shutdown()


# --------- Not in the tutorial: names, the command line, the summary --------------------

def worker_name(rank, world_size):
    """Each rank's name in RPC, which the harness's messages use too: the tutorial's "ps" and
    "trainer"; with several trainers, trainer1, trainer2..."""
    if rank == 0:
        return "ps"
    if world_size == 2:
        return "trainer"
    return f"trainer{rank}"


def computes_nothing(rank, world_size):
    """No rank does heavy computing: a model this small gains nothing from more threads, so
    every rank gets one."""
    return False


def trains(rank, world_size):
    """The ranks that loop over batches (the trainers), whose steps --profile records."""
    return rank != 0


def write_summary(args, reports):
    """The run's figures, from what each trainer reported: its losses, iterations and time."""
    reports = {name: report for name, report in sorted(reports.items())}
    losses = {name: report["losses"] for name, report in reports.items()}
    first = sum(trainer_losses[0] for trainer_losses in losses.values()) / len(losses)
    last = sum(trainer_losses[-1] for trainer_losses in losses.values()) / len(losses)
    figures = {"example": "rnn_model_parallel", "data": args.corpus or "synthetic",
               "ntoken": next(iter(reports.values()))["ntoken"], "trainers": len(losses),
               "losses": losses, "first_loss": first, "last_loss": last,
               "last_perplexity": math.exp(last),
               "iterations": sum(report["iterations"] for report in reports.values()),
               "train_seconds": max(report["train_seconds"] for report in reports.values())}
    line = (f"loss {first:.4f} -> {last:.4f}, perplexity {math.exp(first):.2f} -> "
            f"{math.exp(last):.2f} over {len(losses)} trainer(s)")
    return figures, line


# --------- The tutorial's __main__ --------------------

def parse_args(argv=None):
    """The command line (the tutorial has none: its world size, address and port as flags),
    with this example's and this project's flags, checked: bad input ends the command here in
    one line, status 2."""
    # rpc_harness.ArgumentParser: argparse's, with every default in --help and errors in one
    # line (status 2). rpc_harness.int_at_least(N), port_number, probability and
    # positive_float: argument types that refuse what a plain int or float would let through.
    parser = rpc_harness.ArgumentParser(description=(
        "Distributed RNN: ps (rank 0) holds the embedding table and the decoder, each trainer "
        f"an LSTM (and a model of its own). Without --corpus, a synthetic task of "
        f"{SYNTHETIC_NTOKEN} tokens; with it, a word-level language model of a text file."))
    parser.add_argument(
        "--world_size", "--world-size",
        type=rpc_harness.int_at_least(2),
        default=2,
        metavar="N",
        help="total number of processes: ps (rank 0) and the trainers")
    parser.add_argument(
        "--rank",
        type=rpc_harness.int_at_least(0),
        default=None,
        metavar="R",
        help="rank of this process: 0 for ps. Without it, every rank starts here (or "
             "torchrun's RANK)")
    parser.add_argument(
        "--master_addr", "--master-addr",
        default=os.environ.get("MASTER_ADDR", "localhost"),
        metavar="ADDR",
        help="address of ps (rank 0), or $MASTER_ADDR; other than localhost, on a trusted "
             "network only")
    parser.add_argument(
        "--master_port", "--master-port",
        type=rpc_harness.port_number,
        default=os.environ.get("MASTER_PORT", "29500"),
        metavar="PORT",
        help="port where the ranks meet, on ps's address, or $MASTER_PORT")
    # Not in the tutorial: this example's data, length and model sizes (the tutorial's sizes by
    # default); then the flags that every example of this project has (timeouts, --seed,
    # --summary_json, --profile).
    at_least = rpc_harness.int_at_least
    parser.add_argument("--corpus", default=None, metavar="PATH",
                        help="a plain-text file (UTF-8; vocabulary from the file, <eos> at line "
                             "ends); sizes that work: --emsize 64 --nhid 64 --bptt 35 "
                             "--batch_size 20 --epochs 5")
    parser.add_argument("--epochs", type=at_least(1), default=10, metavar="N",
                        help="passes over the data")
    parser.add_argument("--max_batches", "--max-batches", type=at_least(1), default=None,
                        metavar="N", help="end each epoch after this many batches (for short runs)")
    parser.add_argument("--bptt", type=at_least(1), default=5, metavar="N",
                        help="time steps per batch")
    parser.add_argument("--batch_size", "--batch-size", type=at_least(1), default=3,
                        metavar="N", help="sequences")
    parser.add_argument("--emsize", type=at_least(1), default=2, metavar="N",
                        help="size of the embeddings")
    parser.add_argument("--nhid", type=at_least(1), default=3, metavar="N",
                        help="hidden units per LSTM layer")
    parser.add_argument("--nlayers", type=at_least(1), default=1, metavar="N",
                        help="LSTM layers")
    parser.add_argument("--dropout", type=rpc_harness.probability, default=0.0, metavar="P",
                        help="dropout of the embeddings, between LSTM layers and before the "
                             "decoder")
    parser.add_argument("--lr", type=rpc_harness.positive_float, default=1.0, metavar="RATE",
                        help="SGD learning rate")
    # auto (shared memory): the tiny model's iterations are small messages, latency-bound.
    rpc_harness.add_arguments(parser, rpc_transport="auto")
    args = parser.parse_args(argv)
    # rpc_harness.check_args: the world, the rank, the address and port, --profile's folder;
    # torchrun's RANK and WORLD_SIZE stand for --rank and --world_size; and args.harness
    # records what rpc_harness needs in every rank (README: "What the harness changes").
    rpc_harness.check_args(parser, args, worker_name, computes=computes_nothing, loops=trains,
                           summary=write_summary, per_rank=["corpus"])
    # The corpus: only the trainers read it (ps needs no data).
    if args.corpus is not None and args.rank != 0:
        problem = check_corpus(args.corpus, args.batch_size)
        if problem:
            parser.error(problem)
    return args


if __name__ == "__main__":
    args = parse_args()
    # Not in the tutorial: when a rank fails or is killed, or on Ctrl-C or SIGTERM, this
    # command stops the ranks it started and says why in one line.
    rpc_harness.supervise(args)
    # spawn, mp.spawn's start method: the rank that --rank names runs as it would under
    # mp.spawn, in a fresh interpreter, not in a fork of this one (unsafe once torch has
    # started threads)
    mp.set_start_method("spawn")

    processes = []
    world_size = args.world_size
    if args.rank is None:
        mp.spawn(run_worker, args=(world_size, args), nprocs=world_size, join=True)
    else:
        # Not in this tutorial: the one rank that --rank (or torchrun) names, in a process of
        # its own, as the parameter-server tutorial starts its ranks.
        p = mp.Process(target=run_worker, args=(args.rank, world_size, args))
        p.start()
        processes.append(p)

        for p in processes:
            p.join()
        # Not in the tutorial: the rank's exit status is the command's; rpc_harness.exit_status
        # says, in one line, when a signal killed the rank (which then could not say it).
        sys.exit(rpc_harness.exit_status(p))
