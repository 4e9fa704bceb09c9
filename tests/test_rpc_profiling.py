"""rpc_profiling: the recipe's log lines and files, every rank's profile, and one timeline in
which the callee's operators fall inside the caller's spans of the RPCs that ran them."""

import importlib.util
import json
import re

import pytest
from conftest import ROOT, TCP, find_free_port, run_example

from rpc_harness import profiling
from rpc_harness.compat import profiler_options

# --------- Pure logic, in-process --------------------

def kineto_trace(base_s, pid, events):
    """A trace as torch.profiler writes it: metadata, its bookkeeping tracks, then events (name,
    ts in us after baseTimeNanoseconds, dur) of one CPU process and, at pid 0, of a GPU."""
    return {"baseTimeNanoseconds": base_s * 10**9, "traceEvents": [
        {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": "python"}},
        {"ph": "M", "name": "process_labels", "pid": pid, "args": {"labels": "CPU"}},
        {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "GPU 0"}},
        {"ph": "X", "name": "PyTorch Profiler (0)", "pid": "Spans", "tid": 0, "ts": 0, "dur": 9},
        {"ph": "i", "name": "Record Window End", "pid": "", "tid": "", "ts": 9},
        *({"ph": "X", "name": name, "pid": event_pid, "tid": 7, "ts": ts, "dur": dur}
          for name, event_pid, ts, dur in events)]}


def test_merge_names_a_track_per_rank_and_puts_every_event_on_one_clock():
    traces = {"worker0": kineto_trace(100, 4242, [("rpc_async#add", 4242, 1000.0, 50)]),
              "worker1": {**kineto_trace(101, 777, [("aten::add", 777, 10.0, 5),
                                                    ("kernel", 0, 12.0, 1)]),
                          "clockOffsetNs": 2_000}}  # worker1's clock 2 us ahead
    merged = profiling.merge(traces)
    names = {e["pid"]: e["args"]["name"] for e in merged["traceEvents"]
             if e["name"] == "process_name"}
    assert names == {0: "worker0", 1: "worker1"}  # the GPU's events in worker1's track
    work = {e["name"]: e for e in merged["traceEvents"] if e["ph"] == "X"}
    assert set(work) == {"rpc_async#add", "aten::add", "kernel"}  # bookkeeping dropped
    assert names[work["aten::add"]["pid"]] == names[work["kernel"]["pid"]] == "worker1"
    # worker1's trace starts 1 s later and its clock runs 2 us ahead
    assert work["aten::add"]["ts"] == pytest.approx(1_000_000 + 10.0 - 2)
    assert work["rpc_async#add"]["ts"] == 1000.0
    assert merged["baseTimeNanoseconds"] == 100 * 10**9
    json.dumps(merged)  # a file Perfetto can read


# --------- A whole run --------------------

@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("profile")
    run = run_example("rpc_profiling", "--profile", folder, "--master_port", find_free_port())
    return run, folder


def test_the_recipes_log_lines_and_trace(profiled_run):
    run, folder = profiled_run
    assert run.returncode == 0, run.output
    for rank in (0, 1):
        lines = [f"DEBUG:root:worker{rank} successfully initialized RPC.",
                 f"DEBUG:root:Rank {rank} waiting for workers and shutting down RPC",
                 f"DEBUG:root:Rank {rank} shutdown RPC"]
        positions = [run.stdout.find(line) for line in lines]
        assert -1 not in positions and positions == sorted(positions), (rank, run.stdout)
    assert f"DEBUG:root:Wrote trace to {folder / 'trace.json'}" in run.stdout
    assert json.loads((folder / "trace.json").read_text())  # the recipe's trace, as it is now
    # what the recipe's profiles hold on this torch, said in a line
    assert re.search(r"^The recipe's two profiles hold \d+ events, \d+ of them run on worker1",
                     run.stdout, re.M)
    assert not re.search(r"USDT|ERROR:|\[W|Traceback", run.output), run.output  # no chatter


def test_every_rank_writes_its_trace_and_worker0_one_timeline(profiled_run):
    run, folder = profiled_run
    for name in ("worker0", "worker1"):
        assert json.loads((folder / f"{name}.json").read_text())["traceEvents"]
        assert re.search(rf"^{name}: Wrote trace to .*{name}\.json \(\d+ kB\)$", run.stdout,
                         re.M)
        assert f"{name}: top operators (self CPU time)" in run.stdout
    assert re.search(r"^Wrote the timeline of 2 ranks to .*timeline\.json \(\d+ kB\)",
                     run.stdout, re.M)
    merged = json.loads((folder / "timeline.json").read_text())
    tracks = {e["args"]["name"] for e in merged["traceEvents"] if e["name"] == "process_name"}
    assert {"worker0", "worker1"} <= tracks
    assert re.search(r"^Summary: the recipe's profiles: \d+ events, \d+ of worker1; worker1's own "
                     r"profile: \d+ operators; a timeline of 2 ranks; [\d.]+ s in all$",
                     run.stdout, re.M)


@pytest.mark.slow
def test_one_rank_per_command_writes_the_same_files(tmp_path, runs):
    """worker1 first, then worker0, each its own command: each writes its own trace, and
    worker0, which gets worker1's over RPC, the timeline."""
    common = ["--profile", tmp_path, "--master_port", find_free_port(), *TCP]
    worker1 = runs.start("rpc_profiling", *common, "--rank", 1)
    worker0 = runs.start("rpc_profiling", *common, "--rank", 0)
    for run in (worker0, worker1):
        run.wait(timeout=120)
        assert run.returncode == 0, run.output
        assert not run.leftovers()
    assert "worker1: Wrote trace" in worker1.stdout and "Summary:" in worker0.stdout
    tracks = {e["args"]["name"] for e in json.loads((tmp_path / "timeline.json").read_text())
              ["traceEvents"] if e["name"] == "process_name"}
    assert {"worker0", "worker1"} <= tracks


def test_the_callees_operators_fall_inside_the_callers_spans(profiled_run):
    """On worker1's track, the operators that worker0's RPCs ran there, each inside worker0's
    span of that RPC (one machine, one clock), where the installed torch records TensorPipe's
    threads; where it cannot, the run says so."""
    run, folder = profiled_run
    _, all_threads = profiler_options()
    if not all_threads:
        assert "records the main thread only" in run.stdout
        pytest.skip("this torch's profiler records no thread but the main one (no "
                    "profile_all_threads): worker1's RPC work cannot be in its trace")
    events = json.loads((folder / "timeline.json").read_text())["traceEvents"]
    tracks = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    spans = {e["name"].split("#")[1].split("(")[0]: e for e in events
             if tracks.get(e.get("pid")) == "worker0" and e["name"].startswith("rpc_async#")}
    assert set(spans) == {"aten::add", "aten::mul", "udf_with_ops"}, spans
    on_worker1 = [e for e in events if tracks.get(e.get("pid")) == "worker1" and e["ph"] == "X"]

    def inside(span, operator):
        return [e for e in on_worker1 if e["name"] == operator
                and span["ts"] <= e["ts"] and e["ts"] + e["dur"] <= span["ts"] + span["dur"]]

    assert inside(spans["aten::add"], "aten::add")
    assert inside(spans["aten::mul"], "aten::mul")
    # the function: two random tensors, then add and mul, after its second of sleep
    udf = spans["udf_with_ops"]
    assert udf["dur"] >= 1e6
    assert len(inside(udf, "aten::rand")) == 2
    assert inside(udf, "aten::add") and inside(udf, "aten::mul")


# --------- The picture of a timeline (bench/draw_timeline.py) --------------------

def test_the_picture_of_a_stored_timeline(tmp_path):
    spec = importlib.util.spec_from_file_location("draw_timeline",
                                                  ROOT / "bench" / "draw_timeline.py")
    draw = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(draw)
    merged = profiling.merge({
        "worker0": kineto_trace(100, 4242, [("rpc_async#aten::add(worker0 -> worker1)", 4242,
                                             0.0, 1900), ("aten::set_", 4242, 1600.0, 10)]),
        "worker1": kineto_trace(100, 777, [("aten::add", 777, 1100.0, 40),
                                           ("aten::mul", 777, 9000.0, 40)])})
    tracks = draw.lanes(merged)
    assert list(tracks) == ["worker0", "worker1"]  # rank order
    assert draw.window(tracks, "rpc_async#", "rpc_async#") == (0.0, 1900.0)
    assert draw.window(tracks) == (0.0, 9040.0)
    with pytest.raises(SystemExit, match="no event named nothing"):
        draw.window(tracks, "nothing")
    (tmp_path / "timeline.json").write_text(json.dumps(merged))
    draw.main([str(tmp_path / "timeline.json"), str(tmp_path / "t.png"), "--first", "rpc_"])
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
