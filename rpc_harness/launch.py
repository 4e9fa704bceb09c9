"""spawn(), for the tutorials' mp.spawn: every rank on this machine, or the one that --rank or
torchrun names, each with its share of the cores; Ctrl-C or SIGTERM ends a rank in one line."""

import ctypes
import io
import multiprocessing.connection
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
    parse_args() read: fn(rank, *args) for every rank, each in a process of its own, or here for
    the one that --rank or torchrun names. Not mp.spawn itself: each rank must start with its own
    share of the cores (OMP_NUM_THREADS, read as torch loads) and end with the command that
    started it, even a killed one; and a failure must name the rank that failed first."""
    if not join:
        raise ValueError("spawn() waits for its ranks: join=True")
    command = cli.parsed
    threads = _thread_counts(command)
    if command.rank is None:
        _spawn_all(fn, args, nprocs, command, threads)
    name = command.harness.names[command.rank]
    torch.set_num_threads(threads[command.rank])
    print(f"{name}: {threads[command.rank]} intra-op thread(s) on {_cores()} core(s) (--threads "
          "or OMP_NUM_THREADS to change)")
    _end_on_signals(name, (signal.SIGINT, signal.SIGTERM))
    _run_rank(command.rank, fn, args, command)


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


def _end_on_signals(name, signals, quiet=False):
    """End at once on one of `signals`, its trace written, with a line unless quiet. A Python
    handler waits for the main thread to come back to Python, which may take a whole join or
    epoch; but each signal is written to the wakeup fd at once, which a thread here reads."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end)
    for number in signals:
        signal.signal(number, lambda number, frame: None)

    def wait_for_a_signal():
        while (number := os.read(read_end, 1)[0]) not in signals:
            pass
        profiling.end(seconds=3.0)
        if not quiet:
            print(f"{name}: {interrupted(number)}", file=sys.stderr, flush=True)
        os._exit(128 + number)

    threading.Thread(target=wait_for_a_signal, daemon=True, name="signals").start()


def interrupted(number):
    return "interrupted" + ("" if number == signal.SIGINT else " (SIGTERM)")


def _spawn_all(fn, fn_args, nprocs, command, threads):
    """Start every rank and wait. If one fails, stop the others, name the one that failed first
    (killed by a signal before exiting) and exit 1, or 2 for bad input; Ctrl-C stops them all."""
    names = command.harness.names
    print("Threads: " + ", ".join(f"{names[rank]} {count}" for rank, count in threads.items())
          + f" (on {_cores()} core(s); --threads or OMP_NUM_THREADS to change)")
    command.harness.spawned = True
    ranks = [mp.get_context("spawn").Process(target=_spawned_rank, name=names[rank],
                                             args=(rank, fn, fn_args, command, os.getpid()))
             for rank in range(nprocs)]
    saved = os.environ.get("OMP_NUM_THREADS")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the ranks inherit it: this process stops them
    for rank, process in enumerate(ranks):
        os.environ["OMP_NUM_THREADS"] = str(threads[rank])
        process.start()
    os.environ.pop("OMP_NUM_THREADS") if saved is None else os.environ.update(OMP_NUM_THREADS=saved)
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, _raise_keyboard_interrupt)
    try:
        while running := [process for process in ranks if process.exitcode is None]:
            multiprocessing.connection.wait([process.sentinel for process in running])
            for process in running:  # a dying process closes its files before its status is known
                process.join(0 if process.is_alive() else 5)
            if failed := [process for process in ranks if process.exitcode not in (None, 0)]:
                first = min(failed, key=lambda process: process.exitcode >= 0)
                how = (f"was killed by {signal.Signals(-first.exitcode).name}" if
                       first.exitcode < 0 else f"exited with status {first.exitcode}")
                _stop(ranks)
                print(f"{first.name} (rank {ranks.index(first)}) {how}; stopped the other ranks",
                      file=sys.stderr, flush=True)
                os._exit(2 if first.exitcode == 2 else 1)
    except KeyboardInterrupt as stopped:
        _stop(ranks)
        print(f"{interrupted(stopped.args[0])}; stopped every rank", file=sys.stderr, flush=True)
        os._exit(128 + stopped.args[0])
    sys.stdout.flush()
    os._exit(0)


def _raise_keyboard_interrupt(number, frame):
    raise KeyboardInterrupt(number)


def _stop(processes):
    for process in processes:
        if process.exitcode is None:
            process.terminate()
    for process in processes:
        process.join(5)
        if process.exitcode is None:
            process.kill()
            process.join()


def _spawned_rank(rank, fn, fn_args, command, launcher_pid):
    """A rank of _spawn_all: it dies with its launcher, even a killed one (Linux), and ends
    quietly on the launcher's SIGTERM, its trace written."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
        if os.getppid() != launcher_pid:  # the launcher was gone before that
            os._exit(1)
    _end_on_signals(command.harness.names[rank], (signal.SIGTERM,), quiet=True)
    _run_rank(rank, fn, fn_args, command)


def _thread_counts(command):
    """{rank: intra-op threads} for the ranks on this machine: the ranks that compute share the
    cores, the others get 1. Under spawn-all in OMP_NUM_THREADS, read as torch loads, because
    torch.set_num_threads() sizes the calling thread's OpenMP team only, not those of RPC's
    threads, where a rank serves its calls (measured: set to 1, a convolution on another thread
    kept two cores busy). A --rank command, its torch loaded, sets its main thread's only."""
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
