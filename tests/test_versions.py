"""make versions (bench/versions.py): a real run recorded, resumed without running it again, and
the table written from what was recorded, failures with their last lines."""

import json
import subprocess
import sys

import pytest
from conftest import ROOT

SCRIPT = ROOT / "bench" / "versions.py"


def versions(*args, timeout=300):
    return subprocess.run([sys.executable, SCRIPT, *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.slow
def test_a_run_is_recorded_then_skipped_when_resumed(tmp_path):
    state, table = tmp_path / "state.json", tmp_path / "versions.md"
    common = ["--here", "--label", "this torch", "--program", "rpc_profiling/main.py",
              "--mode", "spawn-all", "--state", state, "--output", table, "--scratch", tmp_path]
    first = versions(*common)
    assert first.returncode == 0, first.stdout + first.stderr
    run = json.loads(state.read_text())["environments"]["this torch"]["runs"]
    assert run["rpc_profiling/main.py spawn-all"]["ok"] is True, run
    # the recipe's two workers end at once: the last line printed is worker0's summary or
    # worker1's own last line, whichever came later
    last_line = run["rpc_profiling/main.py spawn-all"]["last_line"]
    assert last_line.startswith("Summary: ") or last_line.endswith("Rank 1 shutdown RPC"), run
    again = versions(*common)
    assert again.returncode == 0 and "spawn-all: ran" not in again.stdout, again.stdout
    # it learned from one command; per-rank and torchrun are still to run
    assert "| `rpc_profiling/main.py` | ✓· |" in table.read_text()


def test_the_table_marks_each_cell_and_gives_each_failure_its_last_line(tmp_path):
    ran = {"ok": True, "seconds": 9, "last_line": "Summary: ...", "why": None}
    failed = {"ok": False, "seconds": 9, "last_line": "Summary: 60 episodes, not solved",
              "why": "did not learn"}
    runs = {f"rl_cartpole/main.py {mode}": ran for mode in ("per-rank", "torchrun")}
    state = {"machine": "a test", "seconds": 60, "environments": {
        "torch 2.4.1": {"python_minor": "3.11", "versions": {"torch": "2.4.1"},
                        "runs": {**runs, "rl_cartpole/main.py spawn-all": failed}},
        "torch 2.5.1": {"python_minor": "3.11", "versions": {"torch": "2.5.1"},
                        "runs": {**runs, "rl_cartpole/main.py spawn-all": ran,
                                 "rl_cartpole/batch.py spawn-all": ran}},
        "Python 3.14": {"python_minor": "3.14", "missing_python": True,
                        "resolved": {"torch": "2.15.0", "torchmonarch": None}, "runs": {}}}}
    path = tmp_path / "state.json"
    path.write_text(json.dumps(state))
    # a lent GPU machine's run with --here: a section of its own, its notes numbered on
    lent = {"machine": "a GPU machine", "environments": {"GPU, torch 2.11.0": {
        "python_minor": "3.12", "versions": {"torch": "2.11.0"},
        "runs": {**runs, "rl_cartpole/main.py spawn-all": failed}}}}
    lent_path = tmp_path / "lent.json"
    lent_path.write_text(json.dumps(lent))
    table = tmp_path / "versions.md"
    written = versions("--report", "--state", path, "--lent", lent_path, "--output", table)
    assert written.returncode == 0, written.stderr
    text = table.read_text()
    assert "| `rl_cartpole/main.py` | ✗ 1 | ✓ | – |" in text
    # not run yet; learned from one command, the other modes not run yet
    assert "| `rl_cartpole/batch.py` | · | ✓· | – |" in text
    assert "`rl_cartpole/main.py`, torch 2.4.1, spawn-all: did not learn" in text
    assert "Summary: 60 episodes, not solved" in text
    assert "Python 3.14: this machine has no such Python" in text
    gpu_section = text.split("## On a GPU machine")[1]
    assert "| `rl_cartpole/main.py` | ✗ 2 |" in gpu_section
    assert "`rl_cartpole/main.py`, GPU, torch 2.11.0, spawn-all: did not learn" in text


def _without_shortening(words, shortening):
    kept, skipping = [], False
    for word in words:
        if word.startswith("--"):
            skipping = word.split("=")[0] in shortening
            if skipping:
                continue
        elif skipping:
            continue
        kept.append(word)
    return kept


def test_every_run_is_a_command_that_a_readme_shows_made_shorter():
    """Each cell's runs (bench/versions.py's PROGRAMS, and tests/conftest.py's short runs that
    its other launch modes use) are commands that the program's pages show, with only flags
    that make a run shorter added: never one that picks another path."""
    import programs

    sys.path.insert(0, str(ROOT / "bench"))
    import versions as bench_versions

    for program in bench_versions.PROGRAMS:
        folder = ROOT / program.key.split("/")[0]
        pages = [folder / "README.md", *folder.glob("ACTORS.md")]
        shown = [_without_shortening(command.argv, bench_versions.SHORTENING)
                 for page in pages
                 for command in programs.commands(page, programs.code_on_page(page.read_text()))
                 if command.script == program.key]
        runs = [program.flags] if program.monarch else [program.flags, program.quick]
        for flags in runs:
            wanted = _without_shortening(flags, bench_versions.SHORTENING)
            assert wanted in shown, (
                f"{program.key} {' '.join(flags)}: no page shows `python {program.key} "
                f"{' '.join(wanted)}` (shown: {shown})")


def _shown_commands(script):
    """The argv of each command that a program's pages show (its README, ACTORS.md)."""
    import programs

    folder = ROOT / script.split("/")[0]
    pages = [folder / "README.md", *folder.glob("ACTORS.md")]
    return [command.argv for page in pages
            for command in programs.commands(page, programs.code_on_page(page.read_text()))
            if command.script == script]


def _tour_commands():
    """(script, argv) of each program that `make run` runs: its recipe's `$(PY) SCRIPT ...`
    lines, `$(PY) -m rpc_harness SCRIPT ...` too, with the Makefile's variables they use."""
    import re
    import shlex

    text = (ROOT / "Makefile").read_text()
    variables = dict(re.findall(r"^(\w+) :?= (.*)$", text, re.M))
    recipe = text.split("\nrun:", 1)[1].split("\n\n", 1)[0].replace("\\\n", " ")
    found = []
    for line in recipe.splitlines():
        match = re.search(r"\$\(PY\) (?:-m rpc_harness )?(\S+\.py)([^|;}]*)", line)
        if match:
            words = re.sub(r"\$\((\w+)\)", lambda m: variables.get(m.group(1), ""),
                           match.group(2))
            found.append((match.group(1), shlex.split(words)))
    return found


def test_the_tour_and_the_quick_runs_are_commands_that_a_readme_shows_made_shorter():
    """make run's commands, and the tests' short runs (tests/conftest.py's RUNS): a command that
    the program's pages show, with only flags that make a run shorter added."""
    from conftest import RUNS

    sys.path.insert(0, str(ROOT / "bench"))
    import versions as bench_versions

    shortening = bench_versions.SHORTENING | {"--dataset"}  # the tour: MNIST, or offline
    runs = [(script, argv) for script, argv in _tour_commands()]
    runs += [(f"{config.name}/{config.script}", [str(word) for word in config.quick])
             for config in RUNS.values()]
    assert len(runs) > 10
    for script, argv in runs:
        shown = [_without_shortening(words, shortening) for words in _shown_commands(script)]
        wanted = _without_shortening(argv, shortening)
        assert wanted in shown, f"{script} {' '.join(argv)}: no page shows it (shown: {shown})"
