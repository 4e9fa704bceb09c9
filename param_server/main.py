"""Implementing a Parameter Server Using Distributed RPC Framework: the tutorial's code, in its
order. Rank 0 is the parameter server, which holds the model; ranks 1.. are trainers, which
reach it through RPC, distributed autograd and DistributedOptimizer.

Each line that is not the tutorial's ends with "# ours:" and why, or sits under a "# ours:"
comment. What is not the lesson (this project's flags and checks, --profile, the run's summary)
is in extras.py, the data in data.py. README.md maps the tutorial's sections to this file.

    python main.py --dataset synthetic                      # every rank on this machine
    python main.py --world_size=2 --rank=1                  # one rank per terminal
"""

import argparse
import os
import sys  # ours: the command's exit status
import time  # ours: the summary's training time
from threading import Lock

# ours: extras before torch's modules, so that its warning filters are in place when torch
# 2.4 warns, on importing torch.distributed.optim, that TorchScript's optimizers are deprecated
import extras  # ours: this project's flags and checks, --profile, the summary
# isort: split

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch import optim
from torch.distributed.optim import DistributedOptimizer

from data import get_training_data  # ours: MNIST or generated digits, a share each trainer

# --------- MNIST Network to train, from pytorch/examples -----


class Net(nn.Module):
    def __init__(self, num_gpus=0):
        super(Net, self).__init__()
        print(f"Using {num_gpus} GPUs to train")
        self.num_gpus = num_gpus
        device = torch.device(
            "cuda:0" if torch.cuda.is_available() and self.num_gpus > 0 else "cpu")
        print(f"Putting first 2 convs on {str(device)}")
        # Put conv layers on the first cuda device
        self.conv1 = nn.Conv2d(1, 32, 3, 1).to(device)
        self.conv2 = nn.Conv2d(32, 64, 3, 1).to(device)
        # Put rest of the network on the 2nd cuda device, if there is one
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
        # Move tensor to next device if necessary
        next_device = next(self.fc1.parameters()).device
        x = x.to(next_device)

        x = self.fc1(x)
        x = F.relu(x)
        x = self.dropout2(x)
        x = self.fc2(x)
        output = F.log_softmax(x, dim=1)
        return output


# --------- Helper Methods --------------------

# On the local node, call a method with first arg as the value held by the
# RRef. Other args are passed in as arguments to the function called.
# Useful for calling instance methods.
def call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


# Given an RRef, return the result of calling the passed in method on the value
# held by the RRef. This call is done on the remote node that owns
# the RRef. args and kwargs are passed into the method.
# Example: If the value held by the RRef is of type Foo, then
# remote_method(Foo.bar, rref, arg1, arg2) is equivalent to calling
# <foo_instance>.bar(arg1, arg2) on the remote node and getting the result
# back.


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
        self.forward_lock = Lock()  # ours: one forward pass at a time (forward, below)

    def forward(self, inp, training=True):  # ours: training, so that model.eval() reaches here
        inp = inp.to(self.input_device)
        # ours: the tutorial's `out = self.model(inp)` on a copy of the weights, as another
        # trainer's optimizer step must not change in place what this call's backward pass
        # needs (pytorch/examples#877); clone() keeps the autograd link to the weights. The
        # lock keeps the model's mode and functional_call's swap of weights to one call.
        with self.forward_lock, torch.set_grad_enabled(training):
            self.model.train(training)
            weights = {name: p.clone() for name, p in self.model.named_parameters()}
            out = torch.func.functional_call(self.model, weights, (inp,))
        # This output is forwarded over RPC, which as of 1.5.0 only accepts CPU tensors.
        # Tensors must be moved in and out of GPU memory due to this.
        out = out.to("cpu")
        return out

    # Use dist autograd to retrieve gradients accumulated for this model.
    # Primarily used for verification.
    def get_dist_gradients(self, cid):
        grads = dist_autograd.get_gradients(cid)
        # ours: their norms, not the gradients and the weights, as the check needs only to see
        # that they are there
        return [grad.norm().item() for grad in grads.values()]

    # Wrap local parameters in a RRef. Needed for building the
    # DistributedOptimizer which optimizes parameters remotely.
    def get_param_rrefs(self):
        param_rrefs = [rpc.RRef(param) for param in self.model.parameters()]
        return param_rrefs


param_server = None
global_lock = Lock()


def get_parameter_server(num_gpus=0):
    global param_server
    # Ensure that we get only one handle to the ParameterServer.
    with global_lock:
        if not param_server:
            # construct it once
            param_server = ParameterServer(num_gpus=num_gpus)
        return param_server


def run_parameter_server(rank, world_size, args):  # ours: args, the flags
    torch.manual_seed(args.seed)  # ours: --seed, the model's first weights
    prof = extras.profiler(args, "parameter_server", rank, loops=False)  # ours: --profile
    # The parameter server just acts as a host for the model and responds to
    # requests from trainers, hence it does not need to run a loop.
    # rpc.shutdown() will wait for all workers to complete by default, which
    # in this case means that the parameter server will wait for all trainers
    # to complete, and then exit.
    print("PS master initializing RPC")
    rpc.init_rpc(name="parameter_server", rank=rank, world_size=world_size)
    print("RPC initialized! Running parameter server...")
    store = extras.hold_store(args, rank)  # ours: rank 0's store, kept for rpc.shutdown()
    rpc.shutdown()
    extras.release_store(args, rank, store)  # ours: (extras.hold_store says why)
    print("RPC shutdown on parameter server.")
    prof.stop()  # ours: --profile's trace of this rank
    extras.print_summary(args, "parameter_server")  # ours: the run's last line


# --------- Trainers --------------------

# nn.Module corresponding to the network trained by this trainer. The
# forward() method simply invokes the network on the given parameter
# server.
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
    # Runs the typical neural network forward + backward + optimizer step, but
    # in a distributed fashion.
    net = TrainerNet(num_gpus=num_gpus)
    # Build DistributedOptimizer.
    param_rrefs = net.get_global_param_rrefs()
    opt = DistributedOptimizer(optim.SGD, param_rrefs, lr=0.03)
    prof = extras.profiler(args, f"trainer_{rank}", rank)  # ours: --profile: steps 3 to 5
    started = time.perf_counter()  # ours: the summary's training time
    for i, (data, target) in enumerate(train_loader):
        with dist_autograd.context() as cid:
            model_output = net(data)
            target = target.to(model_output.device)
            loss = F.nll_loss(model_output, target)
            if i % args.log_interval == 0:  # ours: --log_interval, the tutorial's 5 by default
                print(f"Rank {rank} training batch {i} loss {loss.item()}")
            dist_autograd.backward(cid, [loss])
            # Ensure that dist autograd ran successfully and gradients were
            # returned.
            # ours: on the logged batches only; a list of norms (get_dist_gradients)
            if i % args.log_interval == 0:
                assert remote_method(
                    ParameterServer.get_dist_gradients,
                    net.param_server_rref,
                    cid) != []
            opt.step(cid)
        prof.step()  # ours: --profile's steps
    prof.stop()  # ours: --profile, for a run of fewer than 5 steps
    # ours: the summary's figures
    extras.measured.update(batches=len(train_loader), train_seconds=time.perf_counter() - started)

    print("Training complete!")
    print("Getting accuracy....")
    extras.measured["accuracy"] = get_accuracy(test_loader, net)  # ours: the summary's


def get_accuracy(test_loader, model):
    model.eval()
    correct_sum = 0
    # Use GPU to evaluate if possible
    device = torch.device("cuda:0" if model.num_gpus > 0
        and torch.cuda.is_available() else "cpu")
    with torch.no_grad():
        for i, (data, target) in enumerate(test_loader):
            out = model(data)  # ours: the tutorial's model(data, -1) is a TypeError
            pred = out.argmax(dim=1, keepdim=True)
            pred, target = pred.to(device), target.to(device)
            correct = pred.eq(target.view_as(pred)).sum().item()
            correct_sum += correct

    print(f"Accuracy {correct_sum / len(test_loader.dataset)}")
    return correct_sum / len(test_loader.dataset)  # ours: for the summary, batch.py, actors.py


# Main loop for trainers.
def run_worker(rank, world_size, num_gpus, train_loader, test_loader, args):  # ours: args
    torch.manual_seed(args.seed)  # ours: --seed, so that a run repeats
    print(f"Worker rank {rank} initializing RPC")
    rpc.init_rpc(
        name=f"trainer_{rank}",
        rank=rank,
        world_size=world_size)

    print(f"Worker {rank} done initializing RPC")

    # ours: the data, made here, in the trainer's own process: its share of MNIST or of the
    # generated digits (data.py)
    if train_loader is None:
        train_loader, test_loader = get_training_data(rank, world_size, args)
    run_training_loop(rank, num_gpus, train_loader, test_loader, args)  # ours: args
    # ours: this trainer's figures, for the summary that the parameter server prints
    rpc.rpc_sync("parameter_server", extras.report, args=(f"trainer_{rank}", extras.figures()))
    store = extras.hold_store(args, rank)  # ours: rank 0's store, kept for rpc.shutdown()
    rpc.shutdown()
    extras.release_store(args, rank, store)  # ours: (extras.hold_store says why)


# --------- ours: every rank from one command (mp.spawn), as the other RPC tutorials -----

def run(rank, world_size, args):
    if rank == 0:
        run_parameter_server(0, world_size, args)
    else:
        run_worker(rank, world_size, args.num_gpus, None, None, args)


# --------- Launcher --------------------


if __name__ == '__main__':
    parser = argparse.ArgumentParser(
        description="Parameter-Server RPC based training")
    parser.add_argument(
        "--world_size",
        "--world-size",  # ours: the hyphenated spelling too, as for every flag
        type=int,
        default=4,
        help="""Total number of participating processes. Should be the sum of
        master node and all training nodes.""")
    parser.add_argument(
        "--rank",  # ours: a flag, as the tutorial's commands pass it (it declares "rank")
        type=int,
        default=None,
        help="Global rank of this process. Pass in 0 for master.")
    parser.add_argument(
        "--num_gpus",  # ours: a flag, as the tutorial's commands pass it (it declares "num_gpus")
        "--num-gpus",  # ours: the hyphenated spelling too
        type=int,
        default=0,
        help="""Number of GPUs to use for training, currently supports between 0
         and 2 GPUs. Note that this argument will be passed to the parameter servers.""")
    parser.add_argument(
        "--master_addr",
        "--master-addr",  # ours: the hyphenated spelling too
        type=str,
        default="localhost",
        help="""Address of master, will default to localhost if not provided.
        Master must be able to accept network traffic on the address + port.""")
    parser.add_argument(
        "--master_port",
        "--master-port",  # ours: the hyphenated spelling too
        type=str,
        default="29500",
        help="""Port that master is listening on, will default to 29500 if not
        provided. Master must be able to accept network traffic on the host and port.""")
    # ours: --dataset, --epochs, --seed, --summary_json, ...; every default in --help, no
    # abbreviated flags, errors in one line
    extras.add_arguments(parser)

    args = parser.parse_args()
    # ours: in place of the tutorial's two asserts: bad input in one line, status 2, before any
    # rank starts; a rank from torchrun's environment
    extras.check_args(parser, args)
    os.environ['MASTER_ADDR'] = args.master_addr
    os.environ['MASTER_PORT'] = args.master_port
    # ours: fork, Linux's default, can deadlock the DataLoader (the pytorch/examples script's
    # fix too)
    mp.set_start_method("spawn")
    processes = []
    world_size = args.world_size
    if args.rank is None:  # ours: without --rank, every rank from this command
        mp.spawn(run, args=(world_size, args), nprocs=world_size, join=True)
    elif args.rank == 0:  # ours: elif, after the line above
        p = mp.Process(target=run_parameter_server, args=(0, world_size, args))  # ours: args
        p.start()
        processes.append(p)
    else:
        # ours: each trainer makes its data in its own process (run_worker)
        train_loader, test_loader = None, None
        # start training worker on this node
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
        # ours: the rank's exit status is the command's (killed by signal N: 128 + N, as a
        # shell shows it)
        sys.exit(p.exitcode if p.exitcode >= 0 else 128 - p.exitcode)
