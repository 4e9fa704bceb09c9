"""Profiling PyTorch RPC-Based Workloads, the recipe: its code, in its order. worker0 sends
worker1 two builtin operators and a user-defined function under the profiler, and prints the
profiles. Today's torch no longer shows the callee's operators in the caller's profile: with
--profile DIR, every rank then profiles itself into DIR/<its name>.json (extras.py).

Each line that is not the recipe's is marked "# ours:" with why. README.md says what differs.

    python main.py --profile traces                         # every rank on this machine
    python main.py --world_size 2 --rank 1 --profile traces # one rank per terminal
"""

import torch
import torch.distributed.rpc as rpc
import torch.autograd.profiler as profiler
import torch.multiprocessing as mp
import os
import logging
import sys
import tempfile  # ours: the recipe's /tmp, where the system keeps it

import extras  # ours: the command line, --profile and the summary, beside this file

logging.basicConfig(stream=sys.stdout, level=logging.DEBUG)
logger = logging.getLogger()


def random_tensor():
    return torch.rand((3, 3), requires_grad=True)


def udf_with_ops():
    import time
    time.sleep(1)
    t1, t2 = random_tensor(), random_tensor()
    torch.add(t1, t2)
    torch.mul(t1, t2)


def worker(rank, world_size, args):  # ours: args, the command line
    torch.manual_seed(args.seed)  # ours: --seed, so that a run repeats
    os.environ["MASTER_ADDR"] = args.master_addr  # ours: --master_addr, not "localhost"
    os.environ["MASTER_PORT"] = str(args.master_port)  # ours: --master_port, not "29500"
    worker_name = f"worker{rank}"

    # Initialize RPC framework.
    rpc.init_rpc(
        name=worker_name,
        rank=rank,
        world_size=world_size
    )
    logger.debug(f"{worker_name} successfully initialized RPC.")

    if rank == 0:
        dst_worker_rank = (rank + 1) % world_size
        dst_worker_name = f"worker{dst_worker_rank}"
        t1, t2 = random_tensor(), random_tensor()
        # Send and wait RPC completion under profiling scope.
        with profiler.profile() as prof:
            fut1 = rpc.rpc_async(dst_worker_name, torch.add, args=(t1, t2))
            fut2 = rpc.rpc_async(dst_worker_name, torch.mul, args=(t1, t2))
            # RPCs must be awaited within profiling scope.
            fut1.wait()
            fut2.wait()
        print(prof.key_averages().table())

        with profiler.profile() as p:
            fut = rpc.rpc_async(dst_worker_name, udf_with_ops)
            fut.wait()

        print(p.key_averages().table())

        # ours: in --profile's folder, or the system's temporary one (the recipe's "/tmp")
        trace_file = os.path.join(args.profile or tempfile.gettempdir(), "trace.json")
        prof.export_chrome_trace(trace_file)
        logger.debug(f"Wrote trace to {trace_file}")
        # ours: what the recipe's profiles hold on this torch, then --profile's (extras.py)
        extras.say_what_the_recipes_profiles_hold(prof, p, dst_worker_name)
        extras.profile_every_rank(args, worker_name, dst_worker_name, t1, t2, udf_with_ops)
    else:  # ours: --profile: the other ranks record until worker0 is done (extras.py)
        extras.profile_until_worker0_is_done(args, rank, worker_name)

    logger.debug(f"Rank {rank} waiting for workers and shutting down RPC")
    store = extras.hold_store(args, rank)  # ours: rank 0's store, kept for rpc.shutdown()
    rpc.shutdown()
    extras.release_store(args, rank, store)  # ours: (extras.hold_store says why)
    logger.debug(f"Rank {rank} shutdown RPC")
    extras.summary(args, rank)  # ours: worker0's last line, "Summary: ..." (extras.py)


if __name__ == '__main__':
    args = extras.parse_args()  # ours: the recipe has no command line (extras.py)
    # Run 2 RPC workers.
    world_size = args.world_size  # ours: --world_size, 2 by default
    # ours: one rank (--rank, or torchrun's), as the other RPC tutorials start one
    if args.rank is not None:
        p = mp.Process(target=worker, args=(args.rank, world_size, args))
        p.start()
        p.join()
        sys.exit(p.exitcode if p.exitcode >= 0 else 128 - p.exitcode)
    mp.spawn(worker, args=(world_size, args), nprocs=world_size)  # ours: args
