"""--profile DIR: each rank profiles itself, those that call profile_step() --profile_steps steps
after WARMUP_STEPS (ProfilerStep#N), those that serve them until every such window has closed (a
count in rank 0's store). Rank 0 merges the traces, or says how: python -m rpc_harness.profiling"""

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
    """At the join, on the main thread: Kineto must first start there, and torch 2.4 stop there."""
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
    prof = torch.profiler.profile(**profiler_options()[0], **kwargs)
    for key, value in _meta.items():
        prof.preset_metadata_json(key, json.dumps(value))
    prof.start()
    return prof

def step():
    global _prof
    if _on and _prof is None:
        _prof = _start(on_trace_ready=_write, schedule=torch.profiler.schedule(
            wait=WARMUP_STEPS - 1, warmup=1, active=_args.profile_steps, repeat=1))
    elif _on and _prof:
        _prof.step()

def beat():
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
    # RuntimeError: torch 2.4 stops a profiler only from the thread that started it (compat.py)
    with _lock, contextlib.suppress(RuntimeError):
        if _prof:
            _prof.stop()

def _write(prof):
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
    if _on:
        traces = {name: json.loads(path.read_text()) for name in names
                  if (path := Path(_args.profile) / f"{name}.json").exists()}
        missing = [name for name in names if traces.get(name, {}).get("run") != _meta["run"]]
        print(f"{_name}: " + (f"the traces of {', '.join(missing)} are not in {_args.profile} "
                              "here: put every rank's trace in one folder and run `python -m "
                              "rpc_harness.profiling FOLDER`" if missing else
                              write_timeline(_args.profile, traces)))

def write_timeline(folder, traces):
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
        # the rank's metadata replaces each process's; the profiler's bookkeeping ("Spans", the
        # window's end) has no integer pid, and nothing of the work
        events += [{**event, "pid": rank, **({"ts": float(event["ts"]) + shift_us}
                                             if "ts" in event else {})}
                   for event in trace["traceEvents"] if isinstance(event.get("pid"), int)
                   and not event.get("name", "").startswith("process_")]
    return {"traceEvents": events, "displayTimeUnit": "ms", "baseTimeNanoseconds": base_ns}

if __name__ == "__main__":
    if len(sys.argv) != 2 or not os.path.isdir(sys.argv[1]):
        sys.exit("usage: python -m rpc_harness.profiling FOLDER (every rank's --profile trace)")
    found = [json.loads(path.read_text()) for path in Path(sys.argv[1]).glob("*.json")]
    found = sorted((trace for trace in found if "rankName" in trace), key=lambda t: t["rank"])
    print(write_timeline(sys.argv[1], {trace["rankName"]: trace for trace in found}))
