"""--profile DIR: each process profiles itself with a Recorder and writes DIR/<its name>.json;
one merges the traces into DIR/timeline.json, a track per process, for https://ui.perfetto.dev.
`python -m rpc_harness.profiling FOLDER` merges the traces of a folder (ranks of several
machines, gathered there).

A process that loops (a trainer, the agent) calls step() once a step: the window opens after
WARMUP_STEPS and records --profile_steps steps (torch's ProfilerStep#N spans). A process that
serves others (a parameter server under RPC) records from start() until stop(), or until every
looping rank's window has closed (start_until)."""

import contextlib
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

from .compat import profiler_options

WARMUP_STEPS = 2
TIMELINE = "timeline.json"


class Recorder:
    """One process's --profile: its profiler and its trace (folder None: no --profile, and the
    recorder does nothing)."""

    def __init__(self, folder, steps, rank, name, run=None):
        self.folder = folder and Path(folder)
        self.steps = steps
        self.name = name
        self.run = run  # which run the trace is of (the RPC ranks': rank 0's host and pid)
        self.meta = {"rank": rank, "rankName": name, "run": run}
        self.prof = None if folder else False  # None before it starts, False once written
        self.lock = threading.Lock()  # the trace is written once, by the first thread to ask
        self.on_written = None  # a looping rank's: called once its trace is written

    def _start(self, **kwargs):
        """A started profiler, with this process's metadata, which the merge reads."""
        prof = torch.profiler.profile(**profiler_options()[0], on_trace_ready=self._write,
                                      **kwargs)
        for key, value in self.meta.items():
            prof.preset_metadata_json(key, json.dumps(value))
        prof.start()
        return prof

    def start(self):
        """A process that serves: record from now on."""
        if self.prof is None:
            self.prof = self._start()

    def step(self):
        """One step of a process that loops: the window opens after WARMUP_STEPS."""
        if self.prof is None:
            self.prof = self._start(schedule=torch.profiler.schedule(
                wait=WARMUP_STEPS - 1, warmup=1, active=self.steps, repeat=1))
        elif self.prof:
            self.prof.step()

    def start_until(self, windows_closed):
        """A process that serves: record from now on, until windows_closed() says that every
        looping rank's window has closed; asked every second, on a thread of its own, as the
        store that counts them may be slow to answer."""
        self.start()
        threading.Thread(target=self._stop_when, args=(windows_closed,), daemon=True,
                         name="rpc_harness profile").start()

    def _stop_when(self, windows_closed):
        while self.prof:
            time.sleep(1.0)
            with contextlib.suppress(RuntimeError):  # the store is gone: the rank is ending
                if windows_closed():
                    self._stop()
                    return

    def stop(self, seconds=None):
        """Write the trace, and print where it went. When the process stops early, within
        `seconds`, or the trace is left out."""
        if seconds is None:
            self._stop()
            return
        writing = threading.Thread(target=self._stop, daemon=True, name="rpc_harness trace")
        writing.start()
        writing.join(seconds)

    def _stop(self):
        """Stop the profiler (its trace is written by _write), once, whichever thread asks
        first. torch 2.4 stops a profiler only from the thread that started it (compat.py)."""
        with self.lock, contextlib.suppress(RuntimeError):
            if self.prof:
                self.prof.stop()

    def _write(self, prof):
        """The profiler's on_trace_ready: the trace, written whole under this process's name."""
        self.prof = False
        path = self.folder / f"{self.name}.json"
        part = self.folder / f".{self.name}.json"
        prof.export_chrome_trace(str(part))
        part.replace(path)  # whole or not at all: the process may be killed meanwhile
        line = f"{self.name}: profiled, wrote {path} ({path.stat().st_size // 1024} kB)"
        if not profiler_options()[1]:
            line += (f"; torch {torch.__version__} records only the thread that started the "
                     "profiler, not the threads where RPCs run")
        print(line, flush=True)
        if self.on_written:
            with contextlib.suppress(RuntimeError):  # rank 0's store, gone as this rank ends
                self.on_written()


def write_timeline(folder, names, run=None):
    """DIR/timeline.json from the traces of `names` (a track each, in that order) of one run
    (`run`, as their recorders had it); or, where some are not in the folder (ranks of other
    machines wrote theirs there), what to do. Returns the line that says which."""
    traces = {}
    for name in names:
        path = Path(folder) / f"{name}.json"
        if path.exists():
            trace = json.loads(path.read_text())
            if trace.get("run") == run:
                traces[name] = trace
    missing = [name for name in names if name not in traces]
    if missing:
        return (f"the traces of {', '.join(missing)} are not in {folder} here: put every "
                "rank's trace in one folder and run `python -m rpc_harness.profiling FOLDER`")
    return save_timeline(folder, traces)


def save_timeline(folder, traces):
    """Write the merged timeline of `traces` (a name -> its trace) into folder; what it did."""
    path = Path(folder) / TIMELINE
    path.write_text(json.dumps(merge(traces)))
    return (f"wrote the timeline of {len(traces)} ranks to {path} "
            f"({path.stat().st_size // 1024} kB): open it in https://ui.perfetto.dev")


def merge(traces):
    """One Chrome trace, a track per process in the order given (`traces`: a name -> its
    trace), on one clock."""
    base_ns = min(trace.get("baseTimeNanoseconds", 0) for trace in traces.values())
    events = []
    for track, (name, trace) in enumerate(traces.items()):
        shift_us = (trace.get("baseTimeNanoseconds", 0) - base_ns  # times: us after the base
                    - trace.get("clockOffsetNs", 0)) / 1e3
        events.append({"ph": "M", "name": "process_name", "pid": track, "args": {"name": name}})
        for event in trace["traceEvents"]:
            # The track's name replaces each process's own; the profiler's bookkeeping
            # ("Spans", the window's end) has no integer pid, and nothing of the work.
            if not isinstance(event.get("pid"), int):
                continue
            if event.get("name", "").startswith("process_"):
                continue
            moved = {**event, "pid": track}
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
    print(save_timeline(sys.argv[1], {trace["rankName"]: trace for trace in traces}))


if __name__ == "__main__":
    main()
