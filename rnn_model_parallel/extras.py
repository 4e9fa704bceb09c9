"""What rnn_model_parallel's main.py adds beside the tutorial: the command line (the tutorial
has none), the ranks' names, the trainer's data, each epoch's loss, and the run's summary.
main.py imports it, so that it shows its tutorial's code."""

import math
import time

import torch.distributed.rpc as rpc

import rpc_harness  # this project's package: `make run` installs it (or `pip install -e .`)

import data
from data import SYNTHETIC_NTOKEN, check_corpus


def training_data(args):
    """(ntoken, source) for the trainer: this run's tokens (data.training_data: the synthetic
    task, or --corpus), said in one line, and cut into --batch_size sequences, one a column
    (data.batchify)."""
    ntoken, tokens, about = data.training_data(args)
    print(about)
    return ntoken, data.batchify(tokens, args.batch_size)


class Progress:
    """A trainer's loss, epoch by epoch (its mean per target token, printed after the
    tutorial's "Training epoch N"), and its figures for the summary. It starts by saying where
    the parts of `model`, the trainer's RNNModel, are."""

    def __init__(self, ntoken, model):
        print(f"Embedding table on ps ({model.table_device}), LSTM local, decoder on ps")
        self.name = rpc.get_worker_info().name
        self.ntoken = ntoken
        self.losses = []
        self.iterations = 0
        self.loss_sum = 0.0
        self.targets = 0
        self.started = time.perf_counter()

    def add(self, loss, target):
        """One iteration's loss, over its target tokens."""
        self.loss_sum += loss.item() * target.numel()
        self.targets += target.numel()
        self.iterations += 1

    def end_epoch(self, epoch):
        """The epoch's mean loss, and its perplexity, printed; then the figures so far for the
        run's summary (report: the last epoch's stand)."""
        self.losses.append(self.loss_sum / self.targets)
        self.loss_sum = 0.0
        self.targets = 0
        loss = self.losses[-1]
        print(f"{self.name}: epoch {epoch} loss {loss:.4f} perplexity {math.exp(loss):.2f}")
        self.report()

    def report(self):
        """The figures for the run's summary, which rank 0 writes at the end."""
        rpc_harness.report(losses=self.losses, iterations=self.iterations, ntoken=self.ntoken,
                           train_seconds=round(time.perf_counter() - self.started, 3))


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


def parse_args(argv=None):
    """The command line (the tutorial has none: its world size, address and port as flags),
    with this example's and this project's flags, checked: bad input ends the command here in
    one line, status 2."""
    # rpc_harness.ArgumentParser: argparse's, with every default in --help and errors in one
    # line (status 2); int_at_least(N), port_number, probability and positive_float: argument
    # types that refuse what a plain int or float would let through.
    parser = rpc_harness.ArgumentParser(description=(
        "Distributed RNN: ps (rank 0) holds the embedding table and the decoder, each trainer "
        f"an LSTM (and a model of its own). Without --corpus, a synthetic task of "
        f"{SYNTHETIC_NTOKEN} tokens; with it, a word-level language model of a text file."))
    parser.add_argument(
        "--world_size",
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
        "--master_addr",
        default="localhost",
        metavar="ADDR",
        help="address of ps (rank 0); other than localhost, on a trusted network only")
    parser.add_argument(
        "--master_port",
        type=rpc_harness.port_number,
        default=29500,
        metavar="PORT",
        help="port where the ranks meet, on ps's address")
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
    parser.add_argument("--max_batches", type=at_least(1), default=None,
                        metavar="N", help="end each epoch after this many batches (for short runs)")
    parser.add_argument("--bptt", type=at_least(1), default=5, metavar="N",
                        help="time steps per batch")
    parser.add_argument("--batch_size", type=at_least(1), default=3,
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
    # records what rpc_harness needs in every rank (docs/harness.md).
    rpc_harness.check_args(parser, args, worker_name, computes=computes_nothing, loops=trains,
                           summary=write_summary, per_rank=["corpus"])
    # The corpus: only the trainers read it (ps needs no data).
    if args.corpus is not None and args.rank != 0:
        problem = check_corpus(args.corpus, args.batch_size)
        if problem:
            parser.error(problem)
    return args
