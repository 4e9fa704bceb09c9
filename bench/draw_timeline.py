"""A picture of a merged timeline (an example's --profile DIR/timeline.json), for a README: one
band per rank, a lane per thread that did anything, a bar per profiled event, named where it is
wide enough. `make pictures` draws the READMEs' pictures with it.

    python bench/draw_timeline.py traces/timeline.json picture.png [--first NAME] [--last NAME]

--first and --last crop the picture to the span from the start of the first event whose name
starts with NAME to the end of the last such (default: every event)."""

import argparse
import json
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")  # files only, no screen
import matplotlib.pyplot as plt  # noqa: E402 - after the backend is chosen

COLORS = {"rpc": "#4c72b0", "aten": "#dd8452", "other": "#8c8c8c"}


def lanes(trace):
    """{track name: {thread: [(name, start us, duration us)]}}, in the trace's track order."""
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    order = {e["pid"]: e["args"]["sort_index"] for e in events
             if e.get("name") == "process_sort_index"}
    tracks = defaultdict(lambda: defaultdict(list))
    for event in events:
        if event.get("ph") == "X" and event.get("pid") in names:
            tracks[event["pid"]][event.get("tid")].append(
                (event["name"], float(event["ts"]), float(event.get("dur", 0))))
    return {names[pid]: dict(tracks[pid]) for pid in sorted(tracks, key=lambda p: order.get(p, p))}


def window(tracks, first=None, last=None):
    """(start, end) in us: every event, or from the first event named first* to the end of the
    last one named last*."""
    every = [event for threads in tracks.values() for bars in threads.values() for event in bars]
    starts = [start for name, start, _ in every if first is None or name.startswith(first)]
    ends = [start + duration for name, start, duration in every
            if last is None or name.startswith(last)]
    if not starts or not ends:
        raise SystemExit(f"no event named {first if not starts else last}* in the timeline")
    return min(starts), max(ends)


def color(name):
    if name.startswith("rpc_"):
        return COLORS["rpc"]
    return COLORS["aten"] if name.startswith("aten::") else COLORS["other"]


def draw(trace, path, first=None, last=None, title=None):
    tracks = lanes(trace)
    start, end = window(tracks, first, last)
    span = end - start
    rows = [(track, thread, bars) for track, threads in tracks.items()
            for thread, bars in threads.items()
            if any(s < end and s + d > start for _, s, d in bars)]
    figure, axes = plt.subplots(figsize=(11, 0.6 * len(rows) + 1.4))
    for y, (_, _, bars) in enumerate(rows):
        for name, s, d in bars:
            if s >= end or s + d <= start:
                continue
            left, width = (s - start) / 1e3, max(d, span / 2000) / 1e3
            axes.barh(y, width, left=left, height=0.7, color=color(name), edgecolor="white",
                      linewidth=0.3)
            if d > span / 12:  # wide enough to name inside
                axes.text(left + width / 2, y, name, ha="center", va="center", fontsize=7,
                          color="white", clip_on=True)
            elif d > span / 100:  # named beside it
                axes.text(left + width, y - 0.4, f" {name} {d:.0f} us", ha="left",
                          va="bottom", fontsize=7, clip_on=True)
    axes.set_yticks(range(len(rows)),
                    [f"{track}, thread {thread}" for track, thread, _ in rows], fontsize=8)
    axes.invert_yaxis()
    axes.set_xlim(0, span / 1e3)
    axes.set_xlabel("ms from the start of the first event shown")
    axes.set_title(title or "one timeline of every rank", fontsize=10)
    for label, shade in COLORS.items():
        axes.barh(0, 0, color=shade, label={"rpc": "RPC (caller's span)", "aten": "operator",
                                            "other": "other"}[label])
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=3, fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("timeline", help="a merged timeline.json")
    parser.add_argument("picture", help="the PNG to write")
    parser.add_argument("--first", help="crop from the first event whose name starts so")
    parser.add_argument("--last", help="crop to the end of the last event whose name starts so")
    parser.add_argument("--title", help="the picture's title")
    args = parser.parse_args(argv)
    with open(args.timeline) as file:
        trace = json.load(file)
    draw(trace, args.picture, args.first, args.last, args.title)
    print(f"Wrote {args.picture}")


if __name__ == "__main__":
    main()
