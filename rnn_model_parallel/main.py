"""Getting Started with Distributed RPC Framework, the distributed RNN part: the tutorial's
code, runnable.

Rank 0 (`ps`) holds the embedding table and the decoder of rnn.RNNModel; the trainer holds the
LSTM and trains all three through RPC, distributed autograd and DistributedOptimizer. README.md
says what differs from the tutorial and why; launch.py starts the ranks and bounds every wait;
data.py holds the data.

    python main.py                                  # every rank on this machine
    python main.py --rank 1                         # one rank per terminal
"""

import math
import time

import torch
import torch.distributed.autograd as dist_autograd
from torch import optim
from torch.distributed.optim import DistributedOptimizer

import launch
import rnn
from data import SYNTHETIC_NTOKEN, batchify, load_corpus, next_token_windows, training_data


def _run_trainer(name, args):
    ntoken, tokens, about = training_data(args)
    print(about)
    # The tutorial's (batch, nindices) = (5, 3) is 5 time steps of 3 sequences for nn.LSTM:
    # --bptt and --batch_size here, word_language_model's names.
    source = batchify(tokens, args.batch_size)
    ninp, nhid, nindices, nlayers = args.emsize, args.nhid, args.batch_size, args.nlayers
    hidden = (
        torch.randn(nlayers, nindices, nhid),
        torch.randn(nlayers, nindices, nhid)
    )

    model = rnn.RNNModel('ps', ntoken, ninp, nhid, nlayers, args.dropout)
    print(f"Embedding table on ps ({model.table_device}), LSTM local, decoder on ps")

    # setup distributed optimizer
    opt = DistributedOptimizer(
        optim.SGD,
        model.parameter_rrefs(),
        lr=args.lr,
    )

    criterion = torch.nn.CrossEntropyLoss()

    def get_next_batch():
        # windows of --bptt steps, in order; the target is the next token at every position
        yield from next_token_windows(source, args.bptt, args.max_batches)

    losses, iterations, started = [], 0, time.perf_counter()
    for epoch in range(args.epochs):
        loss_sum, targets = 0.0, 0
        for data, target in get_next_batch():
            # create distributed autograd context
            with dist_autograd.context() as context_id:
                hidden[0].detach_()
                hidden[1].detach_()
                output, hidden = model(data, hidden)
                loss = criterion(output.view(-1, ntoken), target.view(-1))
                # run distributed backward pass
                dist_autograd.backward(context_id, [loss])
                # run distributed optimizer
                opt.step(context_id)
                # no zero_grad: each iteration's context holds its own gradients
            loss_sum, targets = loss_sum + loss.item() * target.numel(), targets + target.numel()
            iterations += 1
        print("Training epoch {}".format(epoch))
        losses.append(loss_sum / targets)
        print(f"{name}: epoch {epoch} loss {losses[-1]:.4f} perplexity {math.exp(losses[-1]):.2f}")
    return {"losses": losses, "iterations": iterations, "ntoken": ntoken,
            "train_seconds": time.perf_counter() - started}


def run_worker(rank, world_size, args):
    if rank != 0:
        torch.manual_seed(args.seed + rank)
        launch.init_rpc_with_timeout(worker_name(rank, world_size), rank=rank,
                                     world_size=world_size)
        report = _run_trainer(worker_name(rank, world_size), args)
    else:
        torch.manual_seed(args.seed)  # the weights and the dropout of the parts on ps
        launch.init_rpc_with_timeout("ps", rank=rank, world_size=world_size)
        # parameter server does nothing
        report = None

    # block until all rpcs finish
    reports = launch.finish_and_shutdown(report)
    if rank == 0:
        write_summary(args, reports)


def worker_name(rank, world_size):
    """`ps` and `trainer` as in the tutorial; with several trainers, trainer1, trainer2, ..."""
    if rank == 0:
        return "ps"
    return "trainer" if world_size == 2 else f"trainer{rank}"


def write_summary(args, reports):
    """The run's figures, from what each trainer reported when it finished."""
    trainers = {name: report for name, report in sorted(reports.items()) if report}
    first_loss = sum(r["losses"][0] for r in trainers.values()) / len(trainers)
    last_loss = sum(r["losses"][-1] for r in trainers.values()) / len(trainers)
    launch.write_summary(
        {"example": "rnn_model_parallel", "data": args.corpus or "synthetic",
         "ntoken": next(iter(trainers.values()))["ntoken"], "world_size": args.world_size,
         "trainers": len(trainers), "epochs": args.epochs,
         "first_loss": first_loss, "last_loss": last_loss,
         "first_perplexity": math.exp(first_loss), "last_perplexity": math.exp(last_loss),
         "iterations": sum(r["iterations"] for r in trainers.values()),
         "per_trainer": {name: {"losses": r["losses"], "iterations": r["iterations"]}
                         for name, r in trainers.items()},
         "train_seconds": round(max(r["train_seconds"] for r in trainers.values()), 3)},
        f"loss {first_loss:.4f} -> {last_loss:.4f}, perplexity {math.exp(first_loss):.2f} -> "
        f"{math.exp(last_loss):.2f} over {len(trainers)} trainer(s)")


def parse_args(argv=None):
    parser = launch.ArgumentParser(
        description="Distributed RNN with model parallelism: rank 0 (ps) holds the embedding "
                    "table and the decoder, the trainer holds the LSTM and trains all three "
                    "through RPC, distributed autograd and DistributedOptimizer. With a world "
                    "size above 2, each extra trainer trains a model of its own against the same "
                    "ps (trainers then named trainer1, trainer2, ...). Without --corpus: a "
                    f"synthetic task of {SYNTHETIC_NTOKEN} tokens (sequences counting up, "
                    "restarting at random), on the tutorial's tiny model. With --corpus: a "
                    "word-level language model of a text file; sizes that work there: "
                    "--emsize 64 --nhid 64 --bptt 35 --batch_size 20 --epochs 5.")
    # auto (shared memory): the tiny model's iterations are small messages, latency-bound.
    launch.add_launch_arguments(parser, world_size=2, min_world_size=2,
                                roles="ps (rank 0) and the trainers", rpc_transport="auto")
    add, at_least = parser.add_argument, launch.int_at_least
    add("--corpus", default=None, metavar="PATH",
        help="train a word-level language model on this plain-text file (UTF-8; vocabulary "
             "from the file, <eos> at line ends) instead of the synthetic task")
    add("--epochs", type=at_least(1), default=10, metavar="N", help="passes over the data")
    add("--max_batches", "--max-batches", type=at_least(1), default=None, metavar="N",
        help="end each epoch after this many batches (for short runs)")
    add("--bptt", type=at_least(1), default=5, metavar="N",
        help="time steps per batch (the tutorial's `batch`)")
    add("--batch_size", "--batch-size", type=at_least(1), default=3, metavar="N",
        help="sequences per batch (the tutorial's `nindices`)")
    add("--emsize", type=at_least(1), default=2, metavar="N",
        help="size of the word embeddings (the tutorial's `ninp`)")
    add("--nhid", type=at_least(1), default=3, metavar="N", help="hidden units per LSTM layer")
    add("--nlayers", type=at_least(1), default=1, metavar="N",
        help="LSTM layers (the tutorial has 4, which SGD cannot train at this size)")
    add("--dropout", type=launch.probability, default=0.0, metavar="P",
        help="dropout of the embeddings, between LSTM layers and before the decoder (the "
             "tutorial has 0.5, which leaves too little of 2 or 3 units to learn from)")
    add("--lr", type=launch.positive_float, default=1.0, metavar="RATE",
        help="SGD learning rate (the tutorial's 0.05 moves this model too slowly to see)")
    args = launch.parse_args(parser, argv, min_world_size=2)
    if args.corpus is not None and args.rank != 0:  # ps needs no data
        try:
            _, tokens = load_corpus(args.corpus)
        except ValueError as err:
            parser.error(str(err))
        if len(tokens) < 2 * args.batch_size:
            parser.error(f"--corpus {args.corpus}: {len(tokens)} words (counting <eos>) are too "
                         f"few for --batch_size {args.batch_size}; need at least "
                         f"{2 * args.batch_size}")
    return args


def main(argv=None):
    args = parse_args(argv)
    launch.start(args, run_worker, worker_name)


if __name__ == "__main__":
    main()
