"""spawn(), the tutorials' mp.spawn: every rank here, or the one that --rank or torchrun names."""

import ctypes
import multiprocessing.connection
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
    """mp.spawn(fn, args, nprocs, join=True): fn(rank, *args) in a process for every rank, each
    with its own OMP_NUM_THREADS, which end together; or the one rank --rank or torchrun names."""
    command = cli.parsed
    threads, names = _thread_counts(command), command.harness.names
    print("Threads: " + ", ".join(f"{names[rank]} {n}" for rank, n in threads.items()
                                  if command.rank in (None, rank))
          + f" (on {CORES} core(s); OMP_NUM_THREADS to change)")
    if command.rank is not None:
        torch.set_num_threads(threads[command.rank])
        _end_on_signals(names[command.rank], (signal.SIGINT, signal.SIGTERM))
        _run_rank(command.rank, fn, args, command)
    command.harness.spawned = True
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited: Ctrl-C is this process's to handle
    ranks = [mp.get_context("spawn").Process(target=_spawned_rank,
                                             args=(rank, fn, args, command, os.getpid()))
             for rank in range(nprocs)]
    for rank, process in enumerate(ranks):
        os.environ["OMP_NUM_THREADS"] = str(threads[rank])  # read as the rank's torch loads
        process.start()
    signals = _signal_pipe((signal.SIGINT, signal.SIGTERM))
    while running := [process for process in ranks if process.exitcode is None]:
        ready = multiprocessing.connection.wait([signals] + [p.sentinel for p in running])
        if signals in ready and (number := os.read(signals, 1)[0]):
            _stop(ranks, "interrupted" + ("" if number == signal.SIGINT else " (SIGTERM)")
                  + "; stopped every rank", 128 + number)
        for process in running:  # its status comes a moment after its files close: not awaited,
            if process.sentinel in ready:  # a killed rank could pass for one that lost its peer
                process.join(5)
        if failed := sorted((p for p in ranks if p.exitcode), key=lambda p: p.exitcode > 0):
            rank, code = ranks.index(failed[0]), failed[0].exitcode
            how = (f"was killed by {signal.Signals(-code).name}" if code < 0
                   else f"exited with status {code}")
            _stop(ranks, f"{names[rank]} (rank {rank}) {how}; stopped the other ranks",
                  2 if code == 2 else 1)

def _stop(ranks, line, status):
    """SIGTERM, which a rank answers by writing its trace (3 s at most), then SIGKILL; the line."""
    for process in ranks:
        process.terminate()  # nothing, for one that has ended
    for process in ranks:
        process.join(5)
        process.kill()
        process.join()
    rendezvous._exit(line, status)

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
        stream.reconfigure(line_buffering=True, write_through=False)

def _keep_freed_memory():
    """glibc gives large freed blocks back: the parameter server, its passes on RPC's threads,
    faulted every batch's activations in afresh (a million page faults in 100 batches)."""
    if platform.libc_ver()[0] == "glibc":
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 32 * 2**20)  # M_MMAP_THRESHOLD: blocks up to 32 MiB from the arenas
        libc.mallopt(-1, 2**30)  # M_TRIM_THRESHOLD: give memory back only above 1 GiB free

def _spawned_rank(rank, fn, fn_args, command, parent):
    """A rank that spawn() started: it ends, quietly, with the command, even a killed one."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the command was gone before that
            os._exit(1)
    _end_on_signals(None, (signal.SIGTERM,))
    _run_rank(rank, fn, fn_args, command)

def _signal_pipe(signals):
    """A pipe each of `signals` writes its number to, at once (a handler waits for Python code)."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end)
    for number in signals:
        signal.signal(number, lambda number, frame: None)
    return read_end

def _end_on_signals(name, signals):
    """End on `signals`, its trace written, in a line if named."""
    def wait_for_a_signal(pipe):
        while (number := os.read(pipe, 1)[0]) not in signals:
            pass
        profiling.end(seconds=3.0)
        if name:
            print(f"{name}: interrupted" + ("" if number == signal.SIGINT else " (SIGTERM)"),
                  file=sys.stderr, flush=True)
        os._exit(128 + number)
    threading.Thread(target=wait_for_a_signal, args=(_signal_pipe(signals),), daemon=True,
                     name="signals").start()

def _thread_counts(command):
    """{rank: threads} here: OMP_NUM_THREADS, or the cores shared by the ranks that compute, 1 for
    the others; passed in OMP_NUM_THREADS, as torch.set_num_threads() misses RPC's threads."""
    if command.rank is None or command.master_addr in ("localhost", "127.0.0.1", "::1"):
        local = range(command.world_size)
    else:  # torchrun's ranks on this machine; without torchrun, this one alone, as far as it knows
        first = command.rank - int(os.environ.get("LOCAL_RANK", 0))
        local = range(first, first + int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    if fixed := os.environ.get("OMP_NUM_THREADS"):
        return dict.fromkeys(local, int(fixed))
    heavy = [rank for rank in local if rank in command.harness.heavy]
    return {rank: max(1, CORES // len(heavy)) if rank in heavy else 1 for rank in local}
