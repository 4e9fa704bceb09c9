"""Direct Device-to-Device Communication with TensorPipe CUDA RPC, the recipe: its code, in its
order. worker0 drives a model of two linear layers, the second on worker1, forward and backward:
first staging the tensors through the CPU ("cpu" mode), then sending them from GPU to GPU
through a device map ("cuda" mode). On one GPU both workers share it (map {0: 0}); without
CUDA, both modes run on the CPU with no device map, and the first line says so (extras.py).

Each line that is not the recipe's is marked "# ours:" with why. README.md says what differs.

    python main.py                                 # both workers on this machine
    python main.py --world_size 2 --rank 1         # one worker per terminal (and --rank 0)
"""

import torch
import torch.distributed.autograd as autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn

import os
import sys  # ours: the command's status, for --rank
import time

import extras  # ours: the command line, the devices and the summary, beside this file


class MyModule(nn.Module):
    def __init__(self, device, comm_mode):
        super().__init__()
        self.device = device
        self.linear = nn.Linear(1000, 1000).to(device)
        self.comm_mode = comm_mode

    def forward(self, x):
        # x.to() is a no-op if x is already on self.device
        y = self.linear(x.to(self.device))
        return y.cpu() if self.comm_mode == "cpu" else y

    def parameter_rrefs(self):
        return [rpc.RRef(p) for p in self.parameters()]


def measure(comm_mode, args):  # ours: args, the devices and the run's length
    # local module on "worker0/cuda:0"
    lm = MyModule(args.devices[0], comm_mode)  # ours: worker0's device, not always "cuda:0"
    # remote module on "worker1/cuda:1"
    rm = rpc.remote("worker1", MyModule, args=(args.devices[1], comm_mode))  # ours: worker1's
    # prepare random inputs
    x = torch.randn(1000, 1000).to(args.devices[0])  # ours: worker0's device, not .cuda(0)
    # ours: one untimed pass, so that no mode's time holds the start-up of CUDA and cuBLAS
    with autograd.context() as ctx:
        autograd.backward(ctx, [rm.rpc_sync().forward(lm(x)).sum()])

    tik = time.time()
    for _ in range(args.iterations):  # ours: --iterations, the recipe's 10 by default
        with autograd.context() as ctx:
            y = rm.rpc_sync().forward(lm(x))
            autograd.backward(ctx, [y.sum()])
    # synchronize on "cuda:0" to make sure that all pending CUDA ops are
    # included in the measurements
    if args.devices[0] != "cpu":  # ours: no CUDA stream to wait for on the CPU
        torch.cuda.current_stream(args.devices[0]).synchronize()  # ours: worker0's device
    tok = time.time()
    print(f"{comm_mode} RPC total execution time: {tok - tik}")
    extras.record(comm_mode, tok - tik)  # ours: for the summary


def run_worker(rank, args):  # ours: args, the command line
    torch.manual_seed(args.seed)  # ours: --seed, so that a run repeats
    os.environ['MASTER_ADDR'] = args.master_addr  # ours: --master_addr, not 'localhost'
    os.environ['MASTER_PORT'] = str(args.master_port)  # ours: --master_port, not '29500'
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=128)

    if rank == 0:
        if args.device_map is not None:  # ours: no device map without CUDA (extras.py)
            options.set_device_map("worker1", args.device_map)  # ours: {0: 1}, or {0: 0}
        rpc.init_rpc(
            f"worker{rank}",
            rank=rank,
            world_size=2,
            rpc_backend_options=options
        )
        measure(comm_mode="cpu", args=args)  # ours: args
        measure(comm_mode="cuda", args=args)  # ours: args
        extras.where_tensors_land(args.devices[0])  # ours: what the device map did
    else:
        rpc.init_rpc(
            f"worker{rank}",
            rank=rank,
            world_size=2,
            rpc_backend_options=options
        )

    store = extras.hold_store(args, rank)  # ours: rank 0's store, kept for rpc.shutdown()
    # block until all rpcs finish
    rpc.shutdown()
    extras.release_store(args, rank, store)  # ours: (extras.hold_store says why)
    extras.summary(args, rank)  # ours: worker0's last line, "Summary: ..." (extras.py)


if __name__=="__main__":
    args = extras.parse_args()  # ours: the recipe has no command line (extras.py)
    world_size = 2
    # ours: one worker (--rank, or torchrun's), as the other RPC tutorials start one
    if args.rank is not None:
        p = mp.Process(target=run_worker, args=(args.rank, args))
        p.start()
        p.join()
        sys.exit(p.exitcode if p.exitcode >= 0 else 128 - p.exitcode)
    mp.spawn(run_worker, args=(args,), nprocs=world_size, join=True)  # ours: args
