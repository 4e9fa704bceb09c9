"""make faults (bench/faults.py) in parts: each cell is recorded as it ends, the pages are
written from the record, a later run skips the recorded cells, and --again runs them again.
The cells here are stand-ins (no process starts): what a real cell shows is make faults' own
business, and takes hours."""

import importlib.util
import itertools
import json
import os
import signal
import threading
import time

import pytest
from conftest import ROOT

BENCH = ROOT / "bench"
PROGRAM = "rl_cartpole/main.py"


@pytest.fixture
def faults(monkeypatch, tmp_path):
    """bench/faults.py, its pages and record in tmp_path (docs/failures.md a copy), and its cells
    stand-ins that count their runs."""
    monkeypatch.syspath_prepend(str(BENCH))  # faults.py imports its neighbour ports.py
    spec = importlib.util.spec_from_file_location("faults_under_test", BENCH / "faults.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (tmp_path / "bench").mkdir()
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "failures.md").write_text(
        (ROOT / "docs" / "failures.md").read_text())
    monkeypatch.setattr(module, "ROOT", tmp_path)
    monkeypatch.setattr(module, "BENCH", tmp_path / "bench")
    module.ran = []

    module.during = {}  # the cell's number in a run -> what it does before it ends
    made = itertools.count(1)

    def stand_in(program, mode, fault, folder, plain=False):
        module.ran.append((program.path, mode, fault))
        module.during.get(len(module.ran), lambda: None)()
        # wall: a number that no other cell of the test has, to tell a cell's runs apart
        cell = module.Cell(program.path, mode, fault, seconds=1.5, wall=next(made))
        status = module.PIPE_CLOSED if fault == "pipe-closed" else 1
        cell.terminals = [("rank 0", f"rpcrun: rank 0 ended: {fault}", status, 1.5),
                          ("rank 1", f"rpcrun: rank 1 {fault}", status, 1.0)]
        return cell

    monkeypatch.setattr(module, "run_cell", stand_in)
    handlers = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    yield module
    for number, handler in handlers.items():  # main() sets its own: this process gets back its
        signal.signal(number, handler)


def test_a_run_records_each_cell_and_writes_the_pages_from_the_record(faults, tmp_path, capsys):
    assert faults.main(["--program", PROGRAM, "--mode", "per-rank"]) == 0
    per_rank = [cell for cell in faults.whole_matrix(False)
                if cell[0].path == PROGRAM and cell[1] == "per-rank"]
    assert len(faults.ran) == len(per_rank) == 12
    record = json.loads((tmp_path / "bench" / f"faults-{faults.CORES}-cores.json").read_text())
    assert sorted(record["cells"]) == sorted(f"{PROGRAM} per-rank {fault}"
                                             for _, _, fault in per_rank)
    page = (tmp_path / "bench" / f"FAULTS-{faults.CORES}-cores.md").read_text()
    matrix = len(faults.whole_matrix(False))
    assert f"12 of the matrix's {matrix} cells ({matrix - 12} not run yet)" in page
    assert "`rpcrun: rank 1 stop`" in page
    failures = (tmp_path / "docs" / "failures.md").read_text()
    assert f"Cells: 12 of {matrix} (the others not run yet); as they should be: 12" in failures
    assert "| per-rank | stop | 1 of 1 |" in failures


def test_a_later_run_skips_the_recorded_cells_and_again_runs_them(faults, tmp_path, capsys):
    faults.main(["--program", PROGRAM, "--mode", "spawn-all"])
    first = list(faults.ran)
    faults.ran.clear()
    faults.main(["--program", PROGRAM, "--mode", "spawn-all", "--mode", "per-rank"])
    assert not set(faults.ran) & set(first)  # the spawn-all cells were recorded: skipped
    assert {mode for _, mode, _ in faults.ran} == {"per-rank"}
    assert f"12 cell(s) to run, {len(first)} recorded already" in capsys.readouterr().out
    path = tmp_path / "bench" / f"faults-{faults.CORES}-cores.json"
    before = json.loads(path.read_text())["cells"][f"{PROGRAM} spawn-all stop"]
    faults.ran.clear()
    faults.main(["--program", PROGRAM, "--mode", "spawn-all", "--fault", "stop", "--again"])
    assert faults.ran == [(PROGRAM, "spawn-all", "stop")]
    record = json.loads(path.read_text())
    assert len(record["cells"]) == len(first) + 12
    assert record["cells"][f"{PROGRAM} spawn-all stop"]["wall"] != before["wall"]  # replaced


def test_a_cell_that_the_programs_own_stop_ended_is_not_recorded(faults, tmp_path):
    """The second cell's terminals are ended by this program's stop: it is left for the next
    run, and the cell before it stays recorded."""
    faults.during[2] = faults.end_every_terminal
    faults.main(["--program", PROGRAM, "--mode", "spawn-all", "--one_at_a_time"])
    record = json.loads((tmp_path / "bench" / f"faults-{faults.CORES}-cores.json").read_text())
    assert list(record["cells"]) == [f"{PROGRAM} {mode} {fault}"
                                     for _, mode, fault in faults.ran[:1]]


def test_a_lane_whose_logs_are_removed_as_this_program_ends_leaves_quietly(faults, tmp_path,
                                                                           monkeypatch):
    """Ctrl-C ends every terminal and removes the cells' logs while a lane may still read one:
    that lane ends without a traceback, and its cell is left for the next run."""
    def logs_removed():
        faults.end_every_terminal()
        raise FileNotFoundError("rank-0.log")

    unhandled = []
    monkeypatch.setattr(threading, "excepthook", unhandled.append)
    faults.during[2] = logs_removed
    faults.main(["--program", PROGRAM, "--mode", "spawn-all", "--one_at_a_time"])
    assert unhandled == []
    record = json.loads((tmp_path / "bench" / f"faults-{faults.CORES}-cores.json").read_text())
    assert len(record["cells"]) == 1


def test_sigterm_records_the_cells_that_ended_and_writes_the_pages(faults, tmp_path,
                                                                    monkeypatch, capsys):
    """SIGTERM to make faults while its third cell runs: the two cells before it are recorded
    and on the pages, the third is not, and the status is 143."""
    def sigterm():
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not faults._ending.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)  # the main thread takes the signal, and ends every terminal

    def leave(status):
        raise SystemExit(status)

    faults.during[3] = sigterm
    monkeypatch.setattr(faults.os, "_exit", leave)
    with pytest.raises(SystemExit) as left:
        faults.main(["--program", PROGRAM, "--mode", "spawn-all", "--one_at_a_time"])
    assert left.value.code == 143
    record = json.loads((tmp_path / "bench" / f"faults-{faults.CORES}-cores.json").read_text())
    assert len(faults.ran) == 3 and len(record["cells"]) == 2
    page = (tmp_path / "bench" / f"FAULTS-{faults.CORES}-cores.md").read_text()
    assert "2 of the matrix's" in page
    assert "2 cell(s) of this run had ended" in capsys.readouterr().err


def test_no_write_records_nothing(faults, tmp_path):
    faults.main(["--program", PROGRAM, "--mode", "torchrun", "--no_write"])
    assert faults.ran
    assert not list((tmp_path / "bench").iterdir())


def test_the_plain_commands_are_recorded_by_torch_and_fill_that_torchs_table(faults, tmp_path,
                                                                            capsys):
    page = tmp_path / "docs" / "failures.md"
    marker = f"make faults PLAIN=1, torch {faults.TORCH_MINOR}"
    page.write_text(f"# Failures\n\n<!-- {marker}: begin -->\nNot measured yet.\n"
                    f"<!-- {marker}: end -->\n\nThe rest of the page.\n")
    faults.main(["--plain", "--program", PROGRAM, "--mode", "per-rank", "--fault", "kill-rank"])
    named = f"plain-torch{faults.TORCH_MINOR}-{faults.CORES}-cores"
    assert (tmp_path / "bench" / f"faults-{named}.json").exists()
    assert (tmp_path / "bench" / f"FAULTS-{named}.md").exists()
    text = page.read_text()
    assert "Not measured yet." not in text
    assert "| per-rank | kill-rank | 1 of 1 |" in text
    assert text.endswith("\nThe rest of the page.\n")
    # what the plain commands did, in words: no promise of rpcrun's to hold them to
    assert f"{PROGRAM} per-rank kill-rank: every terminal ended; gone in" in capsys.readouterr().out


def test_a_page_without_the_runs_markers_is_left_as_it_is(faults, tmp_path, capsys):
    page = tmp_path / "docs" / "failures.md"
    page.write_text("# Failures\n\nNo measured tables here.\n")
    faults.main(["--program", PROGRAM, "--mode", "torchrun", "--fault", "raise"])
    assert page.read_text() == "# Failures\n\nNo measured tables here.\n"
    assert "docs/failures.md has no table for this run" in capsys.readouterr().out
    assert (tmp_path / "bench" / f"FAULTS-{faults.CORES}-cores.md").exists()
