"""A stand-in for an example's main.py, for the supervisor's tests: the same command line and
the same launch (every rank through multiprocessing, or the rank that --rank names as an
mp.Process, its status the command's), without torch, so that each run starts in a fraction of
a second. A rank prints, works for --seconds, and then, as a rank waiting in rpc.shutdown() for
a peer that is gone would, waits for ever where --hang says so."""

import argparse
import json
import multiprocessing as mp
import os
import sys
import threading
import time


def run(rank, args):
    print(f"rank {rank} working, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, "
          f"TP_SOCKET_IFNAME={os.environ.get('TP_SOCKET_IFNAME')}", flush=True)
    if args.long_line:
        print("x" * args.long_line, flush=True)
    if rank == args.warn:
        print(f"rank {rank}: a warning on standard error", file=sys.stderr, flush=True)
    # rank 0, as the examples' coordinating rank, ends last
    deadline = time.monotonic() + args.seconds + (0.5 if rank == 0 else 0.0)
    while time.monotonic() < deadline:
        time.sleep(0.05)
    if rank in args.fail:
        if args.mark and rank != args.slow_end:
            # as a peer that lost the rank that failed first: an error of its own a second on
            waited = time.monotonic() + 30
            while not os.path.exists(args.mark) and time.monotonic() < waited:
                time.sleep(0.05)
            time.sleep(1.0)
        if rank == args.slow_end:
            # a thread that the process waits for as it ends, after its traceback: as a rank's
            # process whose torch tears down for seconds
            threading.Thread(target=time.sleep, args=(3.0,)).start()
            if args.mark:
                open(args.mark, "w").close()
        raise ValueError(f"rank {rank} went wrong")
    if rank in args.hang:
        while True:
            time.sleep(1)
    if args.profile:  # a trace of the rank's, as torch.profiler writes it, with its rank
        trace = {"rank": rank, "baseTimeNanoseconds": time.time_ns(), "traceEvents": [
            {"ph": "X", "name": "work", "pid": os.getpid(), "tid": 1, "ts": 0, "dur": 5}]}
        with open(os.path.join(args.profile, f"rank{rank}.json"), "w") as file:
            json.dump(trace, file)
    print(f"rank {rank} done", flush=True)
    if rank == 0:
        print("Summary: every rank is done", flush=True)


def main():
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--world_size", type=int, default=2)
    parser.add_argument("--rank", type=int, default=None)
    parser.add_argument("--master_addr", default="localhost")
    parser.add_argument("--master_port", type=str, default="29500")
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--fail", type=int, nargs="*", default=[],
                        help="these ranks raise at the end (rank 0 half a second after others)")
    parser.add_argument("--slow_end", type=int, default=None,
                        help="this rank's process takes 3 s to end after its traceback")
    parser.add_argument("--mark", default=None,
                        help="the --slow_end rank makes this file as it raises; the other ranks "
                             "of --fail raise 1 s after it appears")
    parser.add_argument("--hang", type=int, nargs="*", default=[],
                        help="these ranks wait for ever once done")
    parser.add_argument("--warn", type=int, default=None, help="this rank warns on stderr")
    parser.add_argument("--long_line", type=int, default=0, help="a line this long")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--profile", default=None)
    args = parser.parse_args()
    if args.world_size < 2:
        parser.error(f"argument --world_size: must be at least 2, got {args.world_size}")
    mp.set_start_method("spawn")
    ranks = range(args.world_size) if args.rank is None else [args.rank]
    processes = [mp.Process(target=run, args=(rank, args)) for rank in ranks]
    for p in processes:
        p.start()
    for p in processes:
        p.join()
    codes = [p.exitcode for p in processes]
    worst = next((code for code in codes if code != 0), 0)
    sys.exit(worst if worst >= 0 else 128 - worst)


if __name__ == "__main__":
    main()
