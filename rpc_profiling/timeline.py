"""Not in the recipe: profiling every rank the way today's torch can, and one timeline of them
all. The recipe's profiler recorded the callee's operators on the caller; the profiler of
torch 2.x records only the process it runs in, so each rank profiles itself, rank 0 gathers the
traces, and merge() lays them out side by side, a named track per rank, for Perfetto
(https://ui.perfetto.dev) or chrome://tracing."""

import json
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity


def profiler_options():
    """torch.profiler.profile's arguments, and whether it records every thread of the process:
    an RPC runs on one of TensorPipe's threads, which the profiler leaves out unless told
    (profile_all_threads, pytorch/pytorch#143659; torch 2.4 lacks it)."""
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    try:
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except TypeError:  # an older torch: its constructor does not know the argument
        return {"activities": activities}, False
    return {"activities": activities, "experimental_config": config}, True


def export(prof, path):
    """Write prof's Chrome trace to path; its text, and a line that says where and how big."""
    prof.export_chrome_trace(str(path))
    text = Path(path).read_text()
    return text, f"Wrote trace to {path} ({len(text) / 1024:.0f} kB)"


def merge(traces, offsets_ns=None):
    """One Chrome trace of every rank's: `traces` maps a rank's name to its trace's text,
    `offsets_ns` a rank's name to how far its clock is ahead of the first rank's (ranks on
    other machines; on one machine every rank reads the same clock). Each rank's processes
    (its CPU threads, a GPU) become tracks named after it, in rank order."""
    offsets_ns = offsets_ns or {}
    loaded = {name: json.loads(text) for name, text in traces.items()}
    base_ns = min(trace.get("baseTimeNanoseconds", 0) for trace in loaded.values())
    events = []
    for index, (name, trace) in enumerate(loaded.items()):
        # the profiler writes times in microseconds after its baseTimeNanoseconds
        shift_us = (trace.get("baseTimeNanoseconds", 0) - base_ns - offsets_ns.get(name, 0)) / 1e3
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
