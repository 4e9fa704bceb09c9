"""spawn(), the tutorials' mp.spawn: every rank here, or the one that --rank or torchrun names."""

import ctypes
import io
import os
import platform
import signal
import sys
import threading

import torch
import torch.multiprocessing as mp

from . import cli, profiling, rendezvous

CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()

def spawn(fn, args=(), nprocs=1, join=True):
    """mp.spawn(fn, args, nprocs, join=True): fn(rank, *args) for every rank, rank 0 here and the
    others in processes that end with this one and have their own OMP_NUM_THREADS; or one rank."""
    if not join:
        raise ValueError("spawn() waits for its ranks: join=True")
    command = cli.parsed
    threads, names = _thread_counts(command), command.harness.names
    print("Threads: " + ", ".join(f"{names[rank]} {n}" for rank, n in threads.items()
                                  if command.rank in (None, rank))
          + f" (on {CORES} core(s); OMP_NUM_THREADS to change)")
    if command.rank is None:
        command.harness.spawned = True
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited: Ctrl-C is rank 0's to handle
        for rank in range(1, nprocs):
            os.environ["OMP_NUM_THREADS"] = str(threads[rank])  # read as the rank's torch loads
            mp.get_context("spawn").Process(target=_spawned_rank,
                                            args=(rank, fn, args, command, os.getpid())).start()
    rank = command.rank or 0
    torch.set_num_threads(threads[rank])
    _end_on_signals(names[rank], (signal.SIGINT, signal.SIGTERM))
    _run_rank(rank, fn, args, command)

def _run_rank(rank, fn, fn_args, command):
    _whole_lines()
    _keep_freed_memory()
    rendezvous.this_rank(command, rank)
    try:
        fn(rank, *fn_args)
    except Exception as err:  # noqa: BLE001 - reported, then the process ends
        rendezvous.fail(err)
    rendezvous.finish()
    sys.stdout.flush()  # no teardown of torch: most of a CPU second, for nothing
    os._exit(0)

def _whole_lines():
    """Each line written whole and at once, even under python -u: the ranks share a terminal."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True, write_through=False)

def _spawned_rank(rank, fn, fn_args, command, parent):
    """A rank that spawn() started: it ends, quietly, with the command, even a killed one."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the command was gone before that
            os._exit(1)
    _end_on_signals(None, (signal.SIGTERM,))
    _run_rank(rank, fn, fn_args, command)

def _end_on_signals(name, signals):
    """End at once on `signals`, in a line if named: a Python handler would wait for the main
    thread to come back to Python, maybe an epoch; the wakeup fd, which a thread reads, does not."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end)
    for number in signals:
        signal.signal(number, lambda number, frame: None)

    def wait_for_a_signal():
        while (number := os.read(read_end, 1)[0]) not in signals:
            pass
        profiling.end(seconds=3.0)
        if name:
            print(f"{name}: interrupted" + ("" if number == signal.SIGINT else " (SIGTERM)"),
                  file=sys.stderr, flush=True)
        os._exit(128 + number)

    threading.Thread(target=wait_for_a_signal, daemon=True, name="signals").start()

def _thread_counts(command):
    """{rank: threads} here: OMP_NUM_THREADS, or the cores shared by the ranks that compute, 1 for
    the others; passed in OMP_NUM_THREADS, as torch.set_num_threads() misses RPC's threads."""
    world = range(command.world_size)
    if command.rank is None or command.master_addr in ("localhost", "127.0.0.1", "::1"):
        local = world
    elif command.torchrun and "LOCAL_WORLD_SIZE" in os.environ:
        first = command.rank - int(os.environ.get("LOCAL_RANK", 0))
        local = range(first, first + int(os.environ["LOCAL_WORLD_SIZE"]))
    else:  # alone here, as far as this rank can tell
        local = [command.rank]
    if fixed := os.environ.get("OMP_NUM_THREADS"):
        return dict.fromkeys(local, int(fixed))
    heavy = [rank for rank in local if rank in command.harness.heavy]
    return {rank: max(1, CORES // len(heavy)) if rank in heavy else 1 for rank in local}

def _keep_freed_memory():
    """glibc gives large freed blocks back: the parameter server, its passes on RPC's threads,
    faulted every batch's activations in afresh (a million page faults in 100 batches)."""
    if platform.libc_ver()[0] == "glibc":
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 32 * 2**20)  # M_MMAP_THRESHOLD: blocks up to 32 MiB from the arenas
        libc.mallopt(-1, 2**30)  # M_TRIM_THRESHOLD: give memory back only above 1 GiB free
