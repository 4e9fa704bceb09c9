"""The batch-updating parameter server (batch.py) as Monarch actors: the same Net, data, seed,
learning rate and number of trainers, on what PyTorch offers today beside RPC.

Monarch (PyPI: torchmonarch) is a single-controller framework: this command is the controller.
It starts every process itself, puts a parameter-server actor that owns the model and the
optimizer in this command's own process, and a mesh of trainer actors in the others, one a
process, which fetch the model and push their gradients as batch.py's trainers do with
update_and_fetch_model. Nothing joins a world and nothing meets at an address and port: the
actors talk through the references that the controller hands them. main.py's way, a remote
forward pass through distributed autograd and DistributedOptimizer, has no Monarch counterpart:
Monarch has no autograd across processes (README.md, "The same program as Monarch actors").

    python actors.py --dataset synthetic             # a parameter server and 3 trainers
"""

import asyncio
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import optim

try:
    from rpc_harness import monarch_runs
except ModuleNotFoundError:
    raise SystemExit("rpc_harness, this project's package, is missing: install it with "
                     "`pip install -e PATH`, PATH being the repository's folder (the one that "
                     "holds pyproject.toml), or run `make run` there") from None

# Monarch's own names. monarch_runs.import_monarch() says in one line what is missing (status
# 2) where torchmonarch is not installed.
monarch = monarch_runs.import_monarch()
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


class ParameterServer(Actor):
    """batch.py's BatchUpdateParameterServer. Its endpoints are `async def`, as Monarch's docs
    write them: the actor runs them on its own event loop, one message at a time, so nothing here
    needs batch.py's lock."""

    def __init__(self, batch_update_size, num_trainers, args):
        torch.manual_seed(args.seed)  # the initial model, as batch.py's and main.py's servers
        self.model = Net()
        # batch.py's torch.futures.Future of the next model, here an asyncio one: the actor's
        # event loop completes it.
        self.future_model = asyncio.get_running_loop().create_future()
        self.batch_update_size = batch_update_size
        self.curr_update_size = 0
        # plain SGD at --lr, as batch.py's
        self.optimizer = optim.SGD(self.model.parameters(), lr=args.lr)
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)
        # What the summary reports, and the trainers still training (as batch.py's).
        self.trainers_left = num_trainers
        self.versions = 0
        self.gradients = 0
        self.short_updates = 0
        self.trainers_started = 0
        self.batches_tested = 0  # not in batch.py: the trainers' evaluation, as progress
        # Not in batch.py: --profile's window, model versions 3 to 2 + --profile_steps.
        self.recorder = monarch_runs.Recorder(args.profile, args.profile_steps, 0,
                                              "parameter_server")

    @endpoint
    async def get_model(self):
        self.trainers_started += 1
        # The weights, not the module: messages are pickled as they are sent, and every
        # trainer builds its own Net.
        return self.model.state_dict()

    # concurrent_endpoint: each call runs as a task of the actor's event loop, so the actor
    # takes the next trainer's gradients while this one awaits the next model, as batch.py's
    # @rpc.functions.async_execution frees its RPC thread.
    @concurrent_endpoint
    async def update_and_fetch_model(self, grads):
        self.curr_update_size += 1
        self.gradients += 1
        # add the gradients up in the .grad fields
        for p, g in zip(self.model.parameters(), grads, strict=True):
            p.grad += g
        # the future of the next model, kept before another step could replace it
        fut = self.future_model
        self._update_if_all_gradients_are_in()
        return await fut

    def _update_if_all_gradients_are_in(self):
        """One step, once batch_update_size gradients are in (or all that the trainers still
        training can send); the new model answers every waiting trainer."""
        if self.curr_update_size < min(self.batch_update_size, self.trainers_left):
            return
        self.short_updates += self.curr_update_size < self.batch_update_size
        for p in self.model.parameters():
            p.grad /= self.curr_update_size
        self.curr_update_size = 0
        self.optimizer.step()
        # set_to_none=False: the next update adds to .grad, which must stay a tensor
        self.optimizer.zero_grad(set_to_none=False)
        # Completing the future answers every waiting trainer, with a copy of the weights:
        # the next step must not change them while they are sent.
        new_model = {name: tensor.clone() for name, tensor in self.model.state_dict().items()}
        self.future_model.set_result(new_model)
        self.future_model = asyncio.get_running_loop().create_future()
        self.versions += 1
        self.recorder.step()

    @endpoint
    async def trainer_done(self):
        self.trainers_left -= 1
        if self.curr_update_size:
            self._update_if_all_gradients_are_in()
        if self.trainers_left == 0:
            self.recorder.stop()  # a run shorter than --profile's window

    @endpoint
    async def tested_a_batch(self):
        """Not in batch.py: a trainer measured its accuracy on one more test batch (one-way:
        broadcast). The controller reads it as progress, which bounds its wait."""
        self.batches_tested += 1

    @endpoint
    async def figures(self):
        """What the summary reports of the server, and its process's peak memory."""
        return {"batch_update_size": self.batch_update_size, "model_versions": self.versions,
                "gradients": self.gradients, "short_updates": self.short_updates,
                "trainers_started": self.trainers_started,
                "trainers_left": self.trainers_left, "batches_tested": self.batches_tested,
                "peak_memory_mb": monarch_runs.peak_memory_mb()}


class Trainer(Actor):
    """A trainer of batch.py: trains its own copy of the model on its share of the data."""

    def __init__(self, ps, args):
        self.ps = ps
        self.args = args
        # current_rank(): this actor's place in the trainers' mesh, 0..; the data shares are
        # main.py's and batch.py's, whose trainers are ranks 1..
        self.rank = current_rank().rank + 1
        world_size = args.world_size
        self.train_loader, self.test_loader = get_data_loaders(self.rank, world_size, args)
        self.batches = equal_share_batches(self.train_loader, world_size - 1, args)
        # the GPU when there is one, as batch.py's trainers
        self.device = torch.device("cuda:0" if torch.cuda.device_count() else "cpu")

    def get_next_batch(self):
        # The same number of batches for every trainer, as batch.py's, so that each update of
        # the server gets a gradient from every trainer.
        for _ in range(self.args.epochs):
            for i, (inputs, labels) in enumerate(self.train_loader):
                if i == self.batches:
                    break
                yield inputs.to(self.device), labels.to(self.device)

    async def answer(self, call):
        """The parameter server's answer; --call_timeout bounds the wait."""
        return await monarch_runs.answer(call, self.args.call_timeout, "the parameter server")

    @endpoint
    async def train(self):
        name = f"trainer{self.rank}"
        # the initial model, from the parameter server
        m = Net().to(self.device)
        m.load_state_dict(await self.answer(self.ps.get_model.call_one()))
        print(f"{name} trains its copy of the model on {self.device}, in process "
              f"{os.getpid()}", flush=True)
        # Not in batch.py: --profile's window, batches 3 to 2 + --profile_steps.
        recorder = monarch_runs.Recorder(self.args.profile, self.args.profile_steps,
                                         self.rank, name)
        started = time.perf_counter()
        i = -1
        for i, (inputs, labels) in enumerate(self.get_next_batch()):
            recorder.step()
            log = i % self.args.log_interval == 0
            m.zero_grad()
            loss = F.nll_loss(m(inputs), labels)
            loss.backward()
            if log:
                print(f"Rank {self.rank} training batch {i} loss {loss.item()}", flush=True)
            grads = [p.grad.cpu() for p in m.parameters()]
            m.load_state_dict(await self.answer(self.ps.update_and_fetch_model.call_one(grads)))
        train_seconds = time.perf_counter() - started
        recorder.stop()
        await self.answer(self.ps.trainer_done.call_one())
        print("Training complete!", flush=True)
        print("Getting accuracy....", flush=True)
        accuracy = get_accuracy(TellingLoader(self.test_loader, self.ps), m.cpu())
        return {"accuracy": accuracy, "batches": i + 1, "train_seconds": round(train_seconds, 3),
                "peak_memory_mb": monarch_runs.peak_memory_mb()}


class TellingLoader:
    """Not in batch.py: a trainer's test loader, which tells the parameter server of each batch
    it hands out (tested_a_batch), for get_accuracy (main.py's), which reads its dataset too."""

    def __init__(self, loader, ps):
        self.loader = loader
        self.dataset = loader.dataset
        self.ps = ps

    def __iter__(self):
        for batch in self.loader:
            self.ps.tested_a_batch.broadcast()
            yield batch


def wait_while_gradients_come(training, ps, trainers_count, args):
    """The trainers' answers. Training takes as long as it takes, so the wait is bounded by
    progress instead: every trainer must fetch its first model within --init_timeout (its
    process starts, imports torch and makes its data first), then a gradient, or once training
    is over a tested batch, must reach the parameter server every --call_timeout seconds."""
    progress = None
    silent_since = time.monotonic()
    while True:
        try:
            return training.get(timeout=min(args.call_timeout, args.init_timeout))
        except TimeoutError:
            pass
        figures = monarch_runs.get(ps.figures.call_one(), args.call_timeout,
                                   "the parameter server")
        started = figures["trainers_started"]
        now = (started, figures["gradients"], figures["trainers_left"],
               figures["batches_tested"])
        if now != progress:
            progress = now
            silent_since = time.monotonic()
            continue
        silent = time.monotonic() - silent_since
        if started < trainers_count and silent > args.init_timeout:
            raise TimeoutError(f"{trainers_count - started} trainer(s) did not start within "
                               f"{args.init_timeout:g} s (--init_timeout)")
        if started == trainers_count and silent > args.call_timeout:
            what = "gradient" if figures["trainers_left"] else "tested batch"
            raise TimeoutError(f"no {what} reached the parameter server within "
                               f"{args.call_timeout:g} s (--call_timeout)")


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
    batch_update_size = args.batch_update_size or trainers_count
    # The trainers' processes, one each; they compute, so they share the cores.
    threads = monarch_runs.share_of_the_cores(trainers_count)
    # On this host, or on the hosts of --workers (monarch_runs.spawn_procs).
    trainer_procs = monarch_runs.spawn_procs(args, trainers_count,
                                             bootstrap=lambda: setup_process(threads))
    # this_proc(): the parameter server lives in this process, the controller's, whose main
    # thread only waits; then the trainers, each handed the server's reference.
    ps = this_proc().spawn("parameter_server", ParameterServer, batch_update_size,
                           trainers_count, args)
    trainers = trainer_procs.spawn("trainer", Trainer, ps, args)
    print(f"Start training: a parameter server and {trainers_count} trainer(s), "
          f"{threads} thread(s) each")
    # One call to the trainers' mesh starts every trainer; its answer holds one value a trainer.
    training = trainers.train.call()
    results = wait_while_gradients_come(training, ps, trainers_count, args)
    ps_figures = monarch_runs.get(ps.figures.call_one(), args.call_timeout,
                                  "the parameter server")
    print("Finish training")
    reports = {}
    memory = {}
    for point, figures in results.items():
        name = f"trainer{point.rank + 1}"
        memory[name] = figures.pop("peak_memory_mb")
        reports[name] = figures
    memory["parameter_server (controller)"] = ps_figures.pop("peak_memory_mb")
    for progress_only in ("trainers_left", "batches_tested"):  # the wait's, not the summary's
        ps_figures.pop(progress_only)
    summary, line = write_tutorial_summary(
        args, reports, "monarch", ps_figures,
        f", {ps_figures['model_versions']} model versions of "
        f"{ps_figures['batch_update_size']} gradients")
    if args.profile:
        print(monarch_runs.write_timeline(args.profile, ["parameter_server", *reports]))
    # The trainers' processes stop, within --init_timeout; then the run's last line.
    monarch_runs.get(trainer_procs.stop(), args.init_timeout, "the trainers' processes")
    monarch_runs.write_summary(args, summary, line, memory)


def parse_args(argv=None):
    """batch.py's training flags; the processes; this project's --seed and --summary_json;
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
    parser.add_argument("--batch_update_size", "--batch-update-size",
                        type=monarch_runs.int_at_least(1), default=None, metavar="N",
                        help="gradients in each step (default: the number of trainers)")
    monarch_runs.add_arguments(parser)
    args = parser.parse_args(argv)
    monarch_runs.check_args(parser, args, args.world_size - 1, "trainers")
    if args.dataset == "mnist":
        check_mnist_folder(parser, args.data_dir)
    trainers = args.world_size - 1
    if (args.batch_update_size or 0) > trainers:
        parser.error(f"--batch_update_size {args.batch_update_size} is more than the "
                     f"{trainers} trainer(s) of a world of {args.world_size}")
    if args.lr is None:
        args.lr = 0.03 * (args.batch_update_size or trainers)
    return args


if __name__ == "__main__":
    args = parse_args()
    # Not in Monarch's examples: each line this process prints written whole, as in every
    # actor's process (setup_process), so that two processes' lines never run into one.
    monarch_runs.whole_lines()
    # Not in Monarch's examples: a failed or killed actor process, an endpoint's error, Ctrl-C
    # or SIGTERM end this command and every process it started, in one line (README.md: "What
    # the harness changes").
    with monarch_runs.one_line_on_failure(role="trainer"):
        main(args)
