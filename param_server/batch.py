"""The batch-updating parameter server of the tutorial "Implementing Batch RPC Processing Using
Asynchronous Executions", runnable, training main.py's Net on the same data.

Synchronous, where main.py's server is not: every trainer trains a copy of the model fetched
from the server and sends its gradients with update_and_fetch_model, an
`@rpc.functions.async_execution` function that returns a future of the next model at once,
freeing its RPC thread; once batch_update_size gradients are in, the server averages them, takes
one optimizer step and completes the future, which answers every waiting trainer with the new
model. README.md compares the two ways.

    python batch.py --dataset synthetic             # a server and 3 trainers
"""

import copy
import hashlib
import itertools
import os
import sys
import threading
import time
from datetime import datetime

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import optim

try:
    import rpc_harness
except ModuleNotFoundError:
    raise SystemExit("rpc_harness, this project's package, is missing: install it with "
                     "`pip install -e PATH`, PATH being the repository's folder (the one that "
                     "holds pyproject.toml), or run `make run` there") from None

from data import equal_share_batches, get_data_loaders
from extras import add_step_arguments, check_args
from extras import write_summary as write_tutorial_summary
from main import Net, get_accuracy, make_parser


def timed_log(text):
    print(f"{datetime.now().strftime('%H:%M:%S')} {text}")


class BatchUpdateParameterServer:

    def __init__(self, batch_update_size, num_trainers, args):
        self.model = Net()
        self.lock = threading.Lock()
        self.future_model = torch.futures.Future()
        self.batch_update_size = batch_update_size
        self.curr_update_size = 0
        # plain SGD, as main.py's (the tutorial's has momentum=0.9), so that the two ways compare;
        # --lr defaults to 0.03 x batch_update_size here, as each step averages that many gradients
        self.optimizer = optim.SGD(self.model.parameters(), lr=args.lr)
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)
        # Not in the tutorial: what the summary reports, and the trainers still training, so
        # that with a batch_update_size below the number of trainers the last ones do not wait
        # for gradients that will never come.
        self.trainers_left, self.log_interval = num_trainers, args.log_interval
        self.versions, self.gradients, self.short_updates = 0, 0, 0

    def get_model(self):
        with self.lock:  # a copy: the trainers' steps must not change it while it is sent
            return copy.deepcopy(self.model)

    @staticmethod
    @rpc.functions.async_execution
    def update_and_fetch_model(ps_rref, grads):
        # the parameter server of this process, from its RRef
        self = ps_rref.local_value()
        with self.lock:
            if self.versions % self.log_interval == 0:
                timed_log(f"PS got {self.curr_update_size}/{self.batch_update_size} updates")
            self.curr_update_size += 1
            self.gradients += 1
            # add the gradients up in the .grad fields
            for p, g in zip(self.model.parameters(), grads, strict=True):
                p.grad += g

            # the future of the next model, kept before another step could replace it
            fut = self.future_model
            self._update_if_all_gradients_are_in()
        return fut

    def _update_if_all_gradients_are_in(self):
        """With self.lock held: one step, once batch_update_size gradients are in (or all that
        the trainers still training can send); the new model answers every waiting trainer."""
        if self.curr_update_size < min(self.batch_update_size, self.trainers_left):
            return
        self.short_updates += self.curr_update_size < self.batch_update_size
        for p in self.model.parameters():
            p.grad /= self.curr_update_size
        self.curr_update_size = 0
        self.optimizer.step()
        # set_to_none=False: the next update adds to .grad, which must stay a tensor
        self.optimizer.zero_grad(set_to_none=False)
        # completing the future answers every waiting trainer, with a copy (see get_model)
        self.future_model.set_result(copy.deepcopy(self.model))
        if self.versions % self.log_interval == 0:
            timed_log("PS updated model")
        self.versions += 1
        self.future_model = torch.futures.Future()

    def trainer_done(self):
        with self.lock:
            self.trainers_left -= 1
            if self.curr_update_size:
                self._update_if_all_gradients_are_in()


# This trainer's data and settings, set by run() before the parameter server calls run_trainer.
trainer_data = None


class Trainer:

    def __init__(self, ps_rref):
        self.ps_rref = ps_rref
        self.train_loader, self.test_loader, self.args = trainer_data
        # the GPU when there is one, as the batch tutorial's trainers (.cuda())
        self.device = torch.device("cuda:0" if torch.cuda.device_count() else "cpu")

    def get_next_batch(self):
        # The same number of batches for every trainer (see equal_share_batches), so that
        # each update of the server gets a gradient from every trainer.
        for _ in range(self.args.epochs):
            for inputs, labels in itertools.islice(self.train_loader, self.args.batches):
                yield inputs.to(self.device), labels.to(self.device)

    def train(self):
        name = rpc.get_worker_info().name
        rank = rpc.get_worker_info().id
        # the initial model, from the parameter server
        m = self.ps_rref.rpc_sync().get_model().to(self.device)
        print(f"{name} trains its copy of the model on {self.device}")
        started = time.perf_counter()
        for i, (inputs, labels) in enumerate(self.get_next_batch()):
            rpc_harness.profile_step()  # not in the tutorial: --profile's window (main.py)
            log = i % self.args.log_interval == 0
            if log:
                timed_log(f"{name} processing one batch")
            loss = F.nll_loss(m(inputs), labels)
            loss.backward()
            if log:
                print(f"Rank {rank} training batch {i} loss {loss.item()}")
                timed_log(f"{name} reporting grads")
            m = rpc.rpc_sync(
                self.ps_rref.owner(),
                BatchUpdateParameterServer.update_and_fetch_model,
                args=(self.ps_rref, [p.grad for p in m.cpu().parameters()]),
            ).to(self.device)
            if log:
                timed_log(f"{name} got updated model")
        train_seconds = time.perf_counter() - started
        self.ps_rref.rpc_sync().trainer_done()
        print("Training complete!")
        print("Getting accuracy....")
        get_accuracy(self.test_loader, m.cpu())
        # not in the tutorial: the summary's figures, and the final weights, to compare
        weights = b"".join(p.detach().cpu().numpy().tobytes() for p in m.parameters())
        rpc_harness.report(batches=i + 1, train_seconds=round(train_seconds, 3),
                           weights=hashlib.sha256(weights).hexdigest())


def run_trainer(ps_rref):
    trainer = Trainer(ps_rref)
    trainer.train()


def run_ps(trainers, args):
    timed_log("Start training")
    ps = BatchUpdateParameterServer(args.batch_update_size or len(trainers), len(trainers), args)
    ps_rref = rpc.RRef(ps)
    futs = []
    for trainer in trainers:
        futs.append(
            rpc.rpc_async(trainer, run_trainer, args=(ps_rref,), timeout=0)
        )

    torch.futures.wait_all(futs)
    timed_log("Finish training")
    rpc_harness.report(batch_update_size=ps.batch_update_size, model_versions=ps.versions,
                       gradients=ps.gradients, short_updates=ps.short_updates)


@rpc_harness.watched  # not in the tutorial: one line when this rank ends early
def run(rank, world_size, args):
    global trainer_data
    # The tutorial's rpc_timeout=0 (none): rpc_harness.options(args) bounds it by --rpc_timeout
    # and meets the ranks as main.py says.
    options = rpc_harness.options(args)
    if rank != 0:
        train_loader, test_loader = get_data_loaders(rank, world_size, args)
        args.batches = equal_share_batches(train_loader, world_size - 1, args)
        trainer_data = (train_loader, test_loader, args)
        rpc.init_rpc(
            f"trainer{rank}",
            rank=rank,
            world_size=world_size,
            rpc_backend_options=options
        )
        # trainer passively waiting for ps to kick off training iterations
    else:
        torch.manual_seed(args.seed)  # the initial model, as main.py's server
        rpc.init_rpc(
            "ps",
            rank=rank,
            world_size=world_size,
            rpc_backend_options=options
        )
        run_ps([f"trainer{r}" for r in range(1, world_size)], args)

    # block until all rpcs finish
    rpc.shutdown()


def worker_name(rank, world_size):
    """Each rank's name in RPC, which the harness's messages use too."""
    return "ps" if rank == 0 else f"trainer{rank}"


def train(rank, world_size):
    """The ranks that compute (the trainers train their copies), which share the cores."""
    return rank != 0


def write_summary(args, reports):
    """main.py's summary, with what the batch-updating server counted."""
    ps = reports.pop("ps")
    identical = len({r["weights"] for r in reports.values()}) == 1
    return write_tutorial_summary(
        args, reports, "batch", {**ps, "identical_final_weights": identical},
        f", {ps['model_versions']} model versions of {ps['batch_update_size']} gradients, final "
        f"weights {'identical' if identical else 'DIFFERENT'}")


def parse_args(argv=None):
    """main.py's command line (the parameter-server tutorial's; the batch tutorial has none),
    with --batch_update_size, checked as main.py checks its own."""
    parser = make_parser(
        "The batch RPC tutorial's parameter server: synchronous steps, each on the gradients "
        "of --batch_update_size trainers.", num_gpus=False)
    # No --num_gpus: the server's Net is on the CPU. check_args reads the value, so it is 0.
    parser.set_defaults(num_gpus=0)
    add_step_arguments(parser)
    parser.add_argument("--batch_update_size", type=rpc_harness.int_at_least(1), default=None,
                        metavar="N", help="gradients in each step (default: the number of "
                                          "trainers)")
    args = parser.parse_args(argv)
    check_args(parser, args, worker_name, computes=train, summary=write_summary)
    trainers = args.world_size - 1
    if (args.batch_update_size or 0) > trainers:
        parser.error(f"--batch_update_size {args.batch_update_size} is more than the "
                     f"{trainers} trainer(s) of a world of {args.world_size}")
    if args.lr is None:  # a batch step takes the place of batch_update_size steps
        args.lr = 0.03 * (args.batch_update_size or trainers)
    return args


if __name__ == "__main__":
    args = parse_args()
    os.environ["MASTER_ADDR"] = args.master_addr
    os.environ["MASTER_PORT"] = str(args.master_port)
    # Not in the tutorial: when a rank fails or is killed, or on Ctrl-C or SIGTERM, this
    # command stops the ranks it started and says why in one line.
    rpc_harness.supervise(args)
    mp.set_start_method("spawn")

    processes = []
    if args.rank is None:
        mp.spawn(run, args=(args.world_size, args), nprocs=args.world_size, join=True)
    else:
        # Not in this tutorial: the one rank that --rank (or torchrun) names, in a process of
        # its own, as the parameter-server tutorial starts its ranks.
        p = mp.Process(target=run, args=(args.rank, args.world_size, args))
        p.start()
        processes.append(p)
        for p in processes:
            p.join()
        # Not in the tutorial: the rank's exit status is the command's; rpc_harness.exit_status
        # says, in one line, when a signal killed the rank (which then could not say it).
        sys.exit(rpc_harness.exit_status(p))
