"""A picture of a merged timeline (an example's --profile DIR/timeline.json), for a README: one
band per rank, its main thread and then its other threads (RPC's) packed into as few rows as
their overlap needs, a bar per top-level event with the events inside it as thinner bars, named
where they are wide enough. `make pictures` draws the READMEs' pictures with it.

    python bench/draw_timeline.py traces/timeline.json picture.png [--step "ProfilerStep#3"]
    python bench/draw_timeline.py traces/timeline.json picture.png [--first NAME] [--last NAME]

--step crops the picture to the first event named so (a looping rank's step, in rank order);
--first and --last to the span from the start of the first event whose name starts with NAME to
the end of the last such (default: every event)."""

import argparse
import json
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")  # files only, no screen
import matplotlib.pyplot as plt  # noqa: E402 - after the backend is chosen

COLORS = {"rpc": "#4c72b0", "aten": "#dd8452", "other": "#8c8c8c"}


def lanes(trace):
    """{track name: {row name: [(name, start us, duration us, depth)]}}, in the trace's track
    order: a track's main thread (its lowest thread id), then its other threads' top-level
    events (depth 0) and the ones directly inside them (depth 1), packed into rows."""
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    order = {e["pid"]: e["args"]["sort_index"] for e in events
             if e.get("name") == "process_sort_index"}
    threads = defaultdict(lambda: defaultdict(list))
    for event in events:
        if event.get("ph") == "X" and event.get("pid") in names:
            threads[event["pid"]][event.get("tid")].append(
                (event["name"], float(event["ts"]), float(event.get("dur", 0))))
    tracks = {}
    for pid in sorted(threads, key=lambda p: order.get(p, p)):
        by_thread = {tid: nest(bars) for tid, bars in threads[pid].items()}
        main = min(by_thread, key=lambda tid: (not isinstance(tid, int), str(tid).zfill(12)))
        rows = {"main thread": by_thread.pop(main)} if len(by_thread) > 1 else {}
        rows.update(pack(by_thread.values(), "other threads" if rows else "thread"))
        tracks[names[pid]] = rows
    return tracks


def nest(bars):
    """A thread's events with their depth: 0 at the top, 1 directly inside; deeper left out."""
    nested, open_ = [], []  # open_: the ends of the events that enclose the next one
    for name, start, duration in sorted(bars, key=lambda bar: (bar[1], -bar[2])):
        while open_ and open_[-1] <= start:
            open_.pop()
        if len(open_) < 2:
            nested.append((name, start, duration, len(open_)))
        open_.append(start + duration)
    return nested


def pack(threads, label):
    """Rows for the threads' events: each thread's top-level events (with what is inside them)
    go in the first row free over their whole span."""
    rows = []  # [(end of the last top-level event, [events])]
    for bars in threads:
        for group in _groups(bars):
            start, end = group[0][1], group[0][1] + group[0][2]
            for index, (row_end, row) in enumerate(rows):
                if row_end <= start:
                    rows[index] = (end, row + group)
                    break
            else:
                rows.append((end, group))
    return {f"{label}{f' {index + 1}' if len(rows) > 1 else ''}": row
            for index, (_, row) in enumerate(rows)}


def _groups(bars):
    group = []
    for bar in bars:
        if bar[3] == 0 and group:
            yield group
            group = []
        group.append(bar)
    if group:
        yield group


def window(tracks, first=None, last=None, step=None):
    """(start, end) in us: every event; the first event named `step`; or from the first event
    named first* to the end of the last one named last*."""
    every = [bar for rows in tracks.values() for bars in rows.values() for bar in bars]
    if step is not None:
        found = [(start, start + duration) for name, start, duration, _ in every if name == step]
        if not found:
            raise SystemExit(f"no event named {step} in the timeline")
        return found[0]
    starts = [start for name, start, _, _ in every if first is None or name.startswith(first)]
    ends = [start + duration for name, start, duration, _ in every
            if last is None or name.startswith(last)]
    if not starts or not ends:
        raise SystemExit(f"no event named {first if not starts else last}* in the timeline")
    return min(starts), max(ends)


def color(name):
    if name.startswith("rpc_"):
        return COLORS["rpc"]
    return COLORS["aten"] if name.startswith("aten::") else COLORS["other"]


def draw(trace, path, first=None, last=None, title=None, step=None):
    tracks = lanes(trace)
    start, end = window(tracks, first, last, step)
    span = end - start
    rows = [(track, row, bars) for track, track_rows in tracks.items()
            for row, bars in track_rows.items()
            if any(s < end and s + d > start for _, s, d, _ in bars)]
    figure, axes = plt.subplots(figsize=(11, 0.55 * len(rows) + 1.4))
    for y, (_, _, bars) in enumerate(rows):
        for name, s, d, depth in bars:
            if s >= end or s + d <= start:
                continue
            left = (max(s, start) - start) / 1e3
            width = max(min(s + d, end) - max(s, start), span / 2000) / 1e3
            height = 0.75 if depth == 0 else 0.35
            axes.barh(y + (0 if depth == 0 else 0.12), width, left=left, height=height,
                      color=color(name), edgecolor="white", linewidth=0.3,
                      alpha=1.0 if depth == 0 else 0.85)
            if width * 1e3 > span / (9 if depth == 0 else 6):  # wide enough to name inside
                axes.text(left + width / 2, y + (-0.2 if depth == 0 else 0.12), name,
                          ha="center", va="center", fontsize=7 if depth == 0 else 6,
                          color="white", clip_on=True)
    axes.set_yticks(range(len(rows)), [f"{track}: {row}" for track, row, _ in rows], fontsize=8)
    axes.invert_yaxis()
    axes.set_xlim(0, span / 1e3)
    axes.set_xlabel("ms from the start of the window shown")
    axes.set_title(title or "one timeline of every rank", fontsize=10)
    for label, shade in COLORS.items():
        axes.barh(0, 0, color=shade, label={"rpc": "RPC: a call (rpc_async#...)",
                                            "aten": "operator", "other": "other"}[label])
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.5 / max(1, len(rows)) - 0.12),
                ncol=3, fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("timeline", help="a merged timeline.json")
    parser.add_argument("picture", help="the PNG to write")
    parser.add_argument("--first", help="crop from the first event whose name starts so")
    parser.add_argument("--last", help="crop to the end of the last event whose name starts so")
    parser.add_argument("--step", help="crop to the first event with this name "
                                       "(\"ProfilerStep#3\", a looping rank's 4th step)")
    parser.add_argument("--title", help="the picture's title")
    args = parser.parse_args(argv)
    with open(args.timeline) as file:
        trace = json.load(file)
    draw(trace, args.picture, args.first, args.last, args.title, args.step)
    print(f"Wrote {args.picture}")


if __name__ == "__main__":
    main()
