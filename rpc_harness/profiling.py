"""--profile DIR: each rank profiles itself. The ranks that loop (they call profile_step() once a
step) record --profile_steps steps after WARMUP_STEPS (torch's ProfilerStep#N spans); the others
record from the join until every loop's window has closed (a count in rank 0's store). At the
end rank 0 merges every rank's trace into one timeline, a track per rank, or says how to:
python -m rpc_harness.profiling FOLDER."""

import contextlib
import json
import os
import sys
import threading
from pathlib import Path

import torch

from .compat import profiler_options

WARMUP_STEPS = 2
TIMELINE = "timeline.json"
_CLOSED = "rpc_harness/profiles_closed"

_on = _loops = False  # --profile here; this rank loops
_args = _name = _store = _prof = None  # _prof: None before it starts, False once written
_meta = {}  # what the merge reads in the trace
_lock = threading.Lock()  # the trace is written once, by whichever thread gets there first


def begin(args, rank, name, store, run):
    """At the join, on the main thread (Kineto must first start there, and torch 2.4 stop
    there): a rank that serves starts recording now; one that loops, at its first step."""
    global _on, _args, _name, _store, _loops, _prof
    _on = bool(getattr(args, "profile", None)) and args.harness.loops is not None
    if _on:
        _args, _name, _store, _loops = args, name, store, rank in args.harness.loops
        _meta.update(rank=rank, rankName=name, run=run)
        if _loops:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
                pass
        else:
            _prof = _start(on_trace_ready=_write)


def _start(**kwargs):
    """A started profiler, with this rank's metadata, which the merge reads."""
    prof = torch.profiler.profile(**profiler_options()[0], **kwargs)
    for key, value in _meta.items():
        prof.preset_metadata_json(key, json.dumps(value))
    prof.start()
    return prof


def step():
    """Not in the tutorials: one step of a looping rank, for --profile's window."""
    global _prof
    if _on and _prof is None:
        _prof = _start(on_trace_ready=_write, schedule=torch.profiler.schedule(
            wait=WARMUP_STEPS - 1, warmup=1, active=_args.profile_steps, repeat=1))
    elif _on and _prof:
        _prof.step()


def beat():
    """Once a heartbeat: a serving rank stops recording once every loop's window has closed."""
    if _on and not _loops and _prof and _store.add(_CLOSED, 0) >= len(_args.harness.loops):
        _stop()


def end(seconds=None):
    """Write the trace; when the rank stops early, within `seconds`, or leave it out."""
    if not _on or seconds is None:
        return _on and _stop()
    writing = threading.Thread(target=_stop, daemon=True)
    writing.start()
    writing.join(seconds)
    if writing.is_alive():
        print(f"{_name}: its trace was not written within {seconds:g} s, and is left out",
              file=sys.stderr, flush=True)


def _stop():
    """Stop the profiler (its trace is written by _write), once, whichever thread asks first."""
    # RuntimeError: torch 2.4 stops a profiler only from the thread that started it (compat.py)
    with _lock, contextlib.suppress(RuntimeError):
        if _prof:
            _prof.stop()


def _write(prof):
    """The profiler's on_trace_ready: the trace, written whole under this rank's name."""
    global _prof
    _prof = False
    path, part = Path(_args.profile) / f"{_name}.json", Path(_args.profile) / f".{_name}.json"
    prof.export_chrome_trace(str(part))
    part.replace(path)  # whole or not at all: the rank may be killed meanwhile
    print(f"{_name}: profiled, wrote {path} ({path.stat().st_size // 1024} kB)" + (
        "" if profiler_options()[1] else f"; torch {torch.__version__} records only the thread "
        "that started the profiler, not the threads where RPCs run"))
    if _loops:
        _store.add(_CLOSED, 1)


def write_timeline_of_every_rank(names):
    """Rank 0, at the end: the timeline of every rank's trace of this run, if all are here (the
    ranks of other machines wrote theirs there); otherwise how to merge them."""
    if not _on:
        return
    traces = {}
    for name in names:
        path = Path(_args.profile) / f"{name}.json"
        if path.exists():
            traces[name] = json.loads(path.read_text())
    missing = [name for name in names if traces.get(name, {}).get("run") != _meta["run"]]
    if missing:
        print(f"{_name}: the traces of {', '.join(missing)} are not in {_args.profile} here: put "
              "every rank's trace in one folder and run `python -m rpc_harness.profiling FOLDER`")
    else:
        print(f"{_name}: {write_timeline(_args.profile, traces)}")


def write_timeline(folder, traces):
    """Write the merged timeline of `traces` (a name -> its trace) into folder; what it did."""
    path = Path(folder) / TIMELINE
    path.write_text(json.dumps(merge(traces)))
    return (f"wrote the timeline of {len(traces)} ranks to {path} "
            f"({path.stat().st_size // 1024} kB): open it in https://ui.perfetto.dev")


def merge(traces):
    """One Chrome trace, a track per rank in rank order (`traces`: a name -> its trace)."""
    base_ns = min(trace.get("baseTimeNanoseconds", 0) for trace in traces.values())
    events = []
    for rank, (name, trace) in enumerate(traces.items()):
        shift_us = (trace.get("baseTimeNanoseconds", 0) - base_ns  # times: us after the base
                    - trace.get("clockOffsetNs", 0)) / 1e3
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": name}})
        for event in trace["traceEvents"]:
            # The rank's metadata replaces each process's own; the profiler's bookkeeping
            # ("Spans", the window's end) has no integer pid, and nothing of the work.
            if not isinstance(event.get("pid"), int):
                continue
            if event.get("name", "").startswith("process_"):
                continue
            moved = {**event, "pid": rank}
            if "ts" in event:
                moved["ts"] = float(event["ts"]) + shift_us
            events.append(moved)
    return {"traceEvents": events, "displayTimeUnit": "ms", "baseTimeNanoseconds": base_ns}


def main():
    """python -m rpc_harness.profiling FOLDER: the timeline of the traces in FOLDER."""
    if len(sys.argv) != 2 or not os.path.isdir(sys.argv[1]):
        sys.exit("usage: python -m rpc_harness.profiling FOLDER (every rank's --profile trace)")
    traces = []
    for path in Path(sys.argv[1]).glob("*.json"):
        trace = json.loads(path.read_text())
        if "rankName" in trace:
            traces.append(trace)
    traces.sort(key=lambda trace: trace["rank"])
    print(write_timeline(sys.argv[1], {trace["rankName"]: trace for trace in traces}))


if __name__ == "__main__":
    main()
