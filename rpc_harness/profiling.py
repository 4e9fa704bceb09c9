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


class Profile:
    """One rank's --profile: its profiler, and what the merge reads in its trace. The rank's
    state (rank.Rank) holds it; its main thread steps it, its watch stops a serving rank's."""

    def __init__(self, args, rank, name, store, run):
        """At the join, on the main thread (Kineto must first start there, and torch 2.4 stop
        there): a rank that serves starts recording now; one that loops, at its first step."""
        self.folder = Path(args.profile)
        self.steps = args.profile_steps
        self.loop_count = len(args.harness.loops)
        self.name = name
        self.store = store
        self.loops = rank in args.harness.loops
        self.meta = {"rank": rank, "rankName": name, "run": run}
        self.prof = None  # None before it starts, False once written
        self.written = None  # the line that says where the trace went
        self.lock = threading.Lock()  # the trace is written once, by the first thread to ask
        if self.loops:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
                pass
        else:
            self.prof = self._start(on_trace_ready=self._write)

    def _start(self, **kwargs):
        """A started profiler, with this rank's metadata, which the merge reads."""
        prof = torch.profiler.profile(**profiler_options()[0], **kwargs)
        for key, value in self.meta.items():
            prof.preset_metadata_json(key, json.dumps(value))
        prof.start()
        return prof

    def step(self):
        """One step of a looping rank: the window opens after WARMUP_STEPS."""
        if self.prof is None:
            self.prof = self._start(on_trace_ready=self._write, schedule=torch.profiler.schedule(
                wait=WARMUP_STEPS - 1, warmup=1, active=self.steps, repeat=1))
        elif self.prof:
            self.prof.step()

    def beat(self):
        """Once a heartbeat: a serving rank stops recording once every loop's window has closed.
        Rank 0's store may be gone (rank 0 ended): then the rank is ending too."""
        if self.loops or not self.prof:
            return
        with contextlib.suppress(RuntimeError):
            if self.store.add(_CLOSED, 0) >= self.loop_count:
                self._stop()

    def end(self, seconds=None):
        """Write the trace; the line that says where it went, or None. When the rank stops early,
        within `seconds`, or the trace is left out."""
        if seconds is None:
            self._stop()
            return self.written
        writing = threading.Thread(target=self._stop, daemon=True, name="rpc_harness trace")
        writing.start()
        writing.join(seconds)
        if writing.is_alive():
            return f"{self.name}: its trace was not written within {seconds:g} s, and is left out"
        return self.written

    def _stop(self):
        """Stop the profiler (its trace is written by _write), once, whichever thread asks first."""
        # RuntimeError: torch 2.4 stops a profiler only from the thread that started it (compat.py)
        with self.lock, contextlib.suppress(RuntimeError):
            if self.prof:
                self.prof.stop()

    def _write(self, prof):
        """The profiler's on_trace_ready: the trace, written whole under this rank's name."""
        self.prof = False
        path, part = self.folder / f"{self.name}.json", self.folder / f".{self.name}.json"
        prof.export_chrome_trace(str(part))
        part.replace(path)  # whole or not at all: the rank may be killed meanwhile
        self.written = f"{self.name}: profiled, wrote {path} ({path.stat().st_size // 1024} kB)" + (
            "" if profiler_options()[1] else f"; torch {torch.__version__} records only the "
            "thread that started the profiler, not the threads where RPCs run")
        if self.loops:
            with contextlib.suppress(RuntimeError):  # rank 0's store, gone as this rank ends
                self.store.add(_CLOSED, 1)


def write_timeline_of_every_rank(profile, names):
    """Rank 0, at the end: the timeline of every rank's trace of this run (`profile`: rank 0's),
    if all are here (the ranks of other machines wrote theirs there); otherwise how to merge
    them."""
    traces = {}
    for name in names:
        path = profile.folder / f"{name}.json"
        if path.exists():
            traces[name] = json.loads(path.read_text())
    missing = [name for name in names if traces.get(name, {}).get("run") != profile.meta["run"]]
    if missing:
        print(f"{profile.name}: the traces of {', '.join(missing)} are not in {profile.folder} "
              "here: put every rank's trace in one folder and run `python -m "
              "rpc_harness.profiling FOLDER`")
    else:
        print(f"{profile.name}: {write_timeline(profile.folder, traces)}")


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
