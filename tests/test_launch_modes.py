"""Every entry point, end to end, once in each way of starting it, with the plain command (torch
alone): every rank from one command (mp.spawn), a rank a command (--rank, as a rank a
terminal), torchrun; the Monarch programs their own way. Short runs: each ends with status 0,
its summary written (one rank a terminal: the coordinating terminal's last line), nothing left
running. What a run learned is each example's own tests' (test_<example>.py); failures are the
supervisor's (test_rpcrun.py, test_failures.py) and make faults'.

make test-oldest runs this module on the oldest torch that requirements.txt allows."""

import json
import re
import sys

import pytest
from conftest import ROOT, RUNS, example_command, find_free_port, needs_monarch

pytestmark = [pytest.mark.slow, pytest.mark.launch_modes]

MODES = ["spawn-all", "per-rank", "torchrun"]
CASES = [pytest.param(key, mode, id=f"{key}-{mode}") for key in RUNS for mode in MODES]

MONARCH = {
    "param_server/actors.py": ("param_server", ["--world_size", 3, "--dataset", "synthetic",
                                                "--max_batches", 5]),
    "rl_cartpole/actors.py": ("rl_cartpole", ["--max_episodes", 3]),
}


def _flags(key, tmp_path):
    """The run's short flags, with its summary (and rpc_profiling's traces) in tmp_path."""
    config = RUNS[key]
    flags = [*config.quick, "--summary_json", tmp_path / "summary.json"]
    if config.name == "rpc_profiling":
        flags += ["--profile", tmp_path / "traces"]
    return flags


@pytest.mark.parametrize("key, mode", CASES)
def test_every_entry_point_runs_in_every_launch_mode(key, mode, runs, tmp_path):
    config = RUNS[key]
    flags = _flags(key, tmp_path)
    if mode == "spawn-all":
        terminals = [runs.start(config.name, "--world_size", config.world_size, *flags,
                                "--master_port", find_free_port(), script=config.script,
                                merged=True)]
    elif mode == "per-rank":
        port = find_free_port()
        # the last rank first: start order must not matter
        terminals = [runs.start(config.name, "--world_size", config.world_size, "--rank", rank,
                                *flags, "--master_port", port, script=config.script,
                                merged=True) for rank in reversed(range(config.world_size))]
        terminals.reverse()
    else:
        script = example_command(config.name, *flags, script=config.script)
        terminals = [runs.start_command(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
             str(config.world_size), "--master_port", str(find_free_port()), *script[1:]],
            merged=True)]
    for terminal in terminals:
        terminal.wait(timeout=240)
        assert terminal.returncode == 0, terminal.output
        assert not terminal.leftovers()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary.get("world_size", config.world_size) == config.world_size
    # The coordinating rank's last line is the summary. From one command, the other ranks' last
    # lines may come after it; torchrun's agent prints its own lines last.
    if mode == "per-rank":
        assert any(t.last_line.startswith("Summary: ") for t in terminals), [
            t.output for t in terminals]
    else:
        assert re.search(r"^Summary: ", terminals[0].output, re.M), terminals[0].output


@pytest.mark.parametrize("key", list(MONARCH))
def test_every_monarch_program_runs(key, runs, tmp_path):
    needs_monarch()
    example, flags = MONARCH[key]
    run = runs.start(example, *flags, "--summary_json", tmp_path / "summary.json",
                     script="actors.py", merged=True)
    run.wait(timeout=240)
    assert run.returncode == 0, run.output
    assert run.last_line.startswith("Summary: "), run.output
    assert json.loads((tmp_path / "summary.json").read_text())["mode"] == "monarch"
    assert not run.leftovers(grace=3)


def test_every_entry_point_is_here():
    """Every RPC program of every example folder has its launch-mode runs above."""
    scripts = {f"{path.parent.name}/{path.name}" for path in ROOT.glob("*/*.py")
               if path.name in ("main.py", "batch.py", "remote_module.py", "pipelining.py")}
    covered = {f"{config.name}/{config.script}" for config in RUNS.values()}
    assert scripts == covered
    assert set(MONARCH) == {f"{path.parent.name}/{path.name}" for path in ROOT.glob("*/actors.py")}
