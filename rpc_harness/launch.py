"""spawn(), for the tutorials' mp.spawn: every rank on this machine, or the one that --rank or
torchrun names, each with its share of the cores; Ctrl-C or SIGTERM ends a rank in one line."""

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


def spawn(fn, args=(), nprocs=1, join=True):
    """torch.multiprocessing.spawn(fn, args, nprocs, join=True) for the command line that
    parse_args() read: fn(rank, *args) for every rank, rank 0 in this process and the others in
    processes of their own, which end with it; or only the rank that --rank or torchrun names.
    Not mp.spawn itself: each rank must start with its own share of the cores (OMP_NUM_THREADS,
    read as torch loads), and every rank end with the command, even a killed one."""
    if not join:
        raise ValueError("spawn() waits for its ranks: join=True")
    command, children = cli.parsed, []
    threads = _thread_counts(command)
    if command.rank is None:
        command.harness.spawned = True
        print("Threads: " + ", ".join(f"{command.harness.names[rank]} {count}"
                                      for rank, count in threads.items())
              + f" (on {_cores()} core(s); --threads or OMP_NUM_THREADS to change)")
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited: Ctrl-C is rank 0's to handle
        saved = os.environ.get("OMP_NUM_THREADS")
        for rank in range(1, nprocs):
            os.environ["OMP_NUM_THREADS"] = str(threads[rank])
            children.append(mp.get_context("spawn").Process(
                target=_spawned_rank, args=(rank, fn, args, command, os.getpid())))
            children[-1].start()
        os.environ.pop("OMP_NUM_THREADS") if saved is None else os.environ.update(
            OMP_NUM_THREADS=saved)
    rank = command.rank or 0
    torch.set_num_threads(threads[rank])
    if command.rank is not None:
        print(f"{command.harness.names[rank]}: {threads[rank]} intra-op thread(s) on {_cores()} "
              "core(s) (--threads or OMP_NUM_THREADS to change)")
    _end_on_signals(command.harness.names[rank], (signal.SIGINT, signal.SIGTERM))
    _run_rank(rank, fn, args, command, children)


def _run_rank(rank, fn, fn_args, command, children=()):
    _whole_lines()
    _keep_freed_memory()
    rendezvous.this_rank(command, rank, children)
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
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: a SIGTERM at its end
        if os.getppid() != parent:  # the command was gone before that
            os._exit(1)
    _end_on_signals(None, (signal.SIGTERM,))
    _run_rank(rank, fn, fn_args, command)


def _end_on_signals(name, signals):
    """End at once on one of `signals`, the trace written, with a line if the rank has a `name`.
    A Python handler waits for the main thread to come back to Python, which may take a whole
    join or epoch; but each signal is written to the wakeup fd at once, which a thread reads."""
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
    """{rank: intra-op threads} for the ranks on this machine: the ranks that compute share the
    cores, the others get 1. Under spawn-all in OMP_NUM_THREADS, read as torch loads, because
    torch.set_num_threads() sizes the calling thread's OpenMP team only, not those of RPC's
    threads, where a rank serves its calls (measured: set to 1, a convolution on another thread
    kept two cores busy). Rank 0 and a --rank command, their torch loaded, set the main thread's."""
    world = range(command.world_size)
    if command.rank is None or rendezvous.is_loopback(command.master_addr):
        local = world
    elif command.torchrun and "LOCAL_WORLD_SIZE" in os.environ:
        first = command.rank - int(os.environ.get("LOCAL_RANK", 0))
        local = range(first, first + int(os.environ["LOCAL_WORLD_SIZE"]))
    else:  # alone here, as far as this rank can tell
        local = [command.rank]
    if fixed := command.threads or os.environ.get("OMP_NUM_THREADS"):
        return dict.fromkeys(local, int(fixed))
    heavy = [rank for rank in local if rank in command.harness.heavy]
    return {rank: max(1, _cores() // len(heavy)) if rank in heavy else 1 for rank in local}


def _cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _keep_freed_memory():
    """glibc gives large freed blocks back to the system, and the parameter server, whose passes
    run on RPC's threads (a malloc arena each), faulted in every batch's activations afresh: a
    million page faults in 100 batches, a fifth of its time. So it keeps them."""
    if platform.libc_ver()[0] == "glibc":
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 32 * 2**20)  # M_MMAP_THRESHOLD: blocks up to 32 MiB from the arenas
        libc.mallopt(-1, 2**30)  # M_TRIM_THRESHOLD: give memory back only above 1 GiB free
