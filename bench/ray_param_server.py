"""The program a user would pick instead of RPC or Monarch for a synchronous parameter server:
Ray Core's "Parameter Server" example (its synchronous training), on param_server's Net,
synthetic digits, batch size, learning rate and number of trainers, so that bench.py can put it
in the rows of the same tables.

As in Ray's example: a ParameterServer actor holds the model and the optimizer; DataWorker
actors, one a trainer, each compute a gradient from the weights they are handed; the driver
(this command) loops: every worker's gradient from the current weights, then the server's step
on all of them, whose new weights go to the next round. The weights travel as one Ray object,
put once in the object store and read by each worker. Two differences from Ray's example, both
batch.py's: the server averages the gradients (Ray's sums them) at batch.py's learning rate,
0.03 times the number of trainers; and each worker trains on its own share of the data
(param_server/data.py), as batch.py's trainers do.

Ray is installed for `make bench` only (bench/requirements-ray.txt). Prints when training starts
and ends, and a summary line; writes the run's figures to --summary_json.

    python bench/ray_param_server.py --trainers 3 --max_batches 20 --summary_json ray.json
"""

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import ray
import torch
import torch.nn.functional as F
from torch import optim

PARAM_SERVER = Path(__file__).resolve().parent.parent / "param_server"
# The Net and the data of param_server, in this process and (PYTHONPATH, which Ray's workers
# inherit) in every worker.
sys.path.insert(0, str(PARAM_SERVER))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PARAM_SERVER),
                                                         os.environ.get("PYTHONPATH")]))
from data import equal_share_batches, get_data_loaders  # noqa: E402
from main import Net  # noqa: E402


def peak_memory_mb():
    """This process's most resident memory so far, in MB, as the programs of param_server
    report theirs."""
    return {"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}


def get_weights(model):
    return {name: tensor.cpu() for name, tensor in model.state_dict().items()}


@ray.remote
class ParameterServer:
    def __init__(self, lr, seed):
        torch.manual_seed(seed)  # the initial model, as batch.py's server
        self.model = Net()
        self.optimizer = optim.SGD(self.model.parameters(), lr=lr)

    def apply_gradients(self, *gradients):
        # The mean of the workers' gradients (Ray's example sums them), as batch.py's server.
        mean = [torch.stack(together).mean(dim=0) for together in zip(*gradients, strict=True)]
        self.optimizer.zero_grad()
        for p, g in zip(self.model.parameters(), mean, strict=True):
            p.grad = g
        self.optimizer.step()
        return get_weights(self.model)

    def get_weights(self):
        return get_weights(self.model)

    def peak_memory_mb(self):
        return peak_memory_mb()


@ray.remote
class DataWorker:
    def __init__(self, rank, world_size, args):
        self.model = Net()
        self.train_loader, _ = get_data_loaders(rank, world_size, args)
        self.batches = equal_share_batches(self.train_loader, world_size - 1, args)
        self.data_iterator = iter(self.train_loader)

    def ready(self):
        """How many batches this worker has (batch.py's equal share), and its torch threads."""
        return self.batches, torch.get_num_threads()

    def compute_gradients(self, weights):
        self.model.load_state_dict(weights)
        try:
            data, target = next(self.data_iterator)
        except StopIteration:  # the next epoch
            self.data_iterator = iter(self.train_loader)
            data, target = next(self.data_iterator)
        self.model.zero_grad()
        loss = F.nll_loss(self.model(data), target)
        loss.backward()
        return [p.grad for p in self.model.parameters()]

    def peak_memory_mb(self):
        return peak_memory_mb()


def evaluate(weights, args):
    """The final model's accuracy on the synthetic test digits, as param_server's trainers
    measure theirs."""
    model = Net()
    model.load_state_dict(weights)
    model.eval()
    _, test_loader = get_data_loaders(1, 2, args)
    correct = 0
    with torch.no_grad():
        for data, target in test_loader:
            correct += model(data).argmax(dim=1).eq(target).sum().item()
    return correct / len(test_loader.dataset)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainers", type=int, default=3, help="DataWorker actors")
    parser.add_argument("--max_batches", type=int, default=None,
                        help="batches a trainer, as param_server's --max_batches")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--lr", type=float, default=None,
                        help="SGD learning rate (default: 0.03 times --trainers, as batch.py's)")
    parser.add_argument("--summary_json", default=None)
    args = parser.parse_args(argv)
    args.dataset = "synthetic"
    args.epochs = 1
    lr = args.lr or 0.03 * args.trainers
    world_size = args.trainers + 1

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    try:
        ps = ParameterServer.remote(lr, args.seed)
        workers = [DataWorker.remote(rank, world_size, args) for rank in range(1, world_size)]
        ready = ray.get([worker.ready.remote() for worker in workers])
        iterations = min(batches for batches, _ in ready)
        current_weights = ps.get_weights.remote()
        ray.get(current_weights)
        # The clock starts once every actor is up, as batch.py's trainers start theirs.
        print(f"Ray: training, {args.trainers} worker(s)", flush=True)
        started = time.perf_counter()
        for _ in range(iterations):
            gradients = [worker.compute_gradients.remote(current_weights) for worker in workers]
            current_weights = ps.apply_gradients.remote(*gradients)
        weights = ray.get(current_weights)
        seconds = time.perf_counter() - started
        print("Ray: trained", flush=True)
        memory = {"parameter_server": ray.get(ps.peak_memory_mb.remote())}
        for rank, worker in enumerate(workers, start=1):
            memory[f"worker{rank}"] = ray.get(worker.peak_memory_mb.remote())
        memory["driver"] = peak_memory_mb()
    finally:
        ray.shutdown()
    samples = iterations * args.trainers * args.batch_size
    summary = {"example": "param_server", "mode": "ray", "trainers": args.trainers,
               "model_versions": iterations, "train_seconds": round(seconds, 3),
               "samples_per_second": round(samples / seconds, 1),
               "accuracy": evaluate(weights, args), "lr": lr,
               "threads_per_worker": sorted({threads for _, threads in ready}),
               "ray": ray.__version__, "peak_memory_mb": memory}
    print(f"Summary: Ray, {args.trainers} trainer(s), {iterations} model versions, "
          f"{summary['samples_per_second']:.1f} samples/s, accuracy {summary['accuracy']:.4f}")
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
