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
(README.md names the revisions). Each line that is neither ends with "# ours:" and why, or sits
under a "# ours:" comment.

    python batch.py --dataset synthetic             # a server and 3 trainers
"""

import argparse  # ours: the command line (the page and the script have none)
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

import extras  # ours: this project's flags and checks, --profile, the summary
from data import equal_share_batches, get_data_loaders  # ours: main.py's data, a share each
from main import Net, get_accuracy  # ours: main.py's model and its test


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
        self.optimizer = optim.SGD(self.model.parameters(), lr=args.lr)
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)
        # ours: the trainers still training, so that with a batch_update_size below the number
        # of trainers the last ones do not wait for gradients that will never come; what the
        # summary reports
        self.trainers_left, self.log_interval = num_trainers, args.log_interval
        self.versions, self.gradients, self.short_updates = 0, 0, 0

    def get_model(self):
        # ours: a copy, made under the lock, as the trainers' steps must not change the model
        # while it is sent (the page returns self.model)
        with self.lock:
            return copy.deepcopy(self.model)

    @staticmethod
    @rpc.functions.async_execution
    def update_and_fetch_model(ps_rref, grads):
        self = ps_rref.local_value()
        # ours: the lock taken first: the page adds the gradients up before it, where two
        # trainers' += can interleave, or land between the step and zero_grad, and be lost
        with self.lock:
            # ours: the script's log line, once every --log_interval model versions
            if self.versions % self.log_interval == 0:
                timed_log(f"PS got {self.curr_update_size}/{self.batch_update_size} updates")
            self.curr_update_size += 1
            self.gradients += 1  # ours: the summary's count
            for p, g in zip(self.model.parameters(), grads, strict=True):  # ours: strict
                p.grad += g

            fut = self.future_model
            # ours: the page's step, in a method that trainer_done calls too
            self._update_if_all_gradients_are_in()

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
        for p in self.model.parameters():
            p.grad /= self.curr_update_size  # ours: the gradients that came (the page: all)
        self.curr_update_size = 0
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)
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
trainer_data = None


class Trainer:  # ours: no (object), which Python 3 implies

    def __init__(self, ps_rref):
        self.ps_rref = ps_rref  # ours: no MSELoss (nll_loss, below)
        self.train_loader, self.test_loader, self.args = trainer_data  # ours: main.py's data
        # ours: the GPU when there is one, else the CPU (the page's trainers call .cuda())
        self.device = torch.device("cuda:0" if torch.cuda.device_count() else "cpu")

    def get_next_batch(self):
        # ours: main.py's data (the page's: 6 batches of random images), the same number of
        # batches for every trainer (equal_share_batches), so that each update of the server
        # gets a gradient from every trainer
        for _ in range(self.args.epochs):
            for inputs, labels in itertools.islice(self.train_loader, self.args.batches):
                yield inputs.to(self.device), labels.to(self.device)

    def train(self):
        name = rpc.get_worker_info().name
        rank = rpc.get_worker_info().id  # ours: for main.py's log line
        m = self.ps_rref.rpc_sync().get_model().to(self.device)  # ours: .to, not .cuda()
        print(f"{name} trains its copy of the model on {self.device}")  # ours: where it trains
        prof = extras.profiler(self.args, name, rank)  # ours: --profile: steps 3 to 5
        started = time.perf_counter()  # ours: the summary's training time
        for i, (inputs, labels) in enumerate(self.get_next_batch()):  # ours: i, for the logs
            # ours: the script's log lines, and main.py's loss, every --log_interval batches
            log = i % self.args.log_interval == 0
            if log:
                timed_log(f"{name} processing one batch")
            loss = F.nll_loss(m(inputs), labels)  # ours: main.py's loss (the page's: MSELoss)
            loss.backward()  # ours: (the line above, split)
            if log:  # ours: the logs, as above
                print(f"Rank {rank} training batch {i} loss {loss.item()}")
                timed_log(f"{name} reporting grads")
            m = rpc.rpc_sync(
                self.ps_rref.owner(),
                BatchUpdateParameterServer.update_and_fetch_model,
                args=(self.ps_rref, [p.grad for p in m.cpu().parameters()]),
            ).to(self.device)  # ours: .to, not .cuda()
            if log:  # ours: the logs, as above
                timed_log(f"{name} got updated model")
            prof.step()  # ours: --profile's steps
        # ours: the end of a trainer: --profile's trace if it had fewer than 5 steps; it says it
        # is done (trainer_done), tests its final model as main.py's trainers do, and sends the
        # summary's figures and a digest of its final weights, which must be every trainer's
        prof.stop()
        train_seconds = time.perf_counter() - started
        self.ps_rref.rpc_sync().trainer_done()
        print("Training complete!")
        print("Getting accuracy....")
        accuracy = get_accuracy(self.test_loader, m.cpu())
        weights = b"".join(p.detach().cpu().numpy().tobytes() for p in m.parameters())
        extras.measured.update(accuracy=accuracy, batches=i + 1, train_seconds=train_seconds,
                               weights=hashlib.sha256(weights).hexdigest())
        rpc.rpc_sync(self.ps_rref.owner(), extras.report, args=(name, extras.figures()))


def run_trainer(ps_rref):
    trainer = Trainer(ps_rref)
    trainer.train()


def run_ps(trainers, args):  # ours: args, the flags
    timed_log("Start training")
    # ours: the server, kept, to report its figures; --batch_update_size, by default every
    # trainer (the script's: 5 trainers, and a batch of 5)
    ps = BatchUpdateParameterServer(args.batch_update_size or len(trainers), len(trainers), args)
    ps_rref = rpc.RRef(ps)
    futs = []
    for trainer in trainers:
        futs.append(
            rpc.rpc_async(trainer, run_trainer, args=(ps_rref,), timeout=0)  # ours: (run())
        )

    torch.futures.wait_all(futs)
    timed_log("Finish training")
    # ours: the server's figures, for the run's summary
    extras.report("ps", {"batch_update_size": ps.batch_update_size,
                         "model_versions": ps.versions, "gradients": ps.gradients,
                         "short_updates": ps.short_updates})


def run(rank, world_size, args):  # ours: args, the flags
    global trainer_data  # ours: (trainer_data, above)
    torch.manual_seed(args.seed)  # ours: --seed: the model's first weights, the data's order
    os.environ['MASTER_ADDR'] = args.master_addr  # ours: the flag (the script: 'localhost')
    os.environ['MASTER_PORT'] = args.master_port  # ours: the flag (the script: '29500')
    # ours: without the script's rpc_timeout=0 (no time limit), which today's torch also takes
    # as the join's: a rank not there at once fails it ("wait timeout after 0ms"). Training has
    # no time limit still: timeout=0 on the call that starts each trainer (run_ps).
    options=rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=16,
     )
    if rank != 0:
        # ours: the trainer's data and --profile, before it joins, so that training starts at
        # once when the parameter server calls run_trainer
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
        prof = extras.profiler(args, "ps", rank, loops=False)  # ours: --profile
        rpc.init_rpc(
            "ps",
            rank=rank,
            world_size=world_size,
            rpc_backend_options=options
        )
        run_ps([f"trainer{r}" for r in range(1, world_size)], args)  # ours: args

    store = extras.hold_store(args, rank)  # ours: rank 0's store, kept for rpc.shutdown()
    # block until all rpcs finish
    rpc.shutdown()
    extras.release_store(args, rank, store)  # ours: (extras.hold_store says why)
    # ours: the parameter server's --profile trace, and the run's last line
    if rank == 0:
        prof.stop()
        extras.print_summary(args, "ps", write_summary)


# --------- ours: the run's summary, and the command line (the page and the script have none) --

def write_summary(args, reports):
    """main.py's summary, with what the batch-updating server counted."""
    ps = reports.pop("ps")
    identical = len({r.pop("weights") for r in reports.values()}) == 1
    return extras.write_summary(
        args, reports, "batch", {**ps, "identical_final_weights": identical},
        f", {ps['model_versions']} model versions of {ps['batch_update_size']} gradients, final "
        f"weights {'identical' if identical else 'DIFFERENT'}")


def parse_args(argv=None):
    """main.py's command line (the parameter-server tutorial's; the batch tutorial has none),
    without --num_gpus (this server's model stays on the CPU), with --lr and
    --batch_update_size, checked as main.py checks its own."""
    parser = argparse.ArgumentParser(
        description="The batch RPC tutorial's parameter server: synchronous steps, each on the "
                    "gradients of --batch_update_size trainers.")
    parser.add_argument("--world_size", "--world-size", type=int, default=4,
                        help="processes: the parameter server and the trainers")
    parser.add_argument("--rank", type=int, default=None,
                        help="this process's rank (0: the parameter server); unset: every rank")
    parser.add_argument("--master_addr", "--master-addr", type=str, default="localhost",
                        help="the address of rank 0")
    parser.add_argument("--master_port", "--master-port", type=str, default="29500",
                        help="the port of rank 0")
    extras.add_arguments(parser)
    extras.add_step_arguments(parser)
    parser.add_argument("--batch_update_size", "--batch-update-size", type=extras.at_least(1),
                        metavar="N", help="gradients in each step (unset: the number of "
                                          "trainers)")
    args = parser.parse_args(argv)
    extras.check_args(parser, args)
    trainers = args.world_size - 1
    if (args.batch_update_size or 0) > trainers:
        parser.error(f"--batch_update_size {args.batch_update_size} is more than the "
                     f"{trainers} trainer(s) of a world of {args.world_size}")
    if args.lr is None:  # a batch step takes the place of batch_update_size steps
        args.lr = 0.03 * (args.batch_update_size or trainers)
    return args


if __name__=="__main__":
    # ours: main.py's launch. The script's is one line, mp.spawn(run, args=(world_size, ),
    # nprocs=world_size, join=True), for 6 ranks (batch_update_size + 1): without --rank, it is
    # the same line; with --rank (or torchrun), that one rank, as main.py starts it
    args = parse_args()
    mp.set_start_method("spawn")
    world_size = args.world_size
    if args.rank is None:
        mp.spawn(run, args=(world_size, args), nprocs=world_size, join=True)
    else:
        p = mp.Process(target=run, args=(args.rank, world_size, args))
        p.start()
        p.join()
        # the rank's exit status is the command's (killed by signal N: 128 + N, as a shell
        # shows it)
        sys.exit(p.exitcode if p.exitcode >= 0 else 128 - p.exitcode)
