"""rpc_profiling: the recipe's log lines and trace, each rank's --profile trace (in which the
callee's operators fall inside the caller's spans of the RPCs that ran them), the summary, bad
input, and the folder copied alone into a Python without this project."""

import json
import re
from types import SimpleNamespace

import pytest
from conftest import (
    ALONE,
    ROOT,
    Run,
    copy_example,
    find_free_port,
    merge,
    outside_imports,
    read_traces,
    records_every_thread,
)
from example_modules import load_example

extras = load_example("rpc_profiling", "extras")

# A rank's line once its trace is written whole (check_timeline's, in conftest.py).
PROFILED = r"^{name}: profiled, wrote .*{name}\.json \(\d+ kB\)"
# worker0's summary of a run with --profile
SUMMARY = (r"Summary: the recipe's profiles: \d+ events, \d+ of worker1; worker1's own profile: "
           r"\d+ operators; [\d.]+ s in all")


# --------- The command line, in-process --------------------

def error_of(capsys, *argv):
    """extras.parse_args's refusal of argv: status 2 and one line, argparse's error."""
    with pytest.raises(SystemExit) as end:
        extras.parse_args([str(word) for word in argv])
    assert end.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and ": error: " in lines[0], lines
    return lines[0]


@pytest.mark.parametrize("argv, message", [
    (["--world_size", 1], "argument --world_size/--world-size: must be at least 2, got 1"),
    (["--world-size", "two"], "must be a whole number, got two"),
    (["--rank", 2], "argument --rank: 2 is outside a world of 2 (ranks 0 to 1)"),
    (["--rank", -1], "argument --rank: must be at least 0, got -1"),
    (["--master_port", 0], "must be at least 1, got 0"),
    (["--master-port", 65536], "must be a port from 1 to 65535, got 65536"),
    (["--seed", -1], "argument --seed: must be at least 0, got -1"),
    (["--world", 2], "unrecognized arguments: --world 2"),  # no abbreviations
    (["--master_addr", "no-such-host.invalid"], "argument --master_addr: no such host"),
])
def test_bad_input_is_refused_in_one_line(capsys, argv, message):
    assert message in error_of(capsys, *argv, "--master_port", find_free_port())


# A process of its own (seconds of torch's import): the in-process tests check each
# message; this one, that the real command stops before any rank starts.
@pytest.mark.slow
def test_the_command_refuses_bad_input_before_any_rank_starts(runs):
    run = runs.start("rpc_profiling", "--world_size", 2, "--rank", 2,
                     "--master_port", find_free_port())
    run.wait(timeout=60)
    assert run.returncode == 2 and run.stdout == "", run.output
    assert run.stderr == ("main.py: error: argument --rank: 2 is outside a world of 2 (ranks 0 "
                          "to 1)\n")
    assert not run.leftovers(grace=0)


def test_bad_paths_are_refused_before_anything_starts(capsys, tmp_path):
    port = ("--master_port", find_free_port())
    assert error_of(capsys, "--summary_json", tmp_path / "missing" / "s.json", *port).endswith(
        f"argument --summary_json: no such folder, {tmp_path / 'missing'}")
    assert error_of(capsys, "--summary_json", tmp_path, *port).endswith(
        f"argument --summary_json: {tmp_path} is a folder")
    (tmp_path / "file").write_text("")
    assert "argument --profile: cannot write in" in error_of(capsys, "--profile",
                                                              tmp_path / "file" / "dir", *port)


def test_a_port_in_use_is_refused_naming_it(capsys):
    import socket

    with socket.create_server(("localhost", 0)) as taken:
        port = taken.getsockname()[1]
        assert error_of(capsys, "--master_port", port).endswith(
            f"cannot listen on localhost:{port} (Address already in use): choose another "
            "--master_port")
        # a rank other than 0 does not host the port: nothing to check there
        assert extras.parse_args(["--master_port", str(port), "--rank", "1"]).rank == 1


def test_torchrun_gives_the_rank_the_world_and_the_store(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29765")
    args = extras.parse_args([])
    assert (args.rank, args.world_size, args.master_addr, args.master_port) == (
        1, 3, "127.0.0.1", 29765)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert error_of(capsys).endswith("torchrun started 1 process: the recipe needs 2 "
                                     "(--nproc_per_node 2)")


def test_every_default_shows_in_help(capsys):
    with pytest.raises(SystemExit):
        extras.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("(default: 2)", "(default: localhost)", "(default: 29500)", "(default: 1)"):
        assert shown in text


# --------- The summary, in-process --------------------

def fake_profile(*node_ids):
    return SimpleNamespace(function_events=[SimpleNamespace(node_id=node) for node in node_ids])


@pytest.fixture
def fresh_figures(monkeypatch):
    monkeypatch.setattr(extras, "recipe", {})
    monkeypatch.setattr(extras, "ranks", {})


def test_the_summary_line_and_its_figures(fresh_figures, capsys, tmp_path):
    extras.say_what_the_recipes_profiles_hold(fake_profile(0, 1), fake_profile(-1), "worker1")
    assert capsys.readouterr().out.startswith(
        "The recipe's two profiles hold 3 events, 1 of them run on worker1 (torch ")
    extras.report("worker1", {"operators": 26, "trace_bytes": 9000, "rss": 700})
    args = SimpleNamespace(summary_json=str(tmp_path / "s.json"), started=0.0, world_size=2)
    extras.summary(args, 1)  # not the coordinating rank: nothing
    assert capsys.readouterr().out == ""
    extras.summary(args, 0)
    line = capsys.readouterr().out.strip()
    assert re.fullmatch(r"Summary: the recipe's profiles: 3 events, 1 of worker1; worker1's own "
                        r"profile: 26 operators; [\d.]+ s in all", line), line
    figures = json.loads((tmp_path / "s.json").read_text())
    # the keys that bench/versions.py and the tests read
    assert figures["worker1_operators"] == 26 and figures["all_threads"] in (True, False)
    assert figures["recipe_events"] == 3 and figures["recipe_remote_events"] == 1
    assert figures["trace_bytes"] == {"worker1": 9000}
    assert set(figures["peak_memory_mb"]) == {"worker0", "worker1"}


def test_a_summary_that_cannot_be_written_says_so_after_the_figures(fresh_figures, capsys,
                                                                       tmp_path):
    extras.say_what_the_recipes_profiles_hold(fake_profile(), fake_profile(), "worker1")
    args = SimpleNamespace(summary_json=str(tmp_path / "gone" / "s.json"), started=0.0,
                           world_size=2)
    with pytest.raises(SystemExit) as end:
        extras.summary(args, 0)
    assert end.value.code == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2].startswith("Summary: the recipe's profiles: 0 events, 0 of worker1; ")
    assert lines[-1].startswith(f"--summary_json {args.summary_json}: not written (")


# --------- The folder alone --------------------

def test_the_folder_imports_nothing_from_outside_it():
    assert outside_imports(ROOT / "rpc_profiling") == []


def run_alone(copy, *flags, timeout=180):
    """The copied folder's plain command, in a Python where rpc_harness cannot be imported;
    fails the test if it times out or leaves processes."""
    run = Run([*ALONE, "main.py", *flags], cwd=copy)
    run.wait(timeout)
    alive = run.leftovers()
    run.kill_session()
    assert not alive, f"processes left running after {run.cmd}: {alive}"
    return run


@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory):
    """The brief's smoke test: the folder copied alone, its every-rank command with --profile,
    on the CPU, in a world of 2."""
    top = tmp_path_factory.mktemp("alone")
    copy = copy_example("rpc_profiling", top / "copy")
    folder = top / "traces"
    run = run_alone(copy, "--profile", folder, "--summary_json", top / "summary.json",
                    "--master_port", find_free_port())
    return run, folder, json.loads((top / "summary.json").read_text())


def test_the_recipes_log_lines_and_trace(profiled_run):
    run, folder, _ = profiled_run
    assert run.returncode == 0, run.output
    for rank in (0, 1):
        lines = [f"DEBUG:root:worker{rank} successfully initialized RPC.",
                 f"DEBUG:root:Rank {rank} waiting for workers and shutting down RPC",
                 f"DEBUG:root:Rank {rank} shutdown RPC"]
        positions = [run.stdout.find(line) for line in lines]
        assert -1 not in positions and positions == sorted(positions), (rank, run.stdout)
    assert f"DEBUG:root:Wrote trace to {folder / 'trace.json'}" in run.stdout
    assert json.loads((folder / "trace.json").read_text())  # the recipe's trace, as it is now
    assert re.search(r"^The recipe's two profiles hold \d+ events, \d+ of them run on worker1",
                     run.stdout, re.M)
    assert "Traceback" not in run.output and "ProcessGroup" not in run.output, run.output


def test_every_rank_writes_its_trace_and_worker0_the_summary(profiled_run):
    run, folder, summary = profiled_run
    for name in ("worker0", "worker1"):
        assert re.search(PROFILED.format(name=name), run.stdout, re.M), run.stdout
        assert f"{name}: top operators (self CPU time)" in run.stdout
    traces = read_traces(folder)  # what rpcrun merges: the ranks' traces, in rank order
    assert list(traces) == ["worker0", "worker1"]
    assert not list(folder.glob(".*.json")) and not (folder / "timeline.json").exists()
    # worker0's last line: after its rpc.shutdown (another rank's own last line may follow)
    lines = run.stdout.splitlines()
    ends = [number for number, line in enumerate(lines) if line.startswith("Summary: ")]
    assert len(ends) == 1 and lines.index("DEBUG:root:Rank 0 shutdown RPC") < ends[0]
    assert re.fullmatch(SUMMARY, lines[ends[0]]), lines[ends[0]]
    assert summary["worker1_operators"] > 0 or not summary["all_threads"]
    assert summary["all_threads"] == records_every_thread()


def test_the_callees_operators_fall_inside_the_callers_spans(profiled_run):
    """On worker1's track, the operators that worker0's RPCs ran there, each inside worker0's
    span of that RPC (one machine, one clock), where this torch records TensorPipe's threads;
    where it cannot, the run says so."""
    run, folder, _ = profiled_run
    if not records_every_thread():
        assert "records only the thread that started the profiler" in run.stdout
        pytest.skip("this torch's profiler records no thread but the one that started it (no "
                    "profile_all_threads): worker1's RPC work cannot be in its trace")
    events = merge(read_traces(folder))["traceEvents"]
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
