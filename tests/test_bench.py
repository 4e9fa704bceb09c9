"""make bench (bench/bench.py) where torchmonarch has no wheel (Python 3.14, macOS): the RPC
programs are measured and the Monarch ones left out, saying why; --monarch alone is refused in
one line. The measurements themselves are `make bench`'s, not a test's."""

import importlib.util
import sys

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
