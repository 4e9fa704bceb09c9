"""The batch-updating parameter server (batch.py) as Monarch actors: the same Net, data, seed,
learning rate and number of trainers, on what PyTorch offers today beside RPC.

Monarch (PyPI: torchmonarch) is a single-controller framework: this command is the controller.
It starts every process itself, puts a parameter-server actor that owns the model and the
optimizer in this command's own process, and a mesh of trainer actors in the others, one a
process. The parameter server drives training: for each model version, one call to the
trainers' mesh sends the weights once to every trainer, and each trainer answers with the
gradients of its next batch; the server averages them and takes a step, as batch.py's server
does once every trainer's gradients are in. In batch.py each trainer makes an RPC a batch, and
each gets its own copy of the new model. main.py's way, a remote forward pass through
distributed autograd and DistributedOptimizer, has no Monarch counterpart: Monarch has no
autograd across processes (ACTORS.md).

Built from batch.py, whose training it does, written as Monarch's documentation writes actors
(https://meta-pytorch.org/monarch/, torchmonarch 0.7.0): Actor classes, async endpoints, calls
to whole meshes. Each line that is neither batch.py's work nor Monarch's way of writing it, but
this project's (bounded waits, --profile, the summary), is marked "# ours:"; what those lines
call is in monarch_extras.py and extras.py.

    python actors.py --dataset synthetic             # a parameter server and 3 trainers
"""

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch import optim
from torch.nn.utils import parameters_to_vector, vector_to_parameters

import extras  # ours: this project's flags and checks, --profile, the summary
import monarch_extras  # ours: bounded waits, --workers, the end in one line
from data import equal_share_batches, get_data_loaders
from main import Net, get_accuracy

monarch_extras.import_monarch()  # ours: one line (status 2) where torchmonarch is missing
from monarch.actor import Actor, current_rank, endpoint, this_proc  # noqa: E402


# ours: the weights and gradients as numpy arrays, which moved faster than tensors (below)
def as_message(tensors):
    """Tensors as one flat numpy array, for a message. Monarch pickles a tensor through
    torch.save, and a numpy array as its bytes: a 5 MB round trip took 19 ms, against 27 (2
    cores, bench/MONARCH-2-cores.md)."""
    return parameters_to_vector(tensors).detach().cpu().numpy()


class ParameterServer(Actor):
    """batch.py's BatchUpdateParameterServer, which drives the trainers: every model version
    goes out in one call to the trainers' mesh, and every trainer's gradients come back as its
    answer."""

    def __init__(self, num_trainers, args):
        torch.manual_seed(args.seed)  # the initial model, as batch.py's and main.py's servers
        self.model = Net()
        self.num_trainers = num_trainers
        # plain SGD at --lr, as batch.py's
        self.optimizer = optim.SGD(self.model.parameters(), lr=args.lr)
        self.call_timeout = args.call_timeout  # ours: the bound on each wait for the trainers
        # What the summary reports.
        self.versions = 0
        self.gradients = 0
        self.short_updates = 0
        # ours: --profile: the server's whole run
        self.prof = extras.profiler(args, "parameter_server", 0, loops=False)

    @endpoint
    async def train(self, trainers):
        """Train until no trainer has a batch left: the weights out, the gradients back, a
        step. The answer: what the summary reports of the server."""
        while True:
            weights = as_message(self.model.parameters())
            # One call to the trainers' mesh: the weights, pickled once, to every trainer;
            # each trainer's gradients (None once it has no batch left) as its answer.
            call = trainers.train_batch.call(weights)
            # ours: the wait bounded (--call_timeout)
            answers = await monarch_extras.answer(call, self.call_timeout, "the trainers")
            gradients = [flat for _, flat in answers.items() if flat is not None]
            if not gradients:
                break
            self.update(gradients)
        self.prof.stop()  # ours: --profile's trace
        return {"batch_update_size": self.num_trainers, "model_versions": self.versions,
                "gradients": self.gradients, "short_updates": self.short_updates}

    def update(self, gradients):
        """batch.py's step: the gradients added up in the .grad fields and averaged, then one
        step of SGD."""
        for flat in gradients:
            offset = 0
            for p in self.model.parameters():
                gradient = torch.as_tensor(flat[offset:offset + p.numel()]).view_as(p)
                p.grad = gradient.clone() if p.grad is None else p.grad + gradient
                offset += p.numel()
        for p in self.model.parameters():
            p.grad /= len(gradients)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.gradients += len(gradients)
        self.short_updates += len(gradients) < self.num_trainers
        self.versions += 1


class Trainer(Actor):
    """A trainer of batch.py: its own copy of the model, which the server's weights replace
    before each batch, and its share of the data."""

    def __init__(self, args):
        torch.manual_seed(args.seed)  # ours: dropout's draws, so that a run repeats (batch.py's)
        self.args = args
        # current_rank(): this actor's place in the trainers' mesh, 0..; the data shares are
        # main.py's and batch.py's, whose trainers are ranks 1..
        self.rank = current_rank().rank + 1
        self.name = f"trainer{self.rank}"
        world_size = args.world_size
        self.train_loader, self.test_loader = get_data_loaders(self.rank, world_size, args)
        self.batches = equal_share_batches(self.train_loader, world_size - 1, args)
        # the GPU when there is one, as batch.py's trainers
        self.device = torch.device("cuda:0" if torch.cuda.device_count() else "cpu")
        self.m = Net().to(self.device)
        self.next_batches = enumerate(self.get_next_batch())
        self.trained = 0
        self.started = None
        self.train_seconds = 0.0
        self.prof = extras.profiler(args, self.name, self.rank)  # ours: --profile: steps 3 to 5

    def get_next_batch(self):
        # The same number of batches for every trainer, as batch.py's, so that each update of
        # the server gets a gradient from every trainer.
        for _ in range(self.args.epochs):
            for i, (inputs, labels) in enumerate(self.train_loader):
                if i == self.batches:
                    break
                yield inputs.to(self.device), labels.to(self.device)

    @endpoint
    async def train_batch(self, weights):
        """The server's weights in this trainer's model; then the gradients of its next batch,
        or None once it has none left."""
        vector_to_parameters(torch.as_tensor(weights, device=self.device), self.m.parameters())
        if self.started is None:
            print(f"{self.name} trains its copy of the model on {self.device}, in process "
                  f"{os.getpid()}")
            self.started = time.perf_counter()
        i, batch = next(self.next_batches, (None, None))
        if batch is None:
            self.train_seconds = time.perf_counter() - self.started
            self.prof.stop()  # ours: --profile, for a run of fewer than 5 steps
            return None
        inputs, labels = batch
        self.m.zero_grad()
        loss = F.nll_loss(self.m(inputs), labels)
        loss.backward()
        if i % self.args.log_interval == 0:
            print(f"Rank {self.rank} training batch {i} loss {loss.item()}")
        self.trained = i + 1
        self.prof.step()  # ours: --profile's steps
        return as_message(p.grad for p in self.m.parameters())

    @endpoint
    async def test(self):
        """batch.py's end of a trainer: its accuracy on the test set, with the final model."""
        print("Training complete!")
        print("Getting accuracy....")
        accuracy = get_accuracy(self.test_loader, self.m.cpu())
        # ours: the summary's figures
        return {"accuracy": accuracy, "batches": self.trained,
                "train_seconds": round(self.train_seconds, 3),
                "peak_memory_mb": extras.peak_memory_mb()}


def main(args):
    trainers_count = args.world_size - 1
    # The trainers' processes, one each: on this host (Monarch's this_host().spawn_procs); ours:
    # or on the hosts of --workers, and each line of every process written whole
    trainer_procs = monarch_extras.spawn_procs(args, trainers_count, monarch_extras.whole_lines)
    # this_proc(): the parameter server lives in this process, the controller's, whose main
    # thread only waits; then the trainers.
    ps = this_proc().spawn("parameter_server", ParameterServer, trainers_count, args)
    trainers = trainer_procs.spawn("trainer", Trainer, args)
    trainers.initialized.get()
    print(f"Start training: a parameter server and {trainers_count} trainer(s)")
    # The server bounds each of its calls to the trainers (--call_timeout).
    ps_figures = ps.train.call_one(trainers).get()
    print("Finish training")
    # One call to the trainers' mesh tests every trainer; its answer holds one value a trainer.
    # ours: the wait bounded (--call_timeout), here and for the processes' stop
    results = monarch_extras.get(trainers.test.call(), args.call_timeout, "the trainers")
    # ours: the summary (extras.py's, as batch.py's), with each process's peak memory
    for point, figures in results.items():
        extras.reports[f"trainer{point.rank + 1}"] = figures
    extras.reports["ps"] = ps_figures
    # The trainers' processes stop; then the run's last line.
    monarch_extras.get(trainer_procs.stop(), args.call_timeout, "the trainers' processes")
    extras.print_summary(args, "parameter_server (controller)", summarize)


# ours: the summary, and the command line (batch.py's flags, and Monarch's)
def summarize(args, reports):
    """extras.py's summary, with what the server counted."""
    ps = reports.pop("ps")
    return extras.write_summary(
        args, reports, "monarch", ps,
        f", {ps['model_versions']} model versions of {ps['batch_update_size']} gradients")


def parse_args(argv=None):
    """batch.py's training flags (each step takes a gradient from every trainer, batch.py's
    default: no --batch_update_size); the processes; this project's --seed, --summary_json and
    --profile; Monarch's. Bad input ends the command here in one line (status 2)."""
    parser = argparse.ArgumentParser(
        description="batch.py's parameter server as Monarch actors: this command, the "
                    "controller, holds the parameter-server actor and starts a mesh of trainer "
                    "actors, one in each process of its own.")
    parser.add_argument("--world_size", "--world-size", type=extras.at_least(2), default=4,
                        metavar="N", help="processes: this command's, which holds the parameter "
                                          "server, and one per trainer, as in batch.py")
    extras.add_arguments(parser)
    extras.add_step_arguments(parser)
    monarch_extras.add_arguments(parser)
    args = parser.parse_args(argv)
    args.started = time.time()  # the summary's wall seconds
    monarch_extras.check_workers(parser, args, args.world_size - 1, "trainers")
    if args.serve:
        return args
    if args.summary_json:
        extras.check_file(parser, "--summary_json", args.summary_json)
    if args.profile:
        extras.check_folder(parser, "--profile", args.profile)
    if args.dataset == "mnist":
        extras.check_mnist_folder(parser, args.data_dir)
    if args.lr is None:  # batch.py's: each step averages a gradient of every trainer
        args.lr = 0.03 * (args.world_size - 1)
    return args


if __name__ == "__main__":
    args = parse_args()
    monarch_extras.whole_lines()  # ours: each line written whole, as in Monarch's processes
    if args.serve:  # ours: this host's processes, for a controller elsewhere (--workers)
        monarch_extras.serve(args.serve)
    # ours: a failed, killed or hung process ends the command in one line (monarch_extras.py)
    monarch_extras.run(lambda: main(args), role="trainer")
