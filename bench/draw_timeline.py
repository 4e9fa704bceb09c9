"""A picture of a merged timeline (an example's --profile DIR/timeline.json), for a README: one
band per rank, and in it a row for each kind of thread, named by what its threads do (the main
thread, RPC's threads, distributed autograd's, Gloo's, TensorPipe's), each kind's threads packed
into as few rows as their overlap needs; a bar per top-level event with the events inside it as
thinner bars, named where they are wide enough; a legend of the colours drawn. `make pictures`
draws the READMEs' pictures with it.

    python bench/draw_timeline.py traces/timeline.json picture.png [--step "ProfilerStep#3"]
    python bench/draw_timeline.py traces/timeline.json picture.png [--first NAME] [--last NAME]

--step crops the picture to the first event named so (a looping rank's step, in rank order);
--first and --last to the span from the start of the first event whose name starts with NAME to
the end of the last such (default: every event)."""

import argparse
import json
import re
import textwrap
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")  # files only, no screen
import matplotlib.pyplot as plt  # noqa: E402 - after the backend is chosen

# The kinds of thread, in the order drawn, each with what its threads do. torch.profiler names a
# thread after the pool that started it ("thread 4242 (pt_thread_pool)"); a thread that Python
# or the main thread started is "python", and the main thread is the first of those.
ROLES = {
    "main": "main thread",
    "rpc": "RPC threads (run the calls)",
    "backward": "autograd threads (backward)",
    "gloo": "Gloo threads (collectives)",
    "tensorpipe": "TensorPipe threads (receive)",
    "other": "other threads",
}
POOLS = [("TP_", "tensorpipe"), ("pt_gloo", "gloo"), ("PTThreadPool", "backward"),
         ("pt_thread_pool", "rpc")]  # a name's start, its kind; the first that fits wins

# The kinds of event, their colours and their legend's words.
KINDS = {
    "step": ("#e3e3e3", "a step of the loop (ProfilerStep#N)"),
    "rpc": ("#4c72b0", "an RPC, as the program marks it (rpc_async#...)"),
    "forward": ("#64b5cd", "forward pass of a micro-batch (Forward N)"),
    "backward": ("#55a868", "backward pass (autograd)"),
    "collective": ("#8172b3", "collective (gloo:..., c10d::...)"),
    "aten": ("#dd8452", "operator (aten::...)"),
    "unnamed": ("#8c8c8c", "a span the trace leaves unnamed"),
    "other": ("#c44e52", "other"),
}


def role(names, is_main, bars):
    """The kind of a thread, from its names in the trace (a thread id that the system gave
    again may have two) and, for one the trace leaves unnamed, from what it ran."""
    for start, kind in POOLS:
        if any(name.startswith(start) for name in names):
            return kind
    if is_main:
        return "main"
    if not names and any(event_kind(name) == "backward" for name, *_ in bars):
        return "backward"  # autograd's threads that started after the trace named threads
    return "other"


def lanes(trace):
    """{track name: {kind of thread: [a thread's events]}}, in the trace's track order and in
    ROLES' order; each event (name, start us, duration us, depth): 0 at the top, 1 directly
    inside."""
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    order = {e["pid"]: e["args"]["sort_index"] for e in events
             if e.get("name") == "process_sort_index"}
    thread_names = defaultdict(set)  # (pid, tid): the pool names given to it
    for event in events:
        if event.get("name") == "thread_name":
            found = re.search(r"\((.*)\)$", event["args"].get("name", ""))
            thread_names[event["pid"], event.get("tid")].add(found.group(1) if found else "")
    threads = defaultdict(lambda: defaultdict(list))
    for event in events:
        if event.get("ph") == "X" and event.get("pid") in names:
            threads[event["pid"]][event.get("tid")].append(
                (event["name"], float(event["ts"]), float(event.get("dur", 0))))
    tracks = {}
    for pid in sorted(threads, key=lambda p: order.get(p, p)):
        # the main thread: the first that Python's process started (the lowest thread id of
        # those named "python"), when the trace names it
        pythons = [tid for (p, tid), given in thread_names.items()
                   if p == pid and given == {"python"} and isinstance(tid, int)]
        main = min(pythons, default=None)
        kinds = defaultdict(list)
        for tid, bars in sorted(threads[pid].items(), key=lambda item: str(item[0]).zfill(12)):
            given = thread_names.get((pid, tid), set()) - {"python"}
            kinds[role(given, tid == main, bars)].append(nest(bars))
        tracks[names[pid]] = {kind: kinds[kind] for kind in ROLES if kind in kinds}
    return tracks


def nest(bars):
    """A thread's events with their depth: 0 at the top, 1 directly inside; deeper left out. A
    send, receive or collective encloses nothing: the thread goes on while it runs (a pipeline
    stage's next micro-batch starts while the last one is sent)."""
    nested, open_ = [], []  # open_: the ends of the events that enclose the next one
    for name, start, duration in sorted(bars, key=lambda bar: (bar[1], -bar[2])):
        while open_ and open_[-1] <= start:
            open_.pop()
        if len(open_) < 2:
            nested.append((name, start, duration, len(open_)))
        if event_kind(name) != "collective":
            open_.append(start + duration)
    return nested


def pack(threads, start, end):
    """Rows for the events of a kind's threads that fall in [start, end): each top-level event
    (with what is inside it) goes in the first row free over its whole span."""
    groups = sorted((group for bars in threads for group in _groups(bars)
                     if group[0][1] < end and group[0][1] + group[0][2] > start),
                    key=lambda group: group[0][1])
    rows = []  # [(end of the last top-level event, [events])]
    for group in groups:
        first, last = group[0][1], group[0][1] + group[0][2]
        for index, (row_end, row) in enumerate(rows):
            if row_end <= first:
                rows[index] = (last, row + group)
                break
        else:
            rows.append((last, group))
    return [row for _, row in rows]


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
    every = [bar for kinds in tracks.values() for threads in kinds.values()
             for bars in threads for bar in bars]
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


def event_kind(name):
    """The kind of an event (KINDS), from its name."""
    if name.startswith("ProfilerStep#"):
        return "step"
    if name.startswith("rpc_"):
        return "rpc"
    if name.startswith("Forward "):
        return "forward"
    if not name:
        return "unnamed"
    if "Backward" in name or name.startswith(("torch::autograd::", "torch::distributed::autograd")):
        return "backward"
    if name.startswith(("gloo:", "c10d::", "nccl:")):
        return "collective"
    return "aten" if name.startswith("aten::") else "other"


def fits(name, width_px, depth):
    """Whether a bar this many pixels wide holds its name."""
    return width_px > len(name) * (5.4 if depth == 0 else 4.9) + 8


def draw(trace, path, first=None, last=None, title=None, step=None):
    tracks = lanes(trace)
    start, end = window(tracks, first, last, step)
    span = end - start
    rows = []  # (track, label, events): the label on a kind's first row only
    for track, kinds in tracks.items():
        for kind_of_thread, threads in kinds.items():
            for index, bars in enumerate(pack(threads, start, end)):
                rows.append((track, f"{track}: {ROLES[kind_of_thread]}" if index == 0 else "",
                             bars))
    height_in = 0.45 * len(rows) + 1.9
    figure, axes = plt.subplots(figsize=(11, height_in))
    px_per_us = 11 * 110 * 0.78 / span  # about: the axes take 78% of the picture's width
    drawn = set()
    for y, (_, _, bars) in enumerate(rows):
        shown = [bar for bar in bars if bar[1] < end and bar[1] + bar[2] > start]
        # where a narrow top-level bar has room to be named beside it: until the next one
        tops = sorted((bar[1], bar[1] + bar[2]) for bar in shown if bar[3] == 0)
        room = {s: (after - e) * px_per_us
                for (s, e), (after, _) in zip(tops, tops[1:] + [(end, end)], strict=True)}
        # sends, receives and collectives first, so that the work beside them draws on top
        for name, s, d, depth in sorted(shown, key=lambda bar: event_kind(bar[0]) != "collective"):
            left = (max(s, start) - start) / 1e3
            width = max(min(s + d, end) - max(s, start), span / 2000) / 1e3
            height = 0.75 if depth == 0 else 0.35
            shade = KINDS[event_kind(name)][0]
            drawn.add(event_kind(name))
            axes.barh(y + (0 if depth == 0 else 0.12), width, left=left, height=height,
                      color=shade, edgecolor="white", linewidth=0.3)
            dark = event_kind(name) == "step"
            if fits(name, width * 1e3 * px_per_us, depth):  # its name inside
                axes.text(left + width / 2, y + (-0.2 if depth == 0 else 0.12), name,
                          ha="center", va="center", fontsize=7 if depth == 0 else 6,
                          color="black" if dark else "white", clip_on=True)
            elif depth == 0 and name and room[s] > 5.5 * len(name) + 12:  # beside it
                axes.text(left + width, y, f" {name}", ha="left", va="center", fontsize=6,
                          color="black", clip_on=True)
    # a line between the ranks
    for y, (track, _, _) in enumerate(rows):
        if y and track != rows[y - 1][0]:
            axes.axhline(y - 0.5, color="#555555", linewidth=0.8)
    axes.set_yticks(range(len(rows)), [label for _, label, _ in rows], fontsize=8)
    axes.tick_params(axis="y", length=0)
    axes.set_ylim(len(rows) - 0.5, -0.5)
    axes.set_xlim(0, span / 1e3)
    axes.set_xlabel("ms from the start of the window shown")
    axes.set_title(textwrap.fill(title or "one timeline of every rank", 110), fontsize=10)
    # the legend: the kinds of event drawn, and only those
    shown = [k for k in KINDS if k in drawn]
    handles = [plt.Rectangle((0, 0), 1, 1, color=KINDS[k][0]) for k in shown]
    figure.legend(handles, [KINDS[k][1] for k in shown], loc="lower center", ncol=3,
                  fontsize=7, frameon=False)
    legend_in = 0.1 + 0.17 * -(-len(shown) // 3)
    figure.tight_layout(rect=(0, legend_in / height_in, 1, 1))
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
