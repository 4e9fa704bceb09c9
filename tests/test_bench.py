"""make bench (bench/bench.py) against today's examples: where torchmonarch has no wheel (Python
3.14, macOS), the RPC programs are measured and the Monarch ones left out, saying why, and
--monarch alone is refused in one line; no variant passes a flag the examples no longer have;
the RPC programs get the share of the cores that rpcrun gives; the supervisor's cost compares
each command with the same under rpcrun, nothing else changed; a merged timeline draws; the
baselines run (slow). The measurements themselves are `make bench`'s, not a test's."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

BENCH = ROOT / "bench"


@pytest.fixture
def bench_without_monarch(monkeypatch):
    """bench.py loaded in a process where `import monarch` fails, as if it were not installed."""
    monkeypatch.setitem(sys.modules, "monarch", None)
    monkeypatch.syspath_prepend(str(BENCH))  # bench.py imports its neighbours, as when run
    spec = importlib.util.spec_from_file_location("bench_under_test", BENCH / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_without_monarch_only_the_rpc_programs_are_measured(bench_without_monarch, tmp_path):
    commands = [" ".join(map(str, variant.cmd))
                for comparison in bench_without_monarch.comparisons(True, tmp_path)
                for variant in comparison.variants if variant.cmd]
    assert not [command for command in commands if "actors.py" in command]
    for program in ("param_server/main.py", "param_server/batch.py", "rl_cartpole/batch.py",
                    "pipeline_parallel/pipelining.py"):
        assert any(program in command for command in commands), program


def test_without_monarch_the_monarch_bench_is_refused_in_one_line(bench_without_monarch,
                                                                   monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench.py", "--monarch", "--quick"])
    with pytest.raises(SystemExit) as exited:
        bench_without_monarch.main()
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--monarch needs torchmonarch" in err and "pip install torchmonarch" in err


@pytest.fixture
def bench(monkeypatch):
    """bench.py loaded as a module, as when run (it imports its neighbours)."""
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_of_today", BENCH / "bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GONE = ("--init_timeout", "--rpc_timeout", "--rpc_transport", "--profile_steps")


def test_every_variant_runs_a_script_of_today_with_flags_it_has(bench, tmp_path):
    """No variant passes a flag that the examples lost with the harness, and each runs a script
    that is there (a copy's, for the "before" and lever variants)."""
    for comparison in bench.comparisons(False, tmp_path):
        for variant in comparison.variants:
            if variant.cmd is None:
                continue
            words = [str(part) for part in variant.cmd]
            assert not set(words) & set(GONE), (variant.label, words)
            assert Path(words[1]).is_file(), (variant.label, words[1])


def test_rpc_programs_get_the_share_that_rpcrun_gives(bench, monkeypatch):
    """The RPC programs run plain with OMP_NUM_THREADS as rpcrun would set it (the cores divided
    by the ranks, the script's default world read as rpcrun reads it), unless it is set; the
    Monarch programs and Ray's with the environment as it is."""
    monkeypatch.setattr(bench.rpcrun_command, "cores", lambda: 8)
    share = lambda cmd, env=None: bench.rpcrun_threads(cmd, env or {}).get("OMP_NUM_THREADS")  # noqa: E731
    assert share(bench.example("param_server", "--world_size", 2)) == "4"
    assert share(bench.example("param_server")) == "2"  # main.py's default world of 4
    assert share(bench.example("rl_cartpole", "--world-size=5", script="batch.py")) == "1"
    assert share(bench.example("pipeline_parallel", script="pipelining.py")) == "4"
    assert share(bench.example("param_server"), {"OMP_NUM_THREADS": "3"}) == "3"
    assert share(bench.monarch_example("param_server")) is None
    assert share(bench.ray_example(1, 10)) is None


def test_the_supervised_twin_differs_from_the_plain_command_by_rpcrun_alone(bench):
    def without_ports(cmd):
        words = [str(part) for part in cmd]
        for flag in ("--master_port", "--port"):
            if flag in words:
                words[words.index(flag) + 1] = "PORT"
        return words

    for twin in bench.supervisor_twins(quick=True):
        plain = [without_ports(cmd) for cmd in twin.commands(bench.PLAIN, "s.json")]
        supervised = [without_ports(cmd) for cmd in twin.commands(bench.SUPERVISED, "s.json")]
        assert len(plain) == len(supervised) == max(1, twin.ranks)
        front = [sys.executable, "-m", "rpc_harness", *(["--port", "PORT"] if twin.ranks else [])]
        assert supervised == [[*front, *cmd[1:]] for cmd in plain]
        if twin.ranks:
            assert [cmd[-2:] for cmd in plain] == [["--rank", str(r)] for r in range(twin.ranks)]
    assert any(twin.ranks for twin in bench.supervisor_twins(quick=True))


def test_the_supervisor_table_says_whether_the_cost_is_within_two_percent(bench):
    twin = bench.supervisor_twins(quick=True)[0]
    for plain, supervised in (((100, 10.0, 12.0), (99, 10.1, 12.2)),
                              ((200, 10.0, 12.0), (190, 10.5, 13.0))):
        twin.runs = {bench.PLAIN: [dict(zip(("rate", "wall", "seconds"), plain, strict=True))],
                     bench.SUPERVISED: [dict(zip(("rate", "wall", "seconds"), supervised,
                                                 strict=True), cpu=0.1)]}
        rows = bench.supervisor_rows(twin)
        assert len(rows) == 3
        if supervised[0] == 99:
            assert [row.rsplit("| ", 1)[-1] for row in rows] == [
                "yes (+1.0%) |", "yes (+1.0%) |", "yes (+1.7%) |"]
        else:
            assert all("| no (+" in row for row in rows), rows
            assert "| 0.950 | 0.950 (0.950-0.950) |" in rows[0]


def test_a_merged_timeline_of_today_draws(tmp_path):
    """draw_timeline.py draws what rpcrun merges (rpc_harness.timeline) from each rank's trace."""
    from rpc_harness.timeline import write_timeline

    def trace(rank, name, offset_us):
        events = [{"ph": "M", "name": "thread_name", "pid": 7, "tid": 1,
                   "args": {"name": "thread 1 (python)"}},
                  {"ph": "M", "name": "thread_name", "pid": 7, "tid": 2,
                   "args": {"name": "thread 2 (pt_thread_pool)"}},
                  {"ph": "X", "name": "ProfilerStep#3", "pid": 7, "tid": 1, "ts": offset_us,
                   "dur": 1000},
                  {"ph": "X", "name": f"rpc_sync#{name}", "pid": 7, "tid": 1,
                   "ts": offset_us + 100, "dur": 500},
                  {"ph": "X", "name": "aten::add", "pid": 7, "tid": 2, "ts": offset_us + 200,
                   "dur": 300}]
        return {"rank": rank, "baseTimeNanoseconds": 1_000_000, "traceEvents": events}

    for rank, name in enumerate(("agent", "observer1")):
        (tmp_path / f"{name}.json").write_text(json.dumps(trace(rank, name, 10.0 * rank)))
    assert "2 ranks" in write_timeline(tmp_path)
    picture = tmp_path / "timeline.png"
    done = subprocess.run([sys.executable, BENCH / "draw_timeline.py", tmp_path / "timeline.json",
                           picture, "--step", "ProfilerStep#3", "--title", "a test"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert picture.stat().st_size > 0


@pytest.mark.slow
def test_the_baselines_run_on_todays_examples():
    """baselines.py loads today's example modules (load_example) and runs each baseline, tiny."""
    done = subprocess.run([sys.executable, BENCH / "baselines.py", "--scale", "0.02"],
                          capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    rates = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(rates) == {"param_server", "rl_cartpole_1", "rl_cartpole_4", "rnn_model_parallel",
                          "ddp_rpc_hybrid", "pipeline_parallel", "peak_memory_mb"}
    assert all(rate > 0 for name, rate in rates.items() if name != "peak_memory_mb")
