"""Implementing a Parameter Server Using Distributed RPC Framework: the tutorial's code, in its
order. Rank 0 is the parameter server, which holds the model; ranks 1.. are trainers, which
reach it through RPC, distributed autograd and DistributedOptimizer.

Each line that is not the tutorial's ends with "# ours:" and why. What is not the lesson (this
project's flags and checks, the ranks' names, the run's summary) is in extras.py, the data in
data.py. README.md maps the tutorial's sections to this file.

    python main.py --dataset synthetic                      # every rank on this machine
    python main.py --world_size=2 --rank=1                  # one rank per terminal
"""

import os
import sys  # ours: the command's exit status
import time  # ours: the summary's training time
from threading import Lock

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch import optim
from torch.distributed.optim import DistributedOptimizer

import rpc_harness  # ours: this project's package: `make run` installs it (or `pip install -e .`)

from data import get_training_data  # ours: MNIST or generated digits, a share each trainer
from extras import add_arguments, check_args, report_training  # ours: flags, checks, summary

# --------- MNIST Network to train, from pytorch/examples -----


class Net(nn.Module):
    def __init__(self, num_gpus=0):
        super(Net, self).__init__()
        print(f"Using {num_gpus} GPUs to train")
        self.num_gpus = num_gpus
        device = torch.device(
            "cuda:0" if torch.cuda.is_available() and self.num_gpus > 0 else "cpu")
        print(f"Putting first 2 convs on {str(device)}")
        # the two convolutions on the first GPU, if any
        self.conv1 = nn.Conv2d(1, 32, 3, 1).to(device)
        self.conv2 = nn.Conv2d(32, 64, 3, 1).to(device)
        # the other layers on the second GPU, if two are asked for
        if "cuda" in str(device) and num_gpus > 1:
            device = torch.device("cuda:1")

        print(f"Putting rest of layers on {str(device)}")
        self.dropout1 = nn.Dropout2d(0.25).to(device)
        self.dropout2 = nn.Dropout(0.5).to(device)  # ours: Dropout2d is for 4-D input
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

# Runs on the owner of rref: calls the method on the object that rref holds, with the other
# arguments.
def call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


# Calls the method on the object that rref holds, on the worker that owns it, and returns the
# result: remote_method(Foo.bar, rref, arg) runs <that Foo>.bar(arg) there.


def remote_method(method, rref, *args, **kwargs):
    args = [method, rref] + list(args)
    return rpc.rpc_sync(rref.owner(), call_method, args=args, kwargs=kwargs)


# --------- Parameter Server --------------------
class ParameterServer(nn.Module):
    def __init__(self, num_gpus=0):
        super().__init__()
        model = Net(num_gpus=num_gpus)
        self.model = model
        self.input_device = torch.device(
            "cuda:0" if torch.cuda.is_available() and num_gpus > 0 else "cpu")
        self.forward_lock = Lock()  # ours: one forward pass at a time (below)

    def forward(self, inp, training=True):  # ours: training, so that model.eval() reaches here
        inp = inp.to(self.input_device)
        # ours: the forward pass on a copy of the weights (clone() keeps the autograd link), as
        # another trainer's optimizer step must not change in place what this call's backward
        # pass needs (pytorch/examples#877); the lock keeps the swap of weights to one call.
        with self.forward_lock, torch.set_grad_enabled(training):  # ours: (above)
            self.model.train(training)  # ours: (above)
            weights = {name: p.clone() for name, p in self.model.named_parameters()}  # ours
            out = torch.func.functional_call(self.model, weights, (inp,))  # ours: (above)
        # RPC (without device maps) carries CPU tensors: the output goes back from the CPU.
        out = out.to("cpu")
        return out

    # The gradients that distributed autograd gathered here: a check that it ran.
    def get_dist_gradients(self, cid):
        grads = dist_autograd.get_gradients(cid)
        # ours: their norms, not the whole gradients, as the check needs only to see them
        return [grad.norm().item() for grad in grads.values()]  # ours: (above)

    # An RRef to each parameter, for the trainers' DistributedOptimizer.
    def get_param_rrefs(self):
        param_rrefs = [rpc.RRef(param) for param in self.model.parameters()]
        return param_rrefs


param_server = None
global_lock = Lock()


def get_parameter_server(num_gpus=0):
    global param_server
    # one ParameterServer per process, whichever trainer asks first
    with global_lock:
        if not param_server:
            # built on the first call
            param_server = ParameterServer(num_gpus=num_gpus)
        return param_server


@rpc_harness.watched  # ours: this rank ends in one line if it fails or loses a peer
def run_parameter_server(rank, world_size, args):  # ours: args, for rpc_harness.options
    # The parameter server only holds the model and answers the trainers, so it runs no loop.
    # rpc.shutdown() waits for every worker by default: here, until every trainer is done.
    print("PS master initializing RPC")
    # ours: rpc_harness.options(args): TensorPipe's options; the ranks meet through the harness
    rpc.init_rpc(name="parameter_server", rank=rank, world_size=world_size,
                 rpc_backend_options=rpc_harness.options(args))  # ours: (above)
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
        model_output = remote_method(
            ParameterServer.forward, self.param_server_rref, x, self.training)  # ours: training
        return model_output


def run_training_loop(rank, num_gpus, train_loader, test_loader, args):  # ours: args
    # The usual forward pass, backward pass and optimizer step, but distributed.
    net = TrainerNet(num_gpus=num_gpus)
    # the optimizer of the parameters on the parameter server
    param_rrefs = net.get_global_param_rrefs()
    opt = DistributedOptimizer(optim.SGD, param_rrefs, lr=0.03)
    started = time.perf_counter()  # ours: the summary's training time
    for i, (data, target) in enumerate(train_loader):
        rpc_harness.profile_step()  # ours: --profile's window; nothing without --profile
        with dist_autograd.context() as cid:
            model_output = net(data)
            target = target.to(model_output.device)
            loss = F.nll_loss(model_output, target)
            if i % args.log_interval == 0:  # ours: --log_interval, the tutorial's 5 by default
                print(f"Rank {rank} training batch {i} loss {loss.item()}")
            dist_autograd.backward(cid, [loss])
            # Check that distributed autograd left gradients on the parameter server.
            if i % args.log_interval == 0:  # ours: on the logged batches, a check, not a step
                assert remote_method(
                    ParameterServer.get_dist_gradients,
                    net.param_server_rref,
                    cid) != []  # ours: a list of norms (get_dist_gradients)
            opt.step(cid)
    report_training(train_loader, time.perf_counter() - started)  # ours: the summary's figures

    print("Training complete!")
    print("Getting accuracy....")
    get_accuracy(test_loader, net)


def get_accuracy(test_loader, model):
    model.eval()
    correct_sum = 0
    # the GPU, where the trainer has one
    device = torch.device("cuda:0" if model.num_gpus > 0
        and torch.cuda.is_available() else "cpu")
    with torch.no_grad():
        for i, (data, target) in enumerate(test_loader):
            # ours: model(data), not the tutorial's model(data, -1), a TypeError, as
            # TrainerNet.forward takes one input (the pytorch/examples script's fix too)
            out = model(data)  # ours: (above)
            pred = out.argmax(dim=1, keepdim=True)
            pred, target = pred.to(device), target.to(device)
            correct = pred.eq(target.view_as(pred)).sum().item()
            correct_sum += correct

    print(f"Accuracy {correct_sum / len(test_loader.dataset)}")
    rpc_harness.report(accuracy=correct_sum / len(test_loader.dataset))  # ours: the summary's
    return correct_sum / len(test_loader.dataset)  # ours: for actors.py


# What a trainer's process runs.
@rpc_harness.watched  # ours: this rank ends in one line if it fails or loses a peer
def run_worker(rank, world_size, num_gpus, train_loader, test_loader, args):  # ours: args
    print(f"Worker rank {rank} initializing RPC")
    rpc.init_rpc(
        name=f"trainer_{rank}",
        rank=rank,
        world_size=world_size,  # ours: a comma, as an argument follows
        rpc_backend_options=rpc_harness.options(args))  # ours: the harness's meeting

    print(f"Worker {rank} done initializing RPC")

    if train_loader is None:  # ours: the data, made here, in the trainer's own process (below)
        train_loader, test_loader = get_training_data(rank, world_size, args)  # ours: (above)
    run_training_loop(rank, num_gpus, train_loader, test_loader, args)  # ours: args
    rpc.shutdown()


@rpc_harness.watched  # ours: every rank from one command (mp.spawn), as the other tutorials
def run(rank, world_size, args):  # ours: (above): this rank's part of __main__ below
    if rank == 0:  # ours: (above)
        run_parameter_server(0, world_size, args)  # ours: (above)
    else:  # ours: (above)
        run_worker(rank, world_size, args.num_gpus, None, None, args)  # ours: (above)

# --------- Launcher --------------------


def make_parser(description="Parameter-Server RPC based training",  # ours: batch.py's too,
                num_gpus=True):  # ours: which leaves out --num_gpus (its server is on the CPU)
    parser = rpc_harness.ArgumentParser(  # ours: errors in one line, every default in --help
        description=description)  # ours: batch.py's own
    parser.add_argument(
        "--world_size",
        type=int,
        default=4,
        help="""Total number of participating processes. Should be the sum of
        master node and all training nodes.""")
    # ours: --rank and --num_gpus are flags, as the tutorial's own commands pass them
    # (--rank=1); it declares them positional, `"rank"` and `"num_gpus"`, which refuses those
    # commands. The pytorch/examples script made the same fix, and wrote "currently" below.
    parser.add_argument(
        "--rank",  # ours: (above)
        type=int,
        default=None,
        help="Global rank of this process. Pass in 0 for master.")
    if num_gpus:  # ours: not for batch.py (make_parser's num_gpus)
        parser.add_argument(
            "--num_gpus",  # ours: (above --rank)
            type=int,
            default=0,
            help="""Number of GPUs to use for training, currently supports between 0
             and 2 GPUs. Note that this argument will be passed to the parameter servers.""")
    parser.add_argument(
        "--master_addr",
        type=str,
        default="localhost",
        help="""Address of master, will default to localhost if not provided.
        Master must be able to accept network traffic on the address + port.""")
    parser.add_argument(
        "--master_port",
        type=str,
        default="29500",
        help="""Port that master is listening on, will default to 29500 if not
        provided. Master must be able to accept network traffic on the host and port.""")
    add_arguments(parser)  # ours: this project's flags (extras.py)
    return parser  # ours: (above)


def parse_args(argv=None):  # ours: the tutorial's command line, in a function the tests call
    parser = make_parser()  # ours: (above)
    args = parser.parse_args(argv)  # ours: argv, for the tests
    check_args(parser, args)  # ours: in one line each, what the tutorial's asserts checked
    return args  # ours: (above)


if __name__ == '__main__':  # ours: below parse_args, which holds the tutorial's first lines
    args = parse_args()  # ours: the tutorial's command line, above
    os.environ['MASTER_ADDR'] = args.master_addr
    os.environ['MASTER_PORT'] = args.master_port
    rpc_harness.supervise(args)  # ours: this command ends in one line when a rank fails
    # ours: fork, Linux's default, can deadlock the DataLoader (the pytorch/examples script's
    # fix too)
    mp.set_start_method("spawn")  # ours: (above)
    processes = []
    world_size = args.world_size
    if args.rank is None:  # ours: without --rank, every rank from this command
        mp.spawn(run, args=(world_size, args), nprocs=world_size, join=True)  # ours: (above)
    elif args.rank == 0:  # ours: elif, after the line above
        p = mp.Process(target=run_parameter_server, args=(0, world_size, args))  # ours: args
        p.start()
        processes.append(p)
    else:
        # ours: the data is made in the trainer's process (run_worker): torch hands tensors to a
        # spawned process through shared memory, which failed here ("unable to resize file")
        train_loader, test_loader = None, None  # ours: (above)
        p = mp.Process(
            target=run_worker,
            args=(
                args.rank,
                world_size, args.num_gpus,
                train_loader,
                test_loader, args))  # ours: args
        p.start()
        processes.append(p)

    for p in processes:
        p.join()
    if processes:  # ours: the rank's exit status is the command's, with its line
        sys.exit(rpc_harness.exit_status(p))  # ours: (above)
