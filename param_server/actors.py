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
this project's (bounded waits, --profile, the summary), ends with "# ours:" and why.

    python actors.py --dataset synthetic             # a parameter server and 3 trainers
"""

import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import optim
from torch.nn.utils import parameters_to_vector, vector_to_parameters

try:  # ours: this project's package, or one line that says how to install it
    from rpc_harness import monarch_runs
except ModuleNotFoundError:  # ours: (above)
    raise SystemExit("rpc_harness, this project's package, is missing: install it with "
                     "`pip install -e PATH`, PATH being the repository's folder (the one that "
                     "holds pyproject.toml), or run `make run` there") from None

# Monarch's own names. ours: monarch_runs.import_monarch() says in one line what is missing
# (status 2) where torchmonarch is not installed.
monarch = monarch_runs.import_monarch()  # ours: (above)
from monarch.actor import (  # noqa: E402
    Actor,
    concurrent_endpoint,
    current_rank,
    endpoint,
    this_proc,
)

from data import equal_share_batches, get_data_loaders  # noqa: E402
from extras import add_data_arguments, add_step_arguments, check_mnist_folder  # noqa: E402
from extras import write_summary as write_tutorial_summary  # noqa: E402
from main import Net, get_accuracy  # noqa: E402

HERE = Path(__file__).resolve().parent


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
        # ours: the bounds on each wait for the trainers
        self.call_timeout = args.call_timeout
        self.init_timeout = args.init_timeout
        # What the summary reports.
        self.versions = 0
        self.gradients = 0
        self.short_updates = 0
        self.batches_tested = 0  # ours: the trainers' evaluation, as progress (tested_a_batch)
        # ours: --profile's window, model versions 3 to 2 + --profile_steps
        self.recorder = monarch_runs.Recorder(args.profile, args.profile_steps, 0,
                                              "parameter_server")

    # concurrent_endpoint: the call runs as a task of the actor's event loop, so the actor
    # answers figures() and tested_a_batch() while it waits for the trainers.
    @concurrent_endpoint
    async def train(self, trainers):
        """Train until no trainer has a batch left: the weights out, the gradients back, a
        step; then the final weights out, which the trainers test."""
        while True:
            weights = as_message(self.model.parameters())
            # One call to the trainers' mesh: the weights, pickled once, to every trainer;
            # each trainer's gradients (None once it has no batch left) as its answer.
            call = trainers.train_batch.call(weights)
            # ours: each wait bounded (monarch_runs.answer), the first by --init_timeout
            if self.versions == 0:
                # The first call also starts each trainer's data loader and torch's kernels,
                # which takes seconds on a busy machine: start-up, bounded as such.
                answers = await monarch_runs.answer(call, self.init_timeout,
                                                    "the trainers' first batch", "--init_timeout")
            else:
                answers = await monarch_runs.answer(call, self.call_timeout, "the trainers")
            gradients = [flat for _, flat in answers.items() if flat is not None]
            if not gradients:
                break
            self.update(gradients)
        self.recorder.stop()  # ours: a run shorter than --profile's window

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
        self.recorder.step()  # ours: --profile's window

    # ours: the trainers' progress in testing, and the figures, for the bounded waits of main()
    # and the summary
    @endpoint
    async def tested_a_batch(self):
        """A trainer measured its accuracy on one more test batch (one-way:
        broadcast). The controller reads it as progress, which bounds its wait."""
        self.batches_tested += 1

    @endpoint
    async def figures(self):
        """What the summary reports of the server, and its process's peak memory."""
        return {"batch_update_size": self.num_trainers, "model_versions": self.versions,
                "gradients": self.gradients, "short_updates": self.short_updates,
                "batches_tested": self.batches_tested,
                "peak_memory_mb": monarch_runs.peak_memory_mb()}


class Trainer(Actor):
    """A trainer of batch.py: its own copy of the model, which the server's weights replace
    before each batch, and its share of the data."""

    def __init__(self, ps, args):
        self.ps = ps
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
        # ours: --profile's window, batches 3 to 2 + --profile_steps
        self.recorder = monarch_runs.Recorder(args.profile, args.profile_steps, self.rank,
                                              self.name)

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
                  f"{os.getpid()}", flush=True)
            self.started = time.perf_counter()
        i, batch = next(self.next_batches, (None, None))
        if batch is None:
            self.train_seconds = time.perf_counter() - self.started
            self.recorder.stop()  # ours: --profile's window
            return None
        inputs, labels = batch
        self.recorder.step()  # ours: (above)
        self.m.zero_grad()
        loss = F.nll_loss(self.m(inputs), labels)
        loss.backward()
        if i % self.args.log_interval == 0:
            print(f"Rank {self.rank} training batch {i} loss {loss.item()}", flush=True)
        self.trained = i + 1
        return as_message(p.grad for p in self.m.parameters())

    @endpoint
    async def test(self):
        """batch.py's end of a trainer: its accuracy on the test set, with the final model."""
        print("Training complete!", flush=True)
        print("Getting accuracy....", flush=True)
        # ours: TellingLoader, which reports progress (below)
        accuracy = get_accuracy(TellingLoader(self.test_loader, self.ps), self.m.cpu())
        return {"accuracy": accuracy, "batches": self.trained,
                "train_seconds": round(self.train_seconds, 3),
                "peak_memory_mb": monarch_runs.peak_memory_mb()}  # ours: for bench/


# ours: TellingLoader, wait_while_progress and setup_process, for bounded waits and whole lines
class TellingLoader:
    """A trainer's test loader, which tells the parameter server of each batch
    it hands out (tested_a_batch), for get_accuracy (main.py's), which reads its dataset too."""

    def __init__(self, loader, ps):
        self.loader = loader
        self.dataset = loader.dataset
        self.ps = ps

    def __iter__(self):
        for batch in self.loader:
            self.ps.tested_a_batch.broadcast()
            yield batch


def wait_while_progress(future, ps, what, args):
    """future's answer, waited for as long as the parameter server's figures change (a model
    version, a tested batch): training takes as long as it takes. The server bounds each of
    its calls to the trainers (--call_timeout; --init_timeout for the first model version)
    and says which did not answer; this wait is the backstop, which gives up only after twice
    that bound without progress, so that the server's line comes first."""
    progress = None
    unchanged_since = time.monotonic()
    while True:
        try:
            return future.get(timeout=args.call_timeout)
        except TimeoutError:
            pass
        figures = monarch_runs.get(ps.figures.call_one(), args.call_timeout,
                                   "the parameter server")
        now = (figures["model_versions"], figures["batches_tested"])
        if now != progress:
            progress = now
            unchanged_since = time.monotonic()
            continue
        bound = args.init_timeout if now == (0, 0) else args.call_timeout
        waited = time.monotonic() - unchanged_since
        if waited > 2 * bound:
            raise TimeoutError(f"{what}: no progress within {waited:.0f} s (twice "
                               f"{'--init_timeout' if now == (0, 0) else '--call_timeout'})")


def setup_process(threads):
    """Runs first in every actor process (spawn_procs' bootstrap): the modules beside this file
    importable there too (a child process starts in this command's working folder), the
    process's share of the cores (torch would take them all in every process), and each line
    it prints written whole (monarch_runs.whole_lines)."""
    sys.path.insert(0, str(HERE))
    torch.set_num_threads(threads)
    monarch_runs.whole_lines()


def main(args):
    trainers_count = args.world_size - 1
    # The trainers' processes, one each; ours: they compute, so they share the cores.
    threads = monarch_runs.share_of_the_cores(trainers_count)  # ours: (above)
    # On this host (Monarch's this_host().spawn_procs), or, ours, on the hosts of --workers.
    trainer_procs = monarch_runs.spawn_procs(args, trainers_count,
                                             bootstrap=lambda: setup_process(threads))
    # this_proc(): the parameter server lives in this process, the controller's, whose main
    # thread only waits; then the trainers, each handed the server's reference.
    ps = this_proc().spawn("parameter_server", ParameterServer, trainers_count, args)
    trainers = trainer_procs.spawn("trainer", Trainer, ps, args)
    # ours: each wait bounded, from here down (monarch_runs.get, wait_while_progress). Each
    # trainer's process starts, imports torch and makes its data: --init_timeout.
    monarch_runs.get(trainers.initialized, args.init_timeout, "the trainers' processes",
                     "--init_timeout")
    print(f"Start training: a parameter server and {trainers_count} trainer(s), "
          f"{threads} thread(s) each")
    wait_while_progress(ps.train.call_one(trainers), ps, "training", args)
    print("Finish training")
    # One call to the trainers' mesh tests every trainer; its answer holds one value a trainer.
    results = wait_while_progress(trainers.test.call(), ps, "testing", args)
    ps_figures = monarch_runs.get(ps.figures.call_one(), args.call_timeout,
                                  "the parameter server")
    # ours: the summary (batch.py's, with each process's peak memory), and --profile's timeline
    reports = {}
    memory = {}
    for point, figures in results.items():
        name = f"trainer{point.rank + 1}"
        memory[name] = figures.pop("peak_memory_mb")
        reports[name] = figures
    memory["parameter_server (controller)"] = ps_figures.pop("peak_memory_mb")
    ps_figures.pop("batches_tested")  # the wait's, not the summary's
    summary, line = write_tutorial_summary(
        args, reports, "monarch", ps_figures,
        f", {ps_figures['model_versions']} model versions of "
        f"{ps_figures['batch_update_size']} gradients")
    if args.profile:
        print(monarch_runs.write_timeline(args.profile, ["parameter_server", *reports]))
    # The trainers' processes stop, within --init_timeout; then the run's last line.
    monarch_runs.get(trainer_procs.stop(), args.init_timeout, "the trainers' processes",
                     "--init_timeout")
    monarch_runs.write_summary(args, summary, line, memory)


# ours: the command line (batch.py's flags, and Monarch's bounds on waiting)
def parse_args(argv=None):
    """batch.py's training flags (each step takes a gradient from every trainer, batch.py's
    default: no --batch_update_size); the processes; this project's --seed and --summary_json;
    Monarch's bounds on waiting. Bad input ends the command here in one line (status 2)."""
    parser = monarch_runs.ArgumentParser(
        description="batch.py's parameter server as Monarch actors: this command, the "
                    "controller, holds the parameter-server actor and starts a mesh of trainer "
                    "actors, one in each process of its own.")
    parser.add_argument("--world_size", "--world-size", type=monarch_runs.int_at_least(2),
                        default=4, metavar="N",
                        help="processes: this command's, which holds the parameter server, and "
                             "one per trainer, as in main.py and batch.py")
    add_data_arguments(parser)
    add_step_arguments(parser)
    monarch_runs.add_arguments(parser)
    args = parser.parse_args(argv)
    monarch_runs.check_args(parser, args, args.world_size - 1, "trainers")
    if args.dataset == "mnist":
        check_mnist_folder(parser, args.data_dir)
    if args.lr is None:  # batch.py's: each step averages a gradient of every trainer
        args.lr = 0.03 * (args.world_size - 1)
    return args


if __name__ == "__main__":
    args = parse_args()
    # ours: each line this process prints written whole, as in every actor's process
    # (setup_process), so that two processes' lines never run into one
    monarch_runs.whole_lines()
    # ours: a failed or killed actor process, an endpoint's error, Ctrl-C or SIGTERM end this
    # command and every process it started, in one line (docs/harness.md)
    with monarch_runs.one_line_on_failure(role="trainer"):
        main(args)
