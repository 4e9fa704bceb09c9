"""Implementing a Parameter Server Using Distributed RPC Framework: the tutorial's code, runnable.

Rank 0 is the parameter server, which holds the model; ranks 1.. are trainers, which reach it
through RPC, distributed autograd and DistributedOptimizer. README.md says what differs from the
tutorial and why; data.py holds the data; batch.py runs the batch-updating parameter server of
the batch RPC tutorial. rpc_harness, this project's package, bounds every wait and ends every
rank in one line when one fails; each of its names is explained where main.py first uses it.

    python main.py --dataset synthetic                      # every rank on this machine
    python main.py --world_size=2 --rank=1                  # one rank per terminal
"""

import os
import sys
import time
from pathlib import Path
from threading import Lock

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch import optim
from torch.distributed.optim import DistributedOptimizer

try:
    import rpc_harness
except ModuleNotFoundError:
    raise SystemExit("rpc_harness, this project's package, is missing: install it with "
                     "`pip install -e PATH`, PATH being the repository's folder (the one that "
                     "holds pyproject.toml), or run `make run` there") from None

from data import DATA_DIR, SYNTHETIC_TEST_SIZE, SYNTHETIC_TRAIN_SIZE, check_mnist, get_data_loaders

# --------- MNIST Training Network to train, from pytorch/examples -----

class Net(nn.Module):
    def __init__(self, num_gpus=0):
        super().__init__()
        print(f"Using {num_gpus} GPUs to train")
        self.num_gpus = num_gpus
        device, rest_device = choose_devices(num_gpus, torch.cuda.device_count())
        print(f"Putting first 2 convs on {str(device)}")
        # the convolutions on the first GPU, or the CPU
        self.conv1 = nn.Conv2d(1, 32, 3, 1).to(device)
        self.conv2 = nn.Conv2d(32, 64, 3, 1).to(device)
        # the rest on the second GPU if two are asked for
        device = rest_device

        print(f"Putting rest of layers on {str(device)}")
        self.dropout1 = nn.Dropout2d(0.25).to(device)
        self.dropout2 = nn.Dropout(0.5).to(device)  # Dropout2d: deprecated for 2-D input
        self.fc1 = nn.Linear(9216, 128).to(device)
        self.fc2 = nn.Linear(128, 10).to(device)

    def forward(self, x):
        x = self.conv1(x)
        x = F.relu(x)
        x = self.conv2(x)
        x = F.max_pool2d(x, 2)

        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        # to the device of the layers that follow, if it is another
        next_device = next(self.fc1.parameters()).device
        x = x.to(next_device)

        x = self.fc1(x)
        x = F.relu(x)
        x = self.dropout2(x)
        x = self.fc2(x)
        output = F.log_softmax(x, dim=1)
        return output


# --------- Helper Methods --------------------

# Runs on the owner of rref: calls the method on the object that rref holds, with the
# other arguments.
def call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


# Calls the method on the object that rref holds, on the worker that owns it, and returns
# the result: remote_method(Foo.bar, rref, arg) runs <that Foo>.bar(arg) there.
def remote_method(method, rref, *args, **kwargs):
    args = [method, rref] + list(args)
    return rpc.rpc_sync(rref.owner(), call_method, args=args, kwargs=kwargs)


# --------- Parameter Server --------------------
class ParameterServer(nn.Module):
    def __init__(self, num_gpus=0):
        super().__init__()
        model = Net(num_gpus=num_gpus)
        self.model = model
        self.input_device = choose_devices(num_gpus, torch.cuda.device_count())[0]
        self.forward_lock = Lock()

    def forward(self, inp, training=True):
        inp = inp.to(self.input_device)
        # tutorial: out = self.model(inp)
        # Each call runs on a clone of the weights (clone() keeps the autograd link, so the
        # gradients still reach the parameters): another trainer's optimizer step must not
        # change in place what this call's backward pass needs (pytorch/examples#877). The lock
        # keeps functional_call's swap of weights, and the dropout switch, to one call.
        with self.forward_lock, torch.set_grad_enabled(training):
            self.model.train(training)
            weights = {name: param.clone() for name, param in self.model.named_parameters()}
            out = torch.func.functional_call(self.model, weights, (inp,))
        # RPC (without device maps) carries CPU tensors: the output goes back from the CPU.
        out = out.to("cpu")
        return out

    # The gradients that distributed autograd gathered here in context cid: a check.
    def get_dist_gradients(self, cid):
        grads = dist_autograd.get_gradients(cid)
        # Only their norms go back: the check needs to know that they exist, not the whole model.
        return [grad.norm().item() for grad in grads.values()]

    # An RRef to each parameter, for the trainers' DistributedOptimizer.
    def get_param_rrefs(self):
        param_rrefs = [rpc.RRef(param) for param in self.model.parameters()]
        return param_rrefs


# This process's one parameter server, and the lock that keeps it to one.
param_server = None
global_lock = Lock()


def get_parameter_server(num_gpus=0):
    """The one ParameterServer of this process, built on the first call."""
    global param_server
    with global_lock:
        if not param_server:
            param_server = ParameterServer(num_gpus=num_gpus)
        return param_server


def run_parameter_server(rank, world_size, args):
    # The parameter server just acts as a host for the model and responds to
    # requests from trainers. It builds the model now, from its own --num_gpus.
    torch.manual_seed(args.seed)
    get_parameter_server(num_gpus=args.num_gpus)
    # rpc.shutdown() will wait for all workers to complete by default, which
    # in this case means that the parameter server will wait for all trainers
    # to complete, and then exit.
    print("PS master initializing RPC")
    # rpc_harness.options(args): TensorPipe's options, meeting through rpc_harness, which joins the
    # ranks where MASTER_ADDR and MASTER_PORT say (as the default env:// would), with bounded waits.
    # The join installs in this rank the harness's loop (Ctrl-C, SIGTERM, the watch over the other
    # ranks, which ends every rank in one line when one is lost or fails), its share of the cores
    # and whole lines (README.md: "What the harness changes").
    rpc.init_rpc(name="parameter_server", rank=rank, world_size=world_size,
                 rpc_backend_options=rpc_harness.options(args))
    print("RPC initialized! Running parameter server...")
    rpc.shutdown()
    print("RPC shutdown on parameter server.")


# --------- Trainers --------------------

# The network as a trainer sees it: its forward() runs the model on the parameter server.
class TrainerNet(nn.Module):
    def __init__(self, num_gpus=0):
        super().__init__()
        self.num_gpus = num_gpus
        self.param_server_rref = rpc.remote(
            "parameter_server", get_parameter_server, args=(num_gpus,))

    def get_global_param_rrefs(self):
        remote_params = remote_method(
            ParameterServer.get_param_rrefs,
            self.param_server_rref)
        return remote_params

    def forward(self, x):
        # self.training goes along, so that model.eval() here turns dropout off on the server.
        model_output = remote_method(
            ParameterServer.forward, self.param_server_rref, x, self.training)
        return model_output


def run_training_loop(rank, num_gpus, train_loader, test_loader, args):
    # Runs the typical neural network forward + backward + optimizer step, but
    # in a distributed fashion.
    net = TrainerNet(num_gpus=num_gpus)
    # Build DistributedOptimizer.
    param_rrefs = net.get_global_param_rrefs()
    opt = DistributedOptimizer(optim.SGD, param_rrefs, lr=args.lr)
    started = time.perf_counter()
    for _ in range(args.epochs):
        for i, (data, target) in enumerate(train_loader):
            if i == args.max_batches:
                break
            # Not in the tutorial: a step of --profile's window (nothing without --profile).
            rpc_harness.profile_step()
            with dist_autograd.context() as cid:
                model_output = net(data)
                target = target.to(model_output.device)
                loss = F.nll_loss(model_output, target)
                if i % args.log_interval == 0:
                    print(f"Rank {rank} training batch {i} loss {loss.item()}")
                dist_autograd.backward(cid, [loss])
                # Check that distributed autograd left gradients on the server (on
                # logged batches only: a check, not part of training).
                if i % args.log_interval == 0:
                    assert remote_method(
                        ParameterServer.get_dist_gradients,
                        net.param_server_rref,
                        cid) != []
                opt.step(cid)
    report_training(train_loader, time.perf_counter() - started, args)  # not in the tutorial

    print("Training complete!")
    print("Getting accuracy....")
    get_accuracy(test_loader, net)


def get_accuracy(test_loader, model):
    model.eval()
    correct_sum = 0
    # The remote model's output always comes back on the CPU: compare it there.
    with torch.no_grad():
        for data, target in test_loader:
            out = model(data)
            pred = out.argmax(dim=1, keepdim=True)
            correct = pred.eq(target.view_as(pred)).sum().item()
            correct_sum += correct

    print(f"Accuracy {correct_sum / len(test_loader.dataset)}")
    # Not in the tutorial: the accuracy for the run's summary, which rank 0 writes at the end
    # (actors.py takes it from the return value).
    rpc_harness.report(accuracy=correct_sum / len(test_loader.dataset))
    return correct_sum / len(test_loader.dataset)


# Main loop for trainers.
def run_worker(rank, world_size, num_gpus, train_loader, test_loader, args):
    print(f"Worker rank {rank} initializing RPC")
    rpc.init_rpc(
        name=f"trainer_{rank}",
        rank=rank,
        world_size=world_size,
        rpc_backend_options=rpc_harness.options(args))

    print(f"Worker {rank} done initializing RPC")

    run_training_loop(rank, num_gpus, train_loader, test_loader, args)
    rpc.shutdown()


# This rank's part of the tutorial's __main__, in the process that mp.spawn (every rank here,
# as the other RPC tutorials start theirs) or mp.Process (the rank that --rank names) starts.
@rpc_harness.watched  # not in the tutorial: one line when this rank ends early
def run(rank, world_size, args):
    if rank == 0:
        run_parameter_server(0, world_size, args)
    else:
        # Get data to train on
        train_loader, test_loader = get_data_loaders(rank, world_size, args)
        # start training worker on this node
        run_worker(rank, world_size, args.num_gpus, train_loader, test_loader, args)


# --------- Not in the tutorial: devices, names, the flags, the summary -------------

def choose_devices(num_gpus, gpu_count):
    """(device of the two convs, device of the other layers): the CPU; cuda:0 for all; or the
    convs on cuda:0 and the rest on cuda:1. gpu_count is a parameter so that tests can fake it."""
    if not 0 <= num_gpus <= 2:
        raise ValueError(f"--num_gpus must be 0, 1 or 2, got {num_gpus}")
    if num_gpus > gpu_count:
        raise ValueError(f"--num_gpus {num_gpus} asks for more GPUs than the parameter server's "
                         f"machine has ({gpu_count})")
    if num_gpus == 0:
        return torch.device("cpu"), torch.device("cpu")
    return torch.device("cuda:0"), torch.device(f"cuda:{num_gpus - 1}")


def worker_name(rank, world_size):
    """Each rank's name in RPC, which the harness's messages use too."""
    return "parameter_server" if rank == 0 else f"trainer_{rank}"


def runs_the_model(rank, world_size):
    """The rank that computes (the model runs on the parameter server), which gets the cores."""
    return rank == 0


def trains(rank, world_size):
    """The ranks that loop over batches, whose steps --profile records."""
    return rank != 0


def add_training_arguments(parser, lr_help):
    """This example's flags for its data, its length and its learning rate (batch.py's too)."""
    at_least = rpc_harness.int_at_least
    parser.add_argument("--dataset", choices=("mnist", "synthetic"), default="mnist",
                        help="MNIST (downloaded into --data_dir if missing), or generated digits "
                             f"({SYNTHETIC_TRAIN_SIZE} to train on, {SYNTHETIC_TEST_SIZE} to test)")
    parser.add_argument("--data_dir", "--data-dir", default=str(DATA_DIR), metavar="PATH",
                        help="folder holding MNIST/raw/")
    parser.add_argument("--epochs", type=at_least(1), default=1, metavar="N",
                        help="passes over the data")
    parser.add_argument("--max_batches", "--max-batches", type=at_least(1), default=None,
                        metavar="N",
                        help="end each trainer's epoch after this many batches (for short runs)")
    parser.add_argument("--batch_size", "--batch-size", type=at_least(1), default=32,
                        metavar="N", help="batch size")
    parser.add_argument("--lr", type=rpc_harness.positive_float, default=None, metavar="RATE",
                        help=lr_help)
    parser.add_argument("--log_interval", "--log-interval", type=at_least(1), default=5,
                        metavar="N", help="print the loss every this many batches")


def check_data(parser, args):
    """The data: MNIST must be there or downloadable (not needed by the parameter server);
    synthetic digits read no folder."""
    if args.dataset != "mnist" or args.rank == 0:
        return
    check_mnist_folder(parser, args.data_dir)


def check_mnist_folder(parser, data_dir):
    """MNIST in data_dir, or downloadable there: otherwise one line saying what is missing."""
    if not Path(data_dir).is_dir():
        parser.error(f"--data_dir {data_dir}: no such folder")
    problem = check_mnist(data_dir)
    if problem:
        parser.error(problem)


def check_devices(parser, args):
    """--num_gpus, where the model lives: on the parameter server."""
    if args.rank not in (None, 0):
        return
    try:
        choose_devices(args.num_gpus, torch.cuda.device_count())
    except ValueError as err:
        parser.error(str(err))


def report_training(train_loader, seconds, args):
    """A trainer's figures, for the summary that rank 0 writes at the end."""
    batches = args.epochs * min(len(train_loader), args.max_batches or len(train_loader))
    rpc_harness.report(batches=batches, train_seconds=round(seconds, 3))


def write_summary(args, reports, mode="tutorial", more=None, more_line=""):
    """The run's figures, from what each trainer reported; batch.py adds its own (`more`,
    `more_line`)."""
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


# --------- The tutorial's __main__ --------------------

def parse_args(argv=None, description="Parameter-Server RPC based training"):
    """The tutorial's command line, with this project's flags, checked (bad input ends the
    command here in one line, status 2). batch.py builds on make_parser()."""
    parser = make_parser(description)
    args = parser.parse_args(argv)
    check_args(parser, args, worker_name, computes=runs_the_model)
    if args.lr is None:
        args.lr = 0.03
    return args


def make_parser(description, lr_help="SGD learning rate (default: 0.03, the tutorial's)"):
    # rpc_harness.ArgumentParser: argparse's, with every default in --help and errors in one
    # line (status 2). rpc_harness.int_at_least(N), port_number and positive_float: argument
    # types that refuse what the tutorial's plain int would let through.
    parser = rpc_harness.ArgumentParser(
        description=description)
    parser.add_argument(
        "--world_size", "--world-size",
        type=rpc_harness.int_at_least(2),
        default=4,
        help="""Total number of participating processes. Should be the sum of
        master node and all training nodes.""")
    parser.add_argument(
        "--rank",
        type=rpc_harness.int_at_least(0),
        default=None,
        help="""Global rank of this process. Pass in 0 for master. Without it,
        every rank starts here (or torchrun's RANK).""")
    parser.add_argument(
        "--num_gpus", "--num-gpus",
        type=rpc_harness.int_at_least(0),
        default=0,
        help="""Number of GPUs to use for training, Currently supports between 0
         and 2 GPUs. Note that this argument will be passed to the parameter servers.""")
    parser.add_argument(
        "--master_addr", "--master-addr",
        type=str,
        default=os.environ.get("MASTER_ADDR", "localhost"),
        help="""Address of master, will default to localhost (or $MASTER_ADDR) if not
        provided. Master must be able to accept network traffic on the address + port.""")
    parser.add_argument(
        "--master_port", "--master-port",
        type=rpc_harness.port_number,
        default=os.environ.get("MASTER_PORT", "29500"),
        help="""Port that master is listening on, will default to 29500 (or
        $MASTER_PORT) if not provided. Master must be able to accept network traffic on
        the host and port.""")
    # Not in the tutorial: this example's data, length and learning rate; then the flags that
    # every example of this project has (timeouts, --seed, --summary_json, --profile).
    add_training_arguments(parser, lr_help)
    # tcp: the server's convolutions need every core, and its messages are few and large, so
    # the shared-memory transport's polling threads cost more than they save (bench/).
    rpc_harness.add_arguments(parser, rpc_transport="tcp")
    return parser


def check_args(parser, args, names, computes, summary=None):
    """Not in the tutorial: what argparse cannot check. rpc_harness.check_args: the world, the
    rank, the address and port, --profile's folder; torchrun's RANK and WORLD_SIZE stand for
    --rank and --world_size; and args.harness records what rpc_harness needs in every rank
    (README: "What the harness changes"). Then this example's devices and data."""
    rpc_harness.check_args(parser, args, names, computes=computes, loops=trains,
                           summary=summary or write_summary, per_rank=["data_dir"])
    check_devices(parser, args)
    check_data(parser, args)


if __name__ == '__main__':
    args = parse_args()
    os.environ['MASTER_ADDR'] = args.master_addr
    os.environ["MASTER_PORT"] = str(args.master_port)
    # Not in the tutorial: when a rank fails or is killed, or on Ctrl-C or SIGTERM, this
    # command stops the ranks it started and says why in one line.
    rpc_harness.supervise(args)
    # spawn, not Linux's default fork, which can deadlock the DataLoader
    mp.set_start_method("spawn")

    processes = []
    world_size = args.world_size
    if args.rank is None:
        # Not in this tutorial: every rank on this machine, as the other RPC tutorials start
        # theirs.
        mp.spawn(run, args=(world_size, args), nprocs=world_size, join=True)
    else:
        # The tutorial starts run_parameter_server, or makes the trainer's data here and starts
        # run_worker; run() does either in the rank's own process, as under mp.spawn.
        p = mp.Process(target=run, args=(args.rank, world_size, args))
        p.start()
        processes.append(p)

        for p in processes:
            p.join()
        # Not in the tutorial: the rank's exit status is the command's; rpc_harness.exit_status
        # says, in one line, when a signal killed the rank (which then could not say it).
        sys.exit(rpc_harness.exit_status(p))
