"""Implementing a Parameter Server Using Distributed RPC Framework: the tutorial's code, runnable.

Rank 0 is the parameter server, which holds the model; ranks 1.. are trainers, which reach it
through RPC, distributed autograd and DistributedOptimizer. README.md says what differs from the
tutorial and why; rpc_harness starts the ranks and bounds every wait; data.py holds the data;
batch.py runs the batch-updating parameter server of the batch RPC tutorial.

    python main.py --dataset synthetic                      # every rank on this machine
    python main.py --world_size 2 --rank 1                  # one rank per terminal
"""

import time
from pathlib import Path
from threading import Lock

try:
    import rpc_harness  # first: it sets what torch reads when it loads
except ModuleNotFoundError:
    raise SystemExit("rpc_harness is missing: run `make run` in the repository once, then use "
                     ".venv/bin/python (README.md)") from None

# isort: split
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn as nn
import torch.nn.functional as F
from torch import optim
from torch.distributed.optim import DistributedOptimizer

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
    rpc.init_rpc(name="parameter_server", rank=rank, world_size=world_size,
                 rpc_backend_options=rpc_harness.options())
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
            rpc_harness.profile_step()  # not in the tutorial: --profile's window
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
    rpc_harness.report(accuracy=correct_sum / len(test_loader.dataset))  # not in the tutorial


# Main loop for trainers.
def run_worker(rank, world_size, num_gpus, train_loader, test_loader, args):
    print(f"Worker rank {rank} initializing RPC")
    rpc.init_rpc(
        name=f"trainer_{rank}",
        rank=rank,
        world_size=world_size,
        rpc_backend_options=rpc_harness.options())

    print(f"Worker {rank} done initializing RPC")

    run_training_loop(rank, num_gpus, train_loader, test_loader, args)
    rpc.shutdown()


# This rank's part of the tutorial's __main__, which starts it in a process of its own.
def run(rank, world_size, args):
    if rank == 0:
        run_parameter_server(0, world_size, args)
    else:
        # Get data to train on
        train_loader, test_loader = get_data_loaders(rank, world_size, args)
        # start training worker on this node
        run_worker(rank, world_size, args.num_gpus, train_loader, test_loader, args)


# --------- Not in the tutorial: devices, names, the summary, the command line -------------

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
    return "parameter_server" if rank == 0 else f"trainer_{rank}"


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
    return ({"example": "param_server", "mode": mode, "dataset": args.dataset,
             "world_size": args.world_size, "trainers": len(trainers), "epochs": args.epochs,
             "accuracy": accuracy, "samples": samples,
             "samples_per_second": round(samples / seconds, 1), "train_seconds": seconds,
             "accuracy_per_trainer": {name: r["accuracy"] for name, r in trainers.items()},
             "batches_per_trainer": {name: r["batches"] for name, r in trainers.items()},
             **(more or {})},
            f"accuracy {accuracy:.4f} over {len(trainers)} trainer(s), "
            f"{samples / seconds:.1f} samples/s in training{more_line}")


def parse_args(argv=None, description="Parameter-Server RPC based training: rank 0 holds the "
               "model, the other ranks train it through RPC.", roles=None):
    """The command line; batch.py's `roles` for its batch-updating server (and its own flag)."""
    batch = roles is not None
    parser = rpc_harness.ArgumentParser(description=description)
    # tcp: the server's convolutions need every core, and its messages are few and large, so
    # the shared-memory transport's polling threads cost more than they save (bench/).
    rpc_harness.add_arguments(parser, world_size=4, min_world_size=2,
                              roles="the parameter server (rank 0) and the trainers",
                              rpc_transport="tcp")
    add, at_least = parser.add_argument, rpc_harness.int_at_least
    add("--num_gpus", "--num-gpus", type=at_least(0), default=0, metavar="N",
        help="GPUs for the model, read by the parameter server (rank 0), where the model lives: "
             "0, 1 (cuda:0), or 2 (convs on cuda:0, the rest on cuda:1)")
    add("--dataset", choices=("mnist", "synthetic"), default="mnist",
        help="MNIST (downloaded into --data_dir if missing), or generated digits "
             f"({SYNTHETIC_TRAIN_SIZE} to train on, {SYNTHETIC_TEST_SIZE} to test)")
    add("--data_dir", "--data-dir", default=str(DATA_DIR), metavar="PATH",
        help="folder holding MNIST/raw/")
    add("--epochs", type=at_least(1), default=1, metavar="N", help="passes over the data")
    add("--max_batches", "--max-batches", type=at_least(1), default=None, metavar="N",
        help="end each trainer's epoch after this many batches (for short runs)")
    add("--batch_size", "--batch-size", type=at_least(1), default=32, metavar="N",
        help="batch size")
    add("--lr", type=rpc_harness.positive_float, default=None, metavar="RATE",
        help="SGD learning rate (default: 0.03, the tutorial's" + (
            "; here 0.03 times --batch_update_size, as each step averages that many gradients)"
            if batch else ")"))
    add("--log_interval", "--log-interval", type=at_least(1), default=5, metavar="N",
        help="print the loss every this many batches")
    if batch:
        add("--batch_update_size", "--batch-update-size", type=at_least(1), default=None,
            metavar="N", help="gradients in each step (default: the number of trainers)")
    # heavy (sharing the cores): the rank that runs the model; loops: the trainers'
    roles = roles or dict(names=worker_name, heavy=lambda rank, _: rank == 0,
                          loops=lambda rank, _: rank != 0, summary=write_summary)
    args = rpc_harness.parse_args(parser, argv, per_rank=["data_dir"], **roles)
    if (getattr(args, "batch_update_size", None) or 0) > args.world_size - 1:
        parser.error(f"--batch_update_size {args.batch_update_size} is more than the "
                     f"{args.world_size - 1} trainer(s) of a world of {args.world_size}")
    if args.lr is None:  # a batch step takes the place of batch_update_size steps
        args.lr = 0.03 * ((args.batch_update_size or args.world_size - 1) if batch else 1)
    if args.rank in (None, 0):  # the model lives on the parameter server
        try:
            choose_devices(args.num_gpus, torch.cuda.device_count())
        except ValueError as err:
            parser.error(str(err))
    if not Path(args.data_dir).is_dir():
        parser.error(f"--data_dir {args.data_dir}: no such folder")
    if args.dataset == "mnist" and args.rank != 0:  # the parameter server needs no data
        problem = check_mnist(args.data_dir)
        if problem:
            parser.error(problem)
    return args


def main(argv=None):
    args = parse_args(argv)
    # tutorial: p = mp.Process(target=run_parameter_server or run_worker, args=(rank, ...))
    rpc_harness.spawn(run, args=(args.world_size, args), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
