"""make faults (bench/faults.py) in parts: each cell is recorded as it ends, the pages are
written from the record, a later run skips the recorded cells, and --again runs them again.
The cells here are stand-ins (no process starts): what a real cell shows is make faults' own
business, and takes hours."""

import importlib.util
import json
import signal

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

    def stand_in(program, mode, fault, folder, plain=False):
        module.ran.append((program.path, mode, fault))
        cell = module.Cell(program.path, mode, fault, seconds=1.5, wall=3.0)
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
    faults.ran.clear()
    faults.main(["--program", PROGRAM, "--mode", "spawn-all", "--fault", "stop", "--again"])
    assert faults.ran == [(PROGRAM, "spawn-all", "stop")]
    record = json.loads((tmp_path / "bench" / f"faults-{faults.CORES}-cores.json").read_text())
    assert len(record["cells"]) == len(first) + 12


def test_no_write_records_nothing(faults, tmp_path):
    faults.main(["--program", PROGRAM, "--mode", "torchrun", "--no_write"])
    assert faults.ran
    assert not list((tmp_path / "bench").iterdir())
