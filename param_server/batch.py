"""The batch-updating parameter server of the tutorial "Implementing Batch RPC Processing Using
Asynchronous Executions", runnable, training main.py's Net on the same data.

Synchronous, where main.py's server is not: every trainer trains a copy of the model fetched
from the server and sends its gradients with update_and_fetch_model, an
`@rpc.functions.async_execution` function that returns a future of the next model at once,
freeing its RPC thread; once batch_update_size gradients are in, the server averages them, takes
one optimizer step and completes the future, which answers every waiting trainer with the new
model. README.md compares the two ways.

Built from the page's section "Batch-Updating Parameter Server" and, for what the page leaves
out (the launch, timed_log), the pytorch/examples script distributed/rpc/batch/parameter_server.py
(README.md names the revisions). Each line that is neither ends with "# ours:" and why.

    python batch.py --dataset synthetic             # a server and 3 trainers
"""

import copy  # ours: copies of the model, to send (get_model)
import hashlib  # ours: a digest of each trainer's final weights, for the summary
import itertools  # ours: the same number of batches for every trainer
import os
import sys  # ours: the command's exit status
import threading
import time  # ours: the summary's training time
from datetime import datetime

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn.functional as F  # ours: nll_loss, as main.py's Net ends in log_softmax
from torch import optim

try:  # ours: this project's package, or one line that says how to install it
    import rpc_harness
except ModuleNotFoundError:  # ours: (above)
    raise SystemExit("rpc_harness, this project's package, is missing: install it with "
                     "`pip install -e PATH`, PATH being the repository's folder (the one that "
                     "holds pyproject.toml), or run `make run` there") from None

from data import equal_share_batches, get_data_loaders  # ours: main.py's data, a share each
from extras import add_step_arguments, check_args  # ours: this project's flags and checks
from extras import write_summary as write_tutorial_summary  # ours: the run's summary
from main import Net, get_accuracy, make_parser  # ours: main.py's model, test and flags


def timed_log(text):
    print(f"{datetime.now().strftime('%H:%M:%S')} {text}")


class BatchUpdateParameterServer:  # ours: no (object), which Python 3 implies

    def __init__(self, batch_update_size, num_trainers, args):  # ours: no default; the flags
        self.model = Net()  # ours: main.py's Net, not a ResNet-50 on random images
        self.lock = threading.Lock()
        self.future_model = torch.futures.Future()
        self.batch_update_size = batch_update_size
        self.curr_update_size = 0
        # ours: plain SGD, as main.py's (the page's: lr=0.001, momentum=0.9), so that the two
        # ways compare; --lr is 0.03 x batch_update_size, as a step averages that many gradients
        self.optimizer = optim.SGD(self.model.parameters(), lr=args.lr)  # ours: (above)
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)
        # ours: the trainers still training, so that with a batch_update_size below the number
        # of trainers the last ones do not wait for gradients that will never come; what the
        # summary reports
        self.trainers_left, self.log_interval = num_trainers, args.log_interval  # ours: (above)
        self.versions, self.gradients, self.short_updates = 0, 0, 0  # ours: (above)

    def get_model(self):
        # ours: a copy, made under the lock, as the trainers' steps must not change the model
        # while it is sent (the page returns self.model)
        with self.lock:
            return copy.deepcopy(self.model)

    @staticmethod
    @rpc.functions.async_execution
    def update_and_fetch_model(ps_rref, grads):
        # the parameter server of this process, from its RRef
        self = ps_rref.local_value()
        # ours: the lock taken first: the page adds the gradients up before it, where two
        # trainers' += can interleave, or land between the step and zero_grad, and be lost
        with self.lock:
            # ours: the script's log line, once every --log_interval model versions
            if self.versions % self.log_interval == 0:  # ours: (above)
                timed_log(f"PS got {self.curr_update_size}/{self.batch_update_size} updates")
            self.curr_update_size += 1
            self.gradients += 1  # ours: the summary's count
            # add the gradients up in the .grad fields
            for p, g in zip(self.model.parameters(), grads, strict=True):  # ours: strict
                p.grad += g

            # the future of the next model, kept before another step could replace it
            fut = self.future_model
            # ours: the page's step, in a method that trainer_done calls too
            self._update_if_all_gradients_are_in()  # ours: (above)
        return fut

    # ours: the page's `if self.curr_update_size >= self.batch_update_size:` block, as a method
    def _update_if_all_gradients_are_in(self):
        """With self.lock held: one step, once batch_update_size gradients are in (or all that
        the trainers still training can send); the new model answers every waiting trainer."""
        # ours: the page's test (`>= self.batch_update_size`), met with fewer gradients once
        # fewer trainers are left
        if self.curr_update_size < min(self.batch_update_size, self.trainers_left):
            return
        self.short_updates += self.curr_update_size < self.batch_update_size  # ours: summary's
        # ours: divided by the gradients that came (the page: by batch_update_size)
        for p in self.model.parameters():
            p.grad /= self.curr_update_size  # ours: (above)
        self.curr_update_size = 0
        self.optimizer.step()
        # ours: set_to_none=False, as in the script: the next update adds to .grad, which must
        # stay a tensor (on today's torch, the page's zero_grad() sets it to None)
        self.optimizer.zero_grad(set_to_none=False)  # ours: (above)
        # completing the future answers every waiting trainer
        # ours: a copy, as get_model's (the page: fut.set_result(self.model))
        self.future_model.set_result(copy.deepcopy(self.model))
        if self.versions % self.log_interval == 0:  # ours: the script's line, as above
            timed_log("PS updated model")
        self.versions += 1  # ours: the summary's count
        self.future_model = torch.futures.Future()

    # ours: a trainer that is done says so, and a step waits for the gradients of the others
    def trainer_done(self):
        with self.lock:
            self.trainers_left -= 1
            if self.curr_update_size:
                self._update_if_all_gradients_are_in()


# ours: this trainer's data and flags, set by run() before the parameter server calls
# run_trainer (the page's trainers make random images as they go)
trainer_data = None  # ours: (above)


class Trainer:  # ours: no (object), which Python 3 implies

    def __init__(self, ps_rref):
        self.ps_rref = ps_rref  # ours: no MSELoss (nll_loss, below)
        self.train_loader, self.test_loader, self.args = trainer_data  # ours: main.py's data
        # ours: the GPU when there is one, else the CPU (the page's trainers call .cuda())
        self.device = torch.device("cuda:0" if torch.cuda.device_count() else "cpu")  # ours

    def get_next_batch(self):
        # ours: main.py's data (the page's: 6 batches of random images), the same number of
        # batches for every trainer (equal_share_batches), so that each update of the server
        # gets a gradient from every trainer
        for _ in range(self.args.epochs):  # ours: (above)
            for inputs, labels in itertools.islice(self.train_loader, self.args.batches):  # ours
                yield inputs.to(self.device), labels.to(self.device)  # ours: .to, not .cuda()

    def train(self):
        name = rpc.get_worker_info().name
        rank = rpc.get_worker_info().id  # ours: for main.py's log line
        # the initial model, from the parameter server
        m = self.ps_rref.rpc_sync().get_model().to(self.device)  # ours: .to, not .cuda()
        print(f"{name} trains its copy of the model on {self.device}")  # ours: where it trains
        started = time.perf_counter()  # ours: the summary's training time
        for i, (inputs, labels) in enumerate(self.get_next_batch()):  # ours: i, for the logs
            rpc_harness.profile_step()  # ours: --profile's window; nothing without --profile
            # ours: the script's log lines, and main.py's loss, every --log_interval batches
            log = i % self.args.log_interval == 0  # ours: (above)
            if log:  # ours: (above)
                timed_log(f"{name} processing one batch")
            loss = F.nll_loss(m(inputs), labels)  # ours: main.py's loss (the page's: MSELoss)
            loss.backward()  # ours: (above)
            if log:  # ours: (above)
                print(f"Rank {rank} training batch {i} loss {loss.item()}")  # ours: (above)
                timed_log(f"{name} reporting grads")
            m = rpc.rpc_sync(
                self.ps_rref.owner(),
                BatchUpdateParameterServer.update_and_fetch_model,
                args=(self.ps_rref, [p.grad for p in m.cpu().parameters()]),
            ).to(self.device)  # ours: .to, not .cuda()
            if log:  # ours: (above)
                timed_log(f"{name} got updated model")
        # ours: the end of a trainer: it says it is done (trainer_done), tests its final model
        # as main.py's trainers do, and reports the summary's figures and a digest of its
        # final weights, which must be every trainer's
        train_seconds = time.perf_counter() - started
        self.ps_rref.rpc_sync().trainer_done()
        print("Training complete!")
        print("Getting accuracy....")
        get_accuracy(self.test_loader, m.cpu())
        weights = b"".join(p.detach().cpu().numpy().tobytes() for p in m.parameters())
        rpc_harness.report(batches=i + 1, train_seconds=round(train_seconds, 3),
                           weights=hashlib.sha256(weights).hexdigest())


def run_trainer(ps_rref):
    trainer = Trainer(ps_rref)
    trainer.train()


def run_ps(trainers, args):  # ours: args, the flags
    timed_log("Start training")
    # ours: the server, kept, to report its figures; --batch_update_size, by default every
    # trainer (the script's: 5 trainers, and a batch of 5)
    ps = BatchUpdateParameterServer(args.batch_update_size or len(trainers), len(trainers), args)
    ps_rref = rpc.RRef(ps)  # ours: (above)
    futs = []
    for trainer in trainers:
        futs.append(
            # ours: timeout=0, no time limit on training (the script's rpc_timeout=0, below)
            rpc.rpc_async(trainer, run_trainer, args=(ps_rref,), timeout=0)
        )

    torch.futures.wait_all(futs)
    timed_log("Finish training")
    # ours: the server's figures, for the run's summary
    rpc_harness.report(batch_update_size=ps.batch_update_size, model_versions=ps.versions,
                       gradients=ps.gradients, short_updates=ps.short_updates)


@rpc_harness.watched  # ours: this rank ends in one line if it fails or loses a peer
def run(rank, world_size, args):  # ours: args, the flags
    global trainer_data  # ours: (trainer_data, above)
    # ours: the script's options (16 threads, rpc_timeout=0, no time limit) become this
    # project's: --rpc_timeout bounds each call, and the ranks meet as main.py's do
    options = rpc_harness.options(args)  # ours: (above)
    if rank != 0:
        # ours: the trainer's data, made before it joins, so that training starts at once
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
        torch.manual_seed(args.seed)  # ours: the initial model, as main.py's server
        rpc.init_rpc(
            "ps",
            rank=rank,
            world_size=world_size,
            rpc_backend_options=options
        )
        run_ps([f"trainer{r}" for r in range(1, world_size)], args)  # ours: args

    # block until all rpcs finish
    rpc.shutdown()


# --------- ours: what the harness needs, the run's summary, and the launch ---------

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


# ours: the command line (the batch tutorial and its script have none)
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
    # ours: main.py's launcher. The script's is one line, mp.spawn(run, args=(world_size, ),
    # nprocs=world_size, join=True), for 6 ranks (batch_update_size + 1), and its run() sets
    # MASTER_ADDR and MASTER_PORT to 'localhost' and '29500'.
    args = parse_args()
    os.environ["MASTER_ADDR"] = args.master_addr
    os.environ["MASTER_PORT"] = str(args.master_port)
    # When a rank fails or is killed, or on Ctrl-C or SIGTERM, this command stops the ranks it
    # started and says why in one line.
    rpc_harness.supervise(args)
    mp.set_start_method("spawn")  # --rank's process starts afresh, as mp.spawn's

    processes = []
    if args.rank is None:
        mp.spawn(run, args=(args.world_size, args), nprocs=args.world_size, join=True)
    else:
        # the one rank that --rank (or torchrun) names, in a process of its own, as the
        # parameter-server tutorial starts its ranks
        p = mp.Process(target=run, args=(args.rank, args.world_size, args))
        p.start()
        processes.append(p)
        for p in processes:
            p.join()
        # The rank's exit status is the command's; rpc_harness.exit_status says, in one line,
        # when a signal killed the rank (which then could not say it).
        sys.exit(rpc_harness.exit_status(p))
