"""One timeline from the ranks' --profile traces: each rank writes its own torch.profiler trace,
DIR/<its name>.json, and this merges them into DIR/timeline.json, a track per rank in rank
order, on one clock, for https://ui.perfetto.dev. rpcrun does it when a run with --profile ends;
by hand (the traces of several machines gathered in one folder):

    python -m rpc_harness.timeline DIR

Standard library only: it reads the traces as JSON."""

import json
import sys
from pathlib import Path

TIMELINE = "timeline.json"


def read_traces(folder, newer_than=0.0):
    """The rank traces in folder (name -> trace), in rank order: the JSON files that a rank's
    torch.profiler wrote with its rank as metadata (`"rank": R` at the top), last changed after
    `newer_than` (a time.time(); an earlier run's traces in the same folder are left out)."""
    found = []
    for path in Path(folder).glob("*.json"):
        if path.name == TIMELINE or path.stat().st_mtime < newer_than:
            continue
        try:
            trace = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(trace, dict) and isinstance(trace.get("rank"), int):
            found.append((trace["rank"], path.stem, trace))
    return {name: trace for _, name, trace in sorted(found, key=lambda item: item[:2])}


def merge(traces):
    """One Chrome trace, a track per process in the order given (`traces`: a name -> its
    trace), on one clock: each trace's times are microseconds after its own
    baseTimeNanoseconds."""
    base_ns = min(trace.get("baseTimeNanoseconds", 0) for trace in traces.values())
    events = []
    for track, (name, trace) in enumerate(traces.items()):
        shift_us = (trace.get("baseTimeNanoseconds", 0) - base_ns
                    - trace.get("clockOffsetNs", 0)) / 1e3
        events.append({"ph": "M", "name": "process_name", "pid": track, "args": {"name": name}})
        for event in trace.get("traceEvents", []):
            # The track's name replaces each process's own; the profiler's bookkeeping
            # ("Spans", the window's end) has no integer pid, and holds none of the work.
            if not isinstance(event.get("pid"), int):
                continue
            if event.get("name", "").startswith("process_"):
                continue
            moved = {**event, "pid": track}
            if "ts" in event:
                moved["ts"] = float(event["ts"]) + shift_us
            events.append(moved)
    return {"traceEvents": events, "displayTimeUnit": "ms", "baseTimeNanoseconds": base_ns}


def write_timeline(folder, newer_than=0.0):
    """Write DIR/timeline.json from the rank traces in folder; the line that says what it did,
    or None where the folder holds no rank trace."""
    traces = read_traces(folder, newer_than)
    if not traces:
        return None
    path = Path(folder) / TIMELINE
    part = path.with_name(f".{TIMELINE}")
    part.write_text(json.dumps(merge(traces)))
    part.replace(path)  # whole or not at all
    return (f"wrote the timeline of {len(traces)} ranks to {path} "
            f"({path.stat().st_size // 1024} kB): open it in https://ui.perfetto.dev")


def main(argv=None):
    """python -m rpc_harness.timeline DIR."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: python -m rpc_harness.timeline DIR (a folder of the ranks' --profile "
              "traces)", file=sys.stderr)
        return 2
    line = write_timeline(argv[0])
    if line is None:
        print(f"{argv[0]}: no rank's trace there (a JSON file with its rank at the top)",
              file=sys.stderr)
        return 1
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
