"""--profile DIR, for every example (launch.py calls this file; the same file sits in every
example's folder): each rank's torch.profiler trace, and one timeline of them all.

torch's profiler records the process it runs in: each rank profiles itself. The ranks whose loop
calls step() (launch.start's `steps`) record --profile_steps steps after WARMUP_STEPS, each step
a span named "step N"; the others, whose work is the calls those make, record from their start
until every looping rank's window has closed (a count in rank 0's store). Each rank writes its
trace before rpc.shutdown(), whose barrier rank 0 waits out: then rank 0 finds them all, where
the ranks share its folder, and merges them into one timeline for https://ui.perfetto.dev or
chrome://tracing. Otherwise, with every rank's trace copied into one folder:

    python profiling.py FOLDER
"""

import contextlib
import inspect
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed.rpc as rpc
from torch.autograd.profiler_util import EventList

WARMUP_STEPS = 2
TIMELINE = "timeline.json"
_KEYS = "rpc_examples/profile_"  # in the store every rank joined at
_on = False  # --profile given, and the example marks its steps
_args = _store = _name = None
_looping = ()  # the ranks that call step()
_loops = False  # whether this rank does
_profiler = None  # this rank's torch.profiler.profile while its window is open
_span = None  # the record_function of the step under way
_steps = 0
_closed = False
_closing = threading.Lock()  # close() from the main thread, or from a thread that ends the rank
_trace = {}  # what this rank's trace file says of the run: rank, name, run, clock


def profiler_options():
    """torch.profiler.profile's arguments, and whether it records every thread of the process:
    an RPC runs on one of TensorPipe's threads, which the profiler leaves out unless told
    (profile_all_threads, pytorch/pytorch#143659; torch 2.4 lacks it)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    try:
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except TypeError:  # an older torch: its constructor does not know the argument
        return {"activities": activities}, False
    return {"activities": activities, "experimental_config": config}, True


def check_folder(parser, folder):
    """--profile's folder, made if missing; bad input ends the command with one line."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        parser.error(f"--profile {folder}: a file is there; give a folder")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as err:
        parser.error(f"--profile {folder}: cannot make that folder "
                     f"({os.strerror(err.errno) if err.errno else err})")
    if not os.access(folder, os.W_OK | os.X_OK):
        parser.error(f"--profile {folder}: cannot write in that folder")
    return folder


# --------- A rank's window --------------------

def begin(args, rank, name, looping):
    """Before init_rpc: name each call this rank serves over RPC in its trace, and ready the
    profiler on the main thread (Kineto wants its first start there: elsewhere it prints an
    ERROR line). looping: the ranks that call step(), None if the example marks no steps."""
    global _on, _args, _name, _looping, _loops
    _on = bool(getattr(args, "profile", None)) and looping is not None
    if not _on:
        return
    _args, _name, _looping, _loops = args, name, looping, rank in looping
    rpc.internal._run_function = _run_function_in_a_span
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        pass


def _run_function_in_a_span(python_udf, run=rpc.internal._run_function):
    """RPC's own _run_function, which runs every Python function a rank is called for, in a
    span that names the function: `RPC ParameterServer.forward`."""
    with torch.profiler.record_function(f"RPC {_served_name(python_udf)}"):
        return run(python_udf)


def _served_name(python_udf):
    """The function's name; for the tutorials' helpers (_call_method, remote_method, an RRef's
    rpc_sync()), the method's they call."""
    func, args = getattr(python_udf, "func", None), getattr(python_udf, "args", ())
    try:
        if args and inspect.isfunction(args[0]):  # _call_method(method, rref, ...)
            func = args[0]
        elif getattr(func, "__name__", "") == "_local_invoke":  # an RRef's rpc_sync().method()
            return f"{type(args[0].local_value()).__name__}.{args[1]}"
    except Exception:  # noqa: BLE001 - a name is not worth failing the call for
        pass
    return getattr(func, "__qualname__", "?")


def joined(store, rank, first):
    """After init_rpc: agree on the run's name in the store, measure this rank's clock against
    rank 0's (`first`), and unless this rank loops, start its profiler."""
    global _store
    if not _on:
        return
    _store = store
    offset, error = (0, 0) if rank == 0 else clock_offset(first)
    run = _store.compare_set(f"{_KEYS}run", "", f"{os.getpid()}-{time.time_ns()}")
    _trace.update(rank=rank, rankName=_name, run=run.decode(), clockOffsetNs=offset,
                  clockErrorNs=error)
    if error:
        print(f"{_name}: this clock is {offset / 1e6:+.3f} ms from rank 0's (measured over RPC, "
              f"within {error / 1e6:.3f} ms); the timeline moves this rank's events by that much")
    if not _loops:
        _open()


def _clock():
    return socket.gethostname(), time.time_ns()


def clock_offset(other):
    """How far this rank's clock is ahead of other's, in ns (0 on one machine: one clock), and
    how far off that may be: half the best of five round trips."""
    samples = []
    for _ in range(5):
        before = time.time_ns()
        host, theirs = rpc.rpc_sync(other, _clock)
        after = time.time_ns()
        samples.append((after - before, (before + after) // 2 - theirs))
    if host == socket.gethostname():
        return 0, 0
    round_trip, offset = min(samples)
    return offset, max(1, round_trip // 2)


def step():
    """One step of this rank's loop is done: the window opens after WARMUP_STEPS and closes
    --profile_steps steps later. Without --profile, nothing."""
    global _steps, _span
    if not _on:
        return
    _span_end()
    _steps += 1
    if _steps == WARMUP_STEPS:
        _open()
    elif _steps == WARMUP_STEPS + _args.profile_steps:
        close()
    if _profiler is not None:
        _span = torch.profiler.record_function(f"step {_steps + 1}")
        _span.__enter__()


def _span_end():
    global _span
    if _span is not None:
        _span.__exit__(None, None, None)
        _span = None


def _open():
    global _profiler
    options, _ = profiler_options()
    _profiler = torch.profiler.profile(**options)
    _profiler.start()


def waiting_for_the_window():
    """For a rank that does not loop, while its profiler runs: True while some looping rank's
    window is open, False once all have closed. None otherwise."""
    if _loops or _profiler is None:
        return None
    return _store.add(f"{_KEYS}closed", 0) < len(_looping)


def close(count=True):
    """Stop this rank's profiler, write its trace with what the merge needs, say where and how
    big, and print its top operators. A looping rank then counts itself closed in the store.
    count=False: a rank that stops early, whose store may be gone, and which has no time for the
    table."""
    global _profiler, _closed
    if not _on:
        return
    with _closing:
        if _closed:
            return
        _closed = True
    _span_end()
    if _profiler is not None:
        profiler, _profiler = _profiler, None
        profiler.stop()
        path, part = Path(_args.profile) / f"{_name}.json", Path(_args.profile) / f".{_name}"
        profiler.export_chrome_trace(str(part))
        part.write_text(json.dumps({**json.loads(part.read_text()), **_trace}))
        part.replace(path)  # whole or not at all, should the rank be killed meanwhile
        window = (f"steps {WARMUP_STEPS + 1}-{_steps}" if _loops else
                  "from its start until the looping ranks' windows closed")
        threads = ("" if profiler_options()[1] else
                   f"; torch {torch.__version__} records only the thread that started the "
                   "profiler, not the threads where RPCs run")
        wrote = f"{_name}: profiled {window}{threads}; wrote {path} " \
                f"({path.stat().st_size / 1024:.0f} kB)"
        print(wrote if not count else wrote + ". Top operators:\n" + EventList(
            [row for row in profiler.key_averages() if not row.key.startswith("step ")]
        ).table(sort_by="self_cpu_time_total", row_limit=5))
    elif _loops:
        print(f"{_name}: --profile: the run ended after {_steps} step(s), before the window "
              f"(steps {WARMUP_STEPS + 1}-{WARMUP_STEPS + _args.profile_steps}); no trace")
    if _loops and count:
        _store.add(f"{_KEYS}closed", 1)


def close_on_the_way_out(seconds=3.0):
    """A rank that ends early (a lost peer, a signal) writes what its profiler holds, so that a
    rank that dies loses the run only its own trace; but within `seconds`, as a rank that ends
    must end (a long window's trace takes longer to write: then it is left out, and the rank
    says so)."""
    if _profiler is None:
        return
    writing = threading.Thread(target=_close_early, daemon=True)
    writing.start()
    writing.join(seconds)
    if writing.is_alive():
        print(f"{_name}: its trace was not written within {seconds:g} s, and is left out",
              file=sys.stderr, flush=True)


def _close_early():
    with contextlib.suppress(Exception):  # whatever the profiler says, the rank's line comes next
        close(count=False)


# --------- One timeline --------------------

def write_timeline_of_every_rank(names):
    """On rank 0, when every rank is done: merge the traces in --profile's folder (`names`, in
    rank order) into its timeline, or say how, where some were written on other machines."""
    if not _on:
        return
    folder = Path(_args.profile)
    traces, missing = {}, []
    for name in names:
        path = folder / f"{name}.json"
        trace = json.loads(path.read_text()) if path.exists() else {}
        if trace.get("run") == _trace["run"]:
            traces[name] = trace
        else:
            missing.append(name)
    if missing:
        print(f"{_name}: the traces of {', '.join(missing)} are not in {folder} here (written "
              f"on their machines): put every rank's trace in one folder and run "
              f"`python {Path(__file__).name} FOLDER` to merge them")
        return
    print(f"{_name}: {write_timeline(folder, traces)}")


def write_timeline(folder, traces):
    """Merge `traces` (a rank's name -> its trace, in rank order) into folder's timeline.json;
    the line that says where and how big."""
    path = Path(folder) / TIMELINE
    path.write_text(json.dumps(merge(traces)))
    return (f"wrote the timeline of {len(traces)} ranks to {path} "
            f"({path.stat().st_size / 1024:.0f} kB): open it in https://ui.perfetto.dev")
def merge(traces):
    """One Chrome trace of every rank's: `traces` maps a rank's name to its trace, whose
    clockOffsetNs says how far its clock is ahead of rank 0's (ranks on other machines; on one
    machine every rank reads the same clock). Each rank's processes (its CPU threads, a GPU)
    become tracks named after it, in rank order."""
    base_ns = min(trace.get("baseTimeNanoseconds", 0) for trace in traces.values())
    events = []
    for index, (name, trace) in enumerate(traces.items()):
        # the profiler writes times in microseconds after its baseTimeNanoseconds
        shift_us = (trace.get("baseTimeNanoseconds", 0) - base_ns
                    - trace.get("clockOffsetNs", 0)) / 1e3
        meta = {(event.get("name"), event["pid"]): event["args"] for event in trace["traceEvents"]
                if event.get("ph") == "M"}
        tracks = {}  # the profiler's pid -> this timeline's: the process's own (CPU) first
        for (kind, original), args in meta.items():
            if kind == "process_labels" and args.get("labels") == "CPU":
                tracks[original] = 1000 * index
        for event in trace["traceEvents"]:
            # Metadata is rewritten below; the profiler's own bookkeeping tracks ("Spans",
            # "Traces", the window's end) have no int pid and say nothing about the work.
            if event.get("ph") == "M" and event.get("name", "").startswith("process_"):
                continue
            if not isinstance(event.get("pid"), int):
                continue
            pid = tracks.setdefault(event["pid"], 1000 * index + 1 + len(tracks))
            event = {**event, "pid": pid}
            if "ts" in event:
                event["ts"] = float(event["ts"]) + shift_us
            events.append(event)
        for original, pid in tracks.items():
            label = meta.get(("process_name", original), {}).get("name", original)
            title = name if pid == 1000 * index else f"{name}: {label}"
            events.append({"ph": "M", "name": "process_name", "pid": pid,
                           "args": {"name": title}})
            events.append({"ph": "M", "name": "process_sort_index", "pid": pid,
                           "args": {"sort_index": pid}})
    return {"traceEvents": events, "displayTimeUnit": "ms", "baseTimeNanoseconds": base_ns}


if __name__ == "__main__":  # python profiling.py FOLDER: merge the traces that --profile wrote
    if len(sys.argv) != 2 or not os.path.isdir(sys.argv[1]):
        sys.exit("usage: python profiling.py FOLDER (a folder with every rank's --profile trace)")
    found = [json.loads(path.read_text()) for path in sorted(Path(sys.argv[1]).glob("*.json"))
             if path.name != TIMELINE]
    found = sorted((trace for trace in found if "rankName" in trace), key=lambda t: t["rank"])
    print(write_timeline(sys.argv[1], {trace["rankName"]: trace for trace in found}))
