"""Getting Started with Distributed RPC Framework, the distributed RNN, runnable: ps (rank 0)
holds the embedding table and decoder of rnn.RNNModel, the trainer its LSTM. README.md says what
differs from the tutorial; launch.py starts the ranks and bounds every wait; data.py: the data."""

import math
import time

import launch  # before torch: it sets what torch reads when it is imported

# isort: split
import torch
import torch.distributed.autograd as dist_autograd
from torch import optim
from torch.distributed.optim import DistributedOptimizer

import rnn
from data import SYNTHETIC_NTOKEN, batchify, check_corpus, next_token_windows, training_data


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

    losses, iterations, started = [], 0, time.perf_counter()
    for epoch in range(args.epochs):
        loss_sum, targets = 0.0, 0
        for data, target in get_next_batch():
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
            loss_sum, targets = loss_sum + loss.item() * target.numel(), targets + target.numel()
            iterations += 1
            launch.profile_step()  # not in the tutorial: --profile's window (launch.py)
        print("Training epoch {}".format(epoch))
        losses.append(loss_sum / targets)
        print(f"{name}: epoch {epoch} loss {losses[-1]:.4f} perplexity {math.exp(losses[-1]):.2f}")
    return {"losses": losses, "iterations": iterations, "ntoken": ntoken,
            "train_seconds": time.perf_counter() - started}


def run_worker(rank, world_size, args):
    if rank != 0:
        torch.manual_seed(args.seed + rank)
        # tutorial: rpc.init_rpc("trainer", rank=rank, world_size=world_size)
        launch.init_rpc_with_timeout(worker_name(rank, world_size), rank=rank,
                                     world_size=world_size)
        report = _run_trainer(worker_name(rank, world_size), args)
    else:
        torch.manual_seed(args.seed)  # the weights and the dropout of the parts on ps
        # tutorial: rpc.init_rpc("ps", rank=rank, world_size=world_size)
        launch.init_rpc_with_timeout("ps", rank=rank, world_size=world_size)
        # ps only hosts the parts the trainers create there, and answers their calls
        report = None

    # wait until every rank is done, then shut RPC down
    reports = launch.finish_and_shutdown(report)  # tutorial: rpc.shutdown()
    if rank == 0:
        write_summary(args, reports)


# --------- Not in the tutorial: names, the command line, the summary --------------------

def worker_name(rank, world_size):  # the tutorial's; with several trainers, trainer1, trainer2...
    return "ps" if rank == 0 else "trainer" if world_size == 2 else f"trainer{rank}"


def doing(rank, world_size):  # said once a rank has joined
    return "holding the table and the decoder" if rank == 0 else "training the LSTM here"


def write_summary(args, reports):  # from what each trainer reported when it finished
    reports = {name: report for name, report in sorted(reports.items()) if report}
    losses = {name: report["losses"] for name, report in reports.items()}
    first, last = (sum(ls[i] for ls in losses.values()) / len(losses) for i in (0, -1))
    launch.write_summary(
        {"example": "rnn_model_parallel", "data": args.corpus or "synthetic",
         "ntoken": next(iter(reports.values()))["ntoken"], "trainers": len(losses),
         "losses": losses, "first_loss": first, "last_loss": last,
         "last_perplexity": math.exp(last),
         "iterations": sum(report["iterations"] for report in reports.values()),
         "train_seconds": round(max(r["train_seconds"] for r in reports.values()), 3)},
        f"loss {first:.4f} -> {last:.4f}, perplexity {math.exp(first):.2f} -> "
        f"{math.exp(last):.2f} over {len(losses)} trainer(s)")


def parse_args(argv=None):
    parser = launch.ArgumentParser(description=(
        "Distributed RNN: ps (rank 0) holds the embedding table and the decoder, each trainer "
        f"an LSTM (and a model of its own). Without --corpus, a synthetic task of "
        f"{SYNTHETIC_NTOKEN} tokens; with it, a word-level language model of a text file."))
    # auto (shared memory): the tiny model's iterations are small messages, latency-bound.
    launch.add_launch_arguments(parser, world_size=2, min_world_size=2,
                                roles="ps (rank 0) and the trainers", rpc_transport="auto")
    add, at_least = parser.add_argument, launch.int_at_least
    add("--corpus", default=None, metavar="PATH",
        help="a plain-text file (UTF-8; vocabulary from the file, <eos> at line ends); sizes "
             "that work: --emsize 64 --nhid 64 --bptt 35 --batch_size 20 --epochs 5")
    add("--epochs", type=at_least(1), default=10, metavar="N", help="passes over the data")
    add("--max_batches", "--max-batches", type=at_least(1), default=None, metavar="N",
        help="end each epoch after this many batches (for short runs)")
    add("--bptt", type=at_least(1), default=5, metavar="N", help="time steps per batch")
    add("--batch_size", "--batch-size", type=at_least(1), default=3, metavar="N", help="sequences")
    add("--emsize", type=at_least(1), default=2, metavar="N", help="size of the embeddings")
    add("--nhid", type=at_least(1), default=3, metavar="N", help="hidden units per LSTM layer")
    add("--nlayers", type=at_least(1), default=1, metavar="N", help="LSTM layers")
    add("--dropout", type=launch.probability, default=0.0, metavar="P",
        help="dropout of the embeddings, between LSTM layers and before the decoder")
    add("--lr", type=launch.positive_float, default=1.0, metavar="RATE", help="SGD learning rate")
    args = launch.parse_args(parser, argv, min_world_size=2, per_rank=["corpus"])
    if args.corpus is not None and args.rank != 0:  # ps needs no data
        problem = check_corpus(args.corpus, args.batch_size)
        if problem:
            parser.error(problem)
    return args


def main(argv=None):
    args = parse_args(argv)
    # tutorial: mp.spawn(run_worker, args=(world_size, ), nprocs=world_size, join=True)
    # heavy: none, a model this small gains nothing from threads; steps: the trainers' loops
    launch.start(args, run_worker, worker_name, doing, heavy=lambda *_: False,
                 steps=lambda rank, _: rank != 0)


if __name__ == "__main__":
    main()
