"""One RPC round trip of a CUDA tensor between two processes, staged through the CPU against
sent through a device map, for tensors of 1 MB to 256 MB. Writes bench/CUDA-RPC.md.

    python bench/cuda_roundtrip.py                 # on a machine with a GPU
    python bench/cuda_roundtrip.py --repeats 5 --output /tmp/CUDA-RPC.md

worker0 holds a float32 tensor on its GPU and sends it to worker1, which sends it back:

- staged through the CPU (what RPC needed before device maps; the recipe's "cpu" mode):
  worker0 calls `.cpu()` before `rpc_sync`; worker1 moves the tensor to its GPU and back to the
  CPU (`.to(device).cpu()`); worker0 moves the reply to its GPU (`.to(device)`);
- device map (the recipe's "cuda" mode): worker0 sends the GPU tensor itself; it arrives on
  worker1's GPU, which returns it; the reply arrives on worker0's GPU through the inverse map.

Each round trip is timed alone, from worker0's GPU idle to worker0's GPU done with the reply
(`torch.cuda.synchronize`); the two ways alternate, so that noise hits both alike; the page
shows the median of --repeats per size, and the lowest. Two GPUs: worker0 on cuda:0, worker1 on
cuda:1, the recipe's map {0: 1}. One GPU: both on cuda:0, map {0: 0}. Without CUDA there is
nothing to measure: one line, status 2.
"""

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp

BENCH = Path(__file__).resolve().parent
MB = 2**20
SIZES_MB = [1, 4, 16, 64, 256]
RECIPE = ("https://github.com/pytorch/tutorials/blob/38750027aceb01ffa15098cf8efe74bef9963753/"
          "recipes_source/cuda_rpc.rst")
RECIPE_CLAIM = ("Outputs are displayed below, which shows that CUDA RPC can help to achieve 34X "
                "speed up compared to CPU RPC in this experiment.")
RECIPE_OUTPUT = ["cpu RPC total execution time: 2.3145179748535156 Seconds",
                 "cuda RPC total execution time: 0.06867480278015137 Seconds"]


def echo(tensor):
    """worker1, device map: the tensor arrived on its GPU; back as it is."""
    return tensor


def staged_echo(tensor, device):
    """worker1, staged: the CPU tensor to its GPU, as the recipe's module does with its input,
    and back to the CPU, as its "cpu" mode does with its output."""
    return tensor.to(device).cpu()


def devices(gpu_count):
    """(worker0's device, worker1's device, the device map): the recipe's {0: 1} on two GPUs or
    more, both on cuda:0 with {0: 0} on one."""
    return ("cuda:0", "cuda:1", {0: 1}) if gpu_count >= 2 else ("cuda:0", "cuda:0", {0: 0})


def measure(size_mb, repeats, local, remote, peer="worker1"):
    """worker0: {"staged": [s a round trip, ...], "device map": [...]} for one size, with the
    worker `peer` (the tests: this process, on the CPU)."""
    tensor = torch.rand(size_mb * MB // 4, device=local)

    def staged():
        return rpc.rpc_sync(peer, staged_echo, args=(tensor.cpu(), remote)).to(local)

    def mapped():
        return rpc.rpc_sync(peer, echo, args=(tensor,))

    ways = {"staged": staged, "device map": mapped}
    for way, call in ways.items():  # warm up, and check that the tensor came back whole
        for _ in range(2):
            reply = call()
        torch.cuda.synchronize(local)
        if reply.device != tensor.device or not torch.equal(reply, tensor):
            raise SystemExit(f"cuda_roundtrip.py: {way}: the reply differs from the tensor sent "
                             f"(on {reply.device})")
    times = {way: [] for way in ways}
    for _ in range(repeats):
        for way, call in ways.items():
            torch.cuda.synchronize(local)
            started = time.perf_counter()
            call()
            torch.cuda.synchronize(local)
            times[way].append(time.perf_counter() - started)
    return times


def worker(rank, args, port, result_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TP_SOCKET_IFNAME="lo", GLOO_SOCKET_IFNAME="lo")
    local, remote, device_map = devices(torch.cuda.device_count())
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=16)
    if rank == 0:
        options.set_device_map("worker1", device_map)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    if rank == 0:
        results = {}
        for size in args.sizes:
            results[size] = times = measure(size, args.repeats, local, remote)
            print(f"{size} MB: staged {statistics.median(times['staged']) * 1e3:.2f} ms, device "
                  f"map {statistics.median(times['device map']) * 1e3:.2f} ms (medians)",
                  flush=True)
        Path(result_path).write_text(json.dumps(results))
    rpc.shutdown()


def machine():
    """The machine, named: system, CPU, cores, GPUs, Python, torch and its CUDA."""
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")),
               platform.processor())
    gpus = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    return (f"{platform.system()} {platform.machine()}, {cpu}, "
            f"{len(os.sched_getaffinity(0))} cores; {gpus}; Python {platform.python_version()}, "
            f"torch {torch.__version__} (CUDA {torch.version.cuda})")


def page(results, repeats, seconds, machine_name, gpu_count, when):
    """bench/CUDA-RPC.md's text, from {size in MB: {"staged": [s, ...], "device map": [...]}}."""
    local, remote, device_map = devices(gpu_count)
    where = (f"worker0 on {local}, worker1 on {remote}, the recipe's device map {device_map}"
             if local != remote else
             f"one GPU: worker0 and worker1 both on {local}, device map {device_map}")
    lines = [
        "# CUDA RPC: one round trip of a CUDA tensor", "",
        f"Written by `python bench/cuda_roundtrip.py` on {when}: {repeats} round trips of each "
        f"size each way, {seconds:.0f} s in all. Machine: {machine_name}.", "",
        f"Two processes of this machine, {where}. worker0 sends a float32 tensor from its GPU "
        "to worker1 with `rpc_sync`, and worker1 sends it back. Staged through the CPU: "
        "`.cpu()` before the call, `.to(device).cpu()` in worker1, `.to(device)` after the "
        "call, as RPC needed before device maps (the recipe's \"cpu\" mode). Device map: the GPU "
        "tensor itself, both ways (the recipe's \"cuda\" mode). Each round trip is timed alone, "
        "from worker0's GPU idle to the reply on worker0's GPU; the two ways alternate.", "",
        "| Tensor | staged through the CPU, median (lowest) | device map, median (lowest) | "
        "staged / device map |",
        "|---|---|---|---|"]
    for size, times in results.items():
        staged, mapped = statistics.median(times["staged"]), statistics.median(times["device map"])
        lines.append(f"| {size} MB | {staged * 1e3:.2f} ms ({min(times['staged']) * 1e3:.2f}) | "
                     f"{mapped * 1e3:.2f} ms ({min(times['device map']) * 1e3:.2f}) | "
                     f"{staged / mapped:.1f} |")
    lines += [
        "", f"The recipe's own claim ([cuda_rpc.rst]({RECIPE})), after its sample output:", "",
        f"> {RECIPE_CLAIM}", "", "```text", *RECIPE_OUTPUT, "```", "",
        "The recipe's experiment is not a round trip alone: 10 forward and backward passes of "
        "two 1000 x 1000 linear layers, one on each worker, the staged way first. "
        "`rpc.remote` returns before worker1 has built its module, so worker1's CUDA start-up "
        "can fall inside the first mode's time, and so does cuBLAS's start on each worker. "
        "`cuda_rpc/main.py` runs that experiment, with one untimed pass first in each mode."]
    return "\n".join(lines) + "\n"


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--repeats", type=int, default=11,
                        help="timed round trips of each size, each way")
    parser.add_argument("--sizes", type=int, nargs="+", default=SIZES_MB, metavar="MB",
                        help="tensor sizes in MB")
    parser.add_argument("--port", type=int, default=None,
                        help="where the two processes meet (default: a free port)")
    parser.add_argument("--output", type=Path, default=BENCH / "CUDA-RPC.md",
                        help="the page to write")
    args = parser.parse_args(argv)
    gpu_count = torch.cuda.device_count()
    if gpu_count == 0:
        print(f"cuda_roundtrip.py: no GPU here (torch {torch.__version__} sees none): a CUDA "
              "tensor's round trip cannot be measured on this machine", file=sys.stderr)
        sys.exit(2)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        result_path = Path(folder) / "results.json"
        mp.spawn(worker, args=(args, args.port or free_port(), str(result_path)), nprocs=2)
        results = {int(size): times for size, times in
                   json.loads(result_path.read_text()).items()}
    text = page(results, args.repeats, time.perf_counter() - started, machine(), gpu_count,
                time.strftime("%Y-%m-%d"))
    args.output.write_text(text)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
