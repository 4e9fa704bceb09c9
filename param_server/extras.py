"""What param_server's programs add beside the tutorial: this project's flags and the checks
that argparse cannot make, the ranks' names, and the run's summary. main.py, batch.py and
actors.py import it, so that each shows its tutorial's code."""

from pathlib import Path

import torch

import rpc_harness  # this project's package: `make run` installs it (or `pip install -e .`)

from data import DATA_DIR, SYNTHETIC_TEST_SIZE, SYNTHETIC_TRAIN_SIZE, check_mnist


def add_arguments(parser):
    """main.py's and batch.py's flags: this example's data and length (add_data_arguments),
    then those of every RPC program (rpc_harness.add_arguments): timeouts, the transport,
    --seed, --summary_json, --profile. tcp: the server's convolutions need every core, and its
    messages are few and large, so the shared-memory transport's polling threads cost more than
    they save (bench/)."""
    add_data_arguments(parser)
    rpc_harness.add_arguments(parser, rpc_transport="tcp")


def add_data_arguments(parser):
    """The data and the length of a run, in every program of this example."""
    at_least = rpc_harness.int_at_least
    parser.add_argument("--dataset", choices=("mnist", "synthetic"), default="mnist",
                        help="MNIST (downloaded into --data_dir if missing), or generated digits "
                             f"({SYNTHETIC_TRAIN_SIZE} to train on, {SYNTHETIC_TEST_SIZE} to test)")
    parser.add_argument("--data_dir", default=str(DATA_DIR), metavar="PATH",
                        help="folder holding MNIST/raw/")
    parser.add_argument("--epochs", type=at_least(1), default=1, metavar="N",
                        help="passes over the data")
    parser.add_argument("--max_batches", type=at_least(1), default=None, metavar="N",
                        help="end each trainer's epoch after this many batches (for short runs)")
    parser.add_argument("--batch_size", type=at_least(1), default=32, metavar="N",
                        help="batch size")
    parser.add_argument("--log_interval", type=at_least(1), default=5, metavar="N",
                        help="print the loss every this many batches (the tutorial's: 5)")


def add_step_arguments(parser):
    """batch.py's and actors.py's learning rate (main.py keeps the tutorial's, 0.03)."""
    parser.add_argument("--lr", type=rpc_harness.positive_float, default=None, metavar="RATE",
                        help="SGD learning rate (default: 0.03 times the number of gradients "
                             "that each step averages)")


def worker_name(rank, world_size):
    """Each rank's name in RPC (main.py's), which the harness's lines use too."""
    return "parameter_server" if rank == 0 else f"trainer_{rank}"


def runs_the_model(rank, world_size):
    """main.py's rank that computes (the model runs on the parameter server): it gets the
    cores."""
    return rank == 0


def trains(rank, world_size):
    """The ranks that loop over batches, whose steps --profile records."""
    return rank != 0


def check_args(parser, args, names=worker_name, computes=runs_the_model, summary=None,
               min_world_size=2):
    """What argparse cannot check (bad input: one line, status 2): the tutorial's flags and this
    project's (rpc_harness.check_args, which also records what the harness needs in every rank),
    the GPUs where the model lives, and the data."""
    rpc_harness.check_args(parser, args, names, computes=computes, loops=trains,
                           summary=summary or write_summary, per_rank=["data_dir"],
                           min_world_size=min_world_size)
    if args.rank in (None, 0):
        check_gpus(parser, args.num_gpus, torch.cuda.device_count())
    if args.dataset == "mnist" and args.rank != 0:
        check_mnist_folder(parser, args.data_dir)


def check_gpus(parser, num_gpus, gpu_count):
    """--num_gpus: 0, 1 or 2 (the tutorial's `assert num_gpus <= 3` let 3 through), and no more
    than the parameter server's machine has. gpu_count is a parameter, so that tests can fake
    it."""
    if not 0 <= num_gpus <= 2:
        parser.error(f"--num_gpus must be 0, 1 or 2, got {num_gpus}")
    if num_gpus > gpu_count:
        parser.error(f"--num_gpus {num_gpus} asks for more GPUs than the parameter server's "
                     f"machine has ({gpu_count})")


def check_mnist_folder(parser, data_dir):
    """MNIST in data_dir, or downloadable there: otherwise one line saying what is wrong."""
    if not Path(data_dir).is_dir():
        parser.error(f"--data_dir {data_dir}: no such folder")
    problem = check_mnist(data_dir)
    if problem:
        parser.error(problem)


def report_training(train_loader, seconds):
    """A trainer's figures, for the summary that rank 0 writes at the end."""
    rpc_harness.report(batches=len(train_loader), train_seconds=round(seconds, 3))


def write_summary(args, reports, mode="tutorial", more=None, more_line=""):
    """The run's figures, from what each trainer reported; batch.py and actors.py add their own
    (`more`, `more_line`)."""
    trainers = {name: report for name, report in sorted(reports.items()) if "accuracy" in report}
    accuracy = sum(r["accuracy"] for r in trainers.values()) / len(trainers)
    samples = sum(r["batches"] for r in trainers.values()) * args.batch_size
    seconds = max(r["train_seconds"] for r in trainers.values())
    figures = {"example": "param_server", "mode": mode, "dataset": args.dataset,
               "world_size": args.world_size, "trainers": len(trainers), "epochs": args.epochs,
               "accuracy": accuracy, "samples": samples,
               "samples_per_second": round(samples / seconds, 1), "train_seconds": seconds,
               "accuracy_per_trainer": {name: r["accuracy"] for name, r in trainers.items()},
               "batches_per_trainer": {name: r["batches"] for name, r in trainers.items()},
               **(more or {})}
    line = (f"accuracy {accuracy:.4f} over {len(trainers)} trainer(s), "
            f"{samples / seconds:.1f} samples/s in training{more_line}")
    return figures, line
