"""Profiling PyTorch RPC-Based Workloads, the recipe: its code, in its order. worker0 sends
worker1 two builtin operators and a user-defined function under the profiler, and prints the
profiles. Today's torch no longer shows the callee's operators in the caller's table, so every
rank then profiles itself, and worker0 merges the traces into one timeline (extras.py).

Each line that is not the recipe's ends with "# ours:" and why. README.md says what differs.

    python main.py                                          # every rank on this machine
    python main.py --rank 1                                 # one rank per terminal
"""

import torch
import torch.distributed.rpc as rpc
import torch.autograd.profiler as profiler
import torch.multiprocessing as mp
import os
import logging
import sys
import time  # ours: udf_with_ops's, at the top (the recipe imports it inside)

import rpc_harness  # ours: this project's package: `make run` installs it (or `pip install -e .`)
from extras import parse_args, profile_every_rank, profile_until_worker0_is_done  # ours
from extras import say_what_the_recipes_profiles_hold  # ours: what is not the recipe (extras.py)

logging.basicConfig(stream=sys.stdout, level=logging.DEBUG)
logger = logging.getLogger()


def random_tensor():
    return torch.rand((3, 3), requires_grad=True)


def udf_with_ops():
    time.sleep(1)
    t1, t2 = random_tensor(), random_tensor()
    torch.add(t1, t2)
    torch.mul(t1, t2)


@rpc_harness.watched  # ours: this rank ends in one line if it fails or loses a peer
def worker(rank, world_size, args):  # ours: args
    os.environ["MASTER_ADDR"] = args.master_addr  # ours: --master_addr, not "localhost"
    os.environ["MASTER_PORT"] = str(args.master_port)  # ours: --master_port, not "29500"
    worker_name = f"worker{rank}"

    # RPC, with the harness's options: the ranks meet through it, and every wait has a bound
    rpc.init_rpc(
        name=worker_name,
        rank=rank,
        world_size=world_size,  # ours: a comma, as an argument follows
        rpc_backend_options=rpc_harness.options(args)  # ours: (above)
    )
    logger.debug(f"{worker_name} successfully initialized RPC.")

    if rank == 0:
        dst_worker_rank = (rank + 1) % world_size
        dst_worker_name = f"worker{dst_worker_rank}"
        t1, t2 = random_tensor(), random_tensor()
        # the two RPCs, sent and awaited under the profiler
        with profiler.profile() as prof:
            fut1 = rpc.rpc_async(dst_worker_name, torch.add, args=(t1, t2))
            fut2 = rpc.rpc_async(dst_worker_name, torch.mul, args=(t1, t2))
            # awaited inside the profiler's scope, or it would not see them end
            fut1.wait()
            fut2.wait()
        print(prof.key_averages().table())

        with profiler.profile() as p:
            fut = rpc.rpc_async(dst_worker_name, udf_with_ops)
            fut.wait()
        print(p.key_averages().table())

        trace_file = os.path.join(args.profile, "trace.json")  # ours: in --profile, not /tmp
        prof.export_chrome_trace(trace_file)
        logger.debug(f"Wrote trace to {trace_file}")

        recipe = say_what_the_recipes_profiles_hold(prof, p, dst_worker_name)  # ours: below
        profile_every_rank(worker_name, dst_worker_name, t1, t2, world_size, args,  # ours:
                           udf_with_ops)  # ours: every rank profiled, one timeline (extras.py)
        rpc_harness.report(recipe=recipe)  # ours: the summary's figures
    else:  # ours: (above)
        profile_until_worker0_is_done(worker_name, args)  # ours: (above)

    logger.debug(f"Rank {rank} waiting for workers and shutting down RPC")
    rpc.shutdown()
    logger.debug(f"Rank {rank} shutdown RPC")


if __name__ == '__main__':
    args = parse_args()  # ours: the world size, address, port and --profile (extras.py)
    rpc_harness.supervise(args)  # ours: this command ends in one line when a rank fails
    mp.set_start_method("spawn")  # ours: --rank's process starts afresh, as mp.spawn's
    # the recipe's two workers, or --world_size
    world_size = args.world_size  # ours: --world_size, the recipe's 2 by default
    if args.rank is not None:  # ours: one rank (--rank, or torchrun's), as the other tutorials
        p = mp.Process(target=worker, args=(args.rank, world_size, args))  # ours
        p.start()  # ours: (above)
        p.join()  # ours: (above)
        sys.exit(rpc_harness.exit_status(p))  # ours: the rank's status, with its line
    mp.spawn(worker, args=(world_size, args), nprocs=world_size, join=True)  # ours: args, join
