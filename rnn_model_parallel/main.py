"""Getting Started with Distributed RPC Framework, the distributed RNN, runnable: ps (rank 0)
holds the embedding table and decoder of rnn.RNNModel, the trainer its LSTM. README.md says what
differs from the tutorial; rpc_harness starts the ranks and bounds every wait; data.py: the
data."""

import math
import time

try:
    import rpc_harness  # first: it sets what torch reads when it loads
except ModuleNotFoundError:
    raise SystemExit("rpc_harness is missing: run `make run` in the repository once, then use "
                     ".venv/bin/python (README.md)") from None

# isort: split
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
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
            rpc_harness.profile_step()  # not in the tutorial: --profile's window
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
        print("Training epoch {}".format(epoch))
        losses.append(loss_sum / targets)
        print(f"{name}: epoch {epoch} loss {losses[-1]:.4f} perplexity {math.exp(losses[-1]):.2f}")
    # not in the tutorial: the figures for the run's summary
    rpc_harness.report(losses=losses, iterations=iterations, ntoken=ntoken,
                       train_seconds=round(time.perf_counter() - started, 3))


def run_worker(rank, world_size, args):
    if rank != 0:
        torch.manual_seed(args.seed + rank)
        rpc.init_rpc(worker_name(rank, world_size), rank=rank, world_size=world_size,
                     rpc_backend_options=rpc_harness.options())
        _run_trainer(worker_name(rank, world_size), args)
    else:
        torch.manual_seed(args.seed)  # the weights and the dropout of the parts on ps
        rpc.init_rpc("ps", rank=rank, world_size=world_size,
                     rpc_backend_options=rpc_harness.options())
        # parameter server does nothing: it hosts the parts the trainers create there
        pass

    # block until all rpcs finish
    rpc.shutdown()


# --------- Not in the tutorial: names, the command line, the summary --------------------

def worker_name(rank, world_size):  # the tutorial's; with several trainers, trainer1, trainer2...
    return "ps" if rank == 0 else "trainer" if world_size == 2 else f"trainer{rank}"


def write_summary(args, reports):  # from what each trainer reported
    reports = {name: report for name, report in sorted(reports.items())}
    losses = {name: report["losses"] for name, report in reports.items()}
    first, last = (sum(ls[i] for ls in losses.values()) / len(losses) for i in (0, -1))
    return ({"example": "rnn_model_parallel", "data": args.corpus or "synthetic",
             "ntoken": next(iter(reports.values()))["ntoken"], "trainers": len(losses),
             "losses": losses, "first_loss": first, "last_loss": last,
             "last_perplexity": math.exp(last),
             "iterations": sum(report["iterations"] for report in reports.values()),
             "train_seconds": max(r["train_seconds"] for r in reports.values())},
            f"loss {first:.4f} -> {last:.4f}, perplexity {math.exp(first):.2f} -> "
            f"{math.exp(last):.2f} over {len(losses)} trainer(s)")


def parse_args(argv=None):
    parser = rpc_harness.ArgumentParser(description=(
        "Distributed RNN: ps (rank 0) holds the embedding table and the decoder, each trainer "
        f"an LSTM (and a model of its own). Without --corpus, a synthetic task of "
        f"{SYNTHETIC_NTOKEN} tokens; with it, a word-level language model of a text file."))
    # auto (shared memory): the tiny model's iterations are small messages, latency-bound.
    rpc_harness.add_arguments(parser, world_size=2, min_world_size=2,
                                roles="ps (rank 0) and the trainers", rpc_transport="auto")
    add, at_least = parser.add_argument, rpc_harness.int_at_least
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
    add("--dropout", type=rpc_harness.probability, default=0.0, metavar="P",
        help="dropout of the embeddings, between LSTM layers and before the decoder")
    add("--lr", type=rpc_harness.positive_float, default=1.0, metavar="RATE",
        help="SGD learning rate")
    # heavy: none, a model this small gains nothing from threads; loops: the trainers'
    args = rpc_harness.parse_args(parser, argv, worker_name, heavy=lambda *_: False,
                                  loops=lambda rank, _: rank != 0, summary=write_summary,
                                  per_rank=["corpus"])
    if args.corpus is not None and args.rank != 0:  # ps needs no data
        problem = check_corpus(args.corpus, args.batch_size)
        if problem:
            parser.error(problem)
    return args


def main(argv=None):
    args = parse_args(argv)
    # tutorial: mp.spawn(run_worker, args=(world_size, ), nprocs=world_size, join=True)
    rpc_harness.spawn(run_worker, args=(args.world_size, args), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
