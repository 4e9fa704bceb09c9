"""cuda_rpc: the device choice and the device map with faked GPU counts, bad input (a wrong map
refused in one line, status 2, before anything starts), the summary, and the recipe's flow end
to end on the machine at hand (the CPU here: no device map) in every launch mode, the first of
them from the folder copied alone. The GPU runs ({0: 0} on one GPU, the recipe's {0: 1} on two)
are tests/test_gpu.py's."""

import json
import re
import runpy
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import (
    ALONE,
    ROOT,
    Run,
    copy_example,
    example_command,
    find_free_port,
    outside_imports,
)
from example_modules import example_modules, load_example

extras = load_example("cuda_rpc", "extras")

FOLDER = ROOT / "cuda_rpc"
GPUS = torch.cuda.device_count()
SUMMARY = (r"Summary: cpu RPC [\d.]+ s, cuda RPC [\d.]+ s for 1 iteration\(s\) \(([\d.]+x|-)\), "
           r"(on the CPU, no device map|device map \{\d+: \d+\}); [\d.]+ s in all")


def expected_first_line(gpu_count):
    """What the plain command prints first on a machine with gpu_count GPUs, no --device_map."""
    args = SimpleNamespace(rank=None, device_map=None)
    extras.check_devices(None, args, gpu_count)
    return extras.devices_line(args)


# --------- The devices, with faked GPU counts --------------------

@pytest.mark.parametrize("gpu_count, chosen, expected", [
    (0, None, ("cpu", "cpu", None)),
    (1, None, ("cuda:0", "cuda:0", {0: 0})),
    (2, None, ("cuda:0", "cuda:1", {0: 1})),
    (8, None, ("cuda:0", "cuda:1", {0: 1})),
    (2, {1: 0}, ("cuda:1", "cuda:0", {1: 0})),
    (2, {0: 1, 1: 0}, ("cuda:0", "cuda:1", {0: 1, 1: 0})),
    (1, {0: 0}, ("cuda:0", "cuda:0", {0: 0})),
])
def test_device_choice(gpu_count, chosen, expected):
    assert extras.choose_devices(gpu_count, chosen) == expected


@pytest.mark.parametrize("gpu_count, line", [
    (0, "No CUDA here: worker0 and worker1 run the recipe's calls on the CPU, with CPU tensors "
        "and no device map, so its cpu and cuda modes move the same tensors"),
    (1, "One GPU here: worker0 and worker1 share cuda:0, with the device map {0: 0} from "
        "worker0 to worker1"),
    (2, "2 GPUs here, the recipe's map: worker0 on cuda:0, worker1 on cuda:1, with the device "
        "map {0: 1} from worker0 to worker1"),
])
def test_the_first_line_says_where_the_workers_run(monkeypatch, capsys, gpu_count, line):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpu_count)
    args = extras.parse_args(["--master_port", str(find_free_port())])
    assert capsys.readouterr().out == line + "\n"
    assert args.device_map == {0: None, 1: {0: 0}, 2: {0: 1}}[gpu_count]


def test_a_map_given_decides(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    args = extras.parse_args(["--device_map", "1:0", "--master_port", str(find_free_port())])
    assert (args.devices, args.device_map) == (("cuda:1", "cuda:0"), {1: 0})
    assert capsys.readouterr().out == ("--device_map: worker0 on cuda:1, worker1 on cuda:0, "
                                       "with the device map {1: 0} from worker0 to worker1\n")


# --------- Bad input --------------------

def error_of(capsys, monkeypatch, *argv, gpu_count=0):
    """extras.parse_args's refusal of argv, with gpu_count GPUs faked: status 2 and one line,
    argparse's error."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpu_count)
    with pytest.raises(SystemExit) as end:
        extras.parse_args([str(word) for word in argv])
    assert end.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and ": error: " in lines[0] and captured.out == "", captured
    return lines[0]


@pytest.mark.parametrize("argv, gpu_count, message", [
    (["--world_size", 3], 0, "argument --world_size/--world-size: the recipe has two workers: "
                             "must be 2, got 3"),
    (["--world-size", 1], 0, "must be at least 2, got 1"),
    (["--rank", 2], 0, "argument --rank: 2 is outside a world of 2 (ranks 0 to 1)"),
    (["--rank", -1], 0, "argument --rank: must be at least 0, got -1"),
    (["--master_port", 65536], 0, "must be a port from 1 to 65535, got 65536"),
    (["--iterations", 0], 0, "argument --iterations: must be at least 1, got 0"),
    (["--seed", "x"], 0, "argument --seed: must be a whole number, got x"),
    (["--iter", 2], 0, "unrecognized arguments: --iter 2"),  # no abbreviations
    # a wrong map
    (["--device_map", "0:1"], 0, "argument --device_map: this machine has no GPU that torch can "
                                 "use (CUDA is not available); leave --device_map out to run on "
                                 "the CPU"),
    (["--device_map", "0:1"], 1, "argument --device_map: worker1's cuda:1 does not exist; this "
                                 "machine has 1 GPU(s), cuda:0 to cuda:0"),
    (["--device-map", "2:0"], 2, "argument --device_map: worker0's cuda:2 does not exist; this "
                                 "machine has 2 GPU(s), cuda:0 to cuda:1"),
    (["--device_map", "0:1,1:1"], 2, "argument --device_map/--device-map: maps worker0's cuda:0 "
                                     "and cuda:1 both to worker1's cuda:1: a device map must be "
                                     "one to one"),
    (["--device_map", "0:1,0:0"], 2, "maps worker0's cuda:0 twice"),
    (["--device_map", "cuda:0"], 2, "must be pairs of GPU numbers, worker0's:worker1's, such as "
                                    "0:1 or 0:1,1:0; got cuda:0"),
    (["--device_map=-1:0"], 2, "must be pairs of GPU numbers"),
])
def test_bad_input_is_refused_in_one_line(capsys, monkeypatch, argv, gpu_count, message):
    assert message in error_of(capsys, monkeypatch, *argv, "--master_port", find_free_port(),
                               gpu_count=gpu_count)


def test_a_map_is_checked_on_the_side_of_the_worker_that_the_command_runs(capsys, monkeypatch):
    """worker0 uses the map's first numbers, worker1 its second: one GPU on worker0's machine
    takes 0:1 from worker0's command, not from worker1's."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    args = extras.parse_args(["--device_map", "0:1", "--rank", "0",
                              "--master_port", str(find_free_port())])
    assert args.devices == ("cuda:0", "cuda:1")
    capsys.readouterr()
    assert "worker1's cuda:1 does not exist" in error_of(
        capsys, monkeypatch, "--device_map", "0:1", "--rank", 1, gpu_count=1)


def test_a_port_in_use_is_refused_naming_it(capsys, monkeypatch):
    import socket

    with socket.create_server(("localhost", 0)) as taken:
        port = taken.getsockname()[1]
        assert error_of(capsys, monkeypatch, "--master_port", port).endswith(
            f"cannot listen on localhost:{port} (Address already in use): choose another "
            "--master_port")


def test_a_summary_file_that_cannot_be_written_is_refused(capsys, monkeypatch, tmp_path):
    port = ("--master_port", find_free_port())
    assert error_of(capsys, monkeypatch, "--summary_json", tmp_path / "missing" / "s.json",
                    *port).endswith(f"no such folder, {tmp_path / 'missing'}")
    assert error_of(capsys, monkeypatch, "--summary_json", tmp_path, *port).endswith(
        f"argument --summary_json: {tmp_path} is a folder")


def test_torchrun_gives_the_rank_the_world_and_the_store(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29765")
    args = extras.parse_args([])
    assert (args.rank, args.world_size, args.master_addr, args.master_port) == (
        1, 2, "127.0.0.1", 29765)
    capsys.readouterr()
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert error_of(capsys, monkeypatch).endswith(
        "torchrun started 3 process(es): the recipe needs 2 (--nproc_per_node 2)")


def test_every_default_shows_in_help(capsys):
    with pytest.raises(SystemExit):
        extras.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("(default: 2)", "(default: localhost)", "(default: 29500)", "(default: 10)",
                  "(default: 1)", "(default: None)"):
        assert shown in text


class Started(Exception):
    """The command got past its checks: it started workers (mp.spawn) or one (mp.Process)."""


def run_command(monkeypatch, argv, gpu_count):
    """main.py's `__main__` with this command line and gpu_count GPUs faked, in this process,
    with mp.spawn and mp.Process replaced: its status, or Started."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpu_count)

    def start(*args, **kwargs):
        raise Started

    monkeypatch.setattr(torch.multiprocessing, "spawn", start)
    monkeypatch.setattr(torch.multiprocessing, "Process", start)
    monkeypatch.setattr(sys, "argv", ["main.py", *map(str, argv)])
    with example_modules("cuda_rpc"):
        try:
            runpy.run_path(str(FOLDER / "main.py"), run_name="__main__")
        except SystemExit as end:
            return end.code
    raise AssertionError("the command neither started a worker nor ended")


@pytest.mark.parametrize("device_map, gpu_count", [("0:1", 0), ("0:2", 2), ("0:1", 1),
                                                    ("0:1,1:1", 2)])
def test_a_wrong_map_starts_nothing(monkeypatch, capsys, device_map, gpu_count):
    status = run_command(monkeypatch, ["--device_map", device_map,
                                       "--master_port", find_free_port()], gpu_count)
    captured = capsys.readouterr()
    assert status == 2 and captured.out == "", captured
    assert len(captured.err.splitlines()) == 1
    assert captured.err.startswith("main.py: error: argument --device_map")


@pytest.mark.parametrize("gpu_count", [0, 1, 2])
def test_a_good_command_starts_both_workers(monkeypatch, capsys, gpu_count):
    with pytest.raises(Started):
        run_command(monkeypatch, ["--master_port", find_free_port()], gpu_count)
    assert capsys.readouterr().out == expected_first_line(gpu_count) + "\n"


@pytest.mark.slow  # a process of its own: seconds of torch's import; in-process above
def test_the_command_refuses_a_wrong_map_before_anything_starts(tmp_path):
    """The real command, in a process of its own: cuda:99 exists on no machine (and without
    CUDA any map is refused)."""
    run = Run(example_command("cuda_rpc", "--device_map", "0:99", "--master_port",
                              find_free_port()), tmp_path)
    run.wait(timeout=60)
    assert run.returncode == 2 and run.stdout == "", run.output
    assert len(run.stderr.splitlines()) == 1, run.stderr
    assert run.stderr.startswith("main.py: error: argument --device_map: ")
    assert not run.leftovers(grace=0)


# --------- Where a tensor lands; the summary, in-process --------------------

def test_worker1_says_where_an_argument_arrived():
    there, back = extras.device_of(torch.ones(2))
    assert there == "cpu" and torch.equal(back, torch.ones(2))


@pytest.fixture
def fresh_figures(monkeypatch):
    monkeypatch.setattr(extras, "seconds", {})
    monkeypatch.setattr(extras, "landed", {})


def test_the_summary_line_and_its_figures(fresh_figures, capsys, tmp_path):
    extras.record("cpu", 2.0)
    extras.record("cuda", 0.5)
    extras.landed.update(sent="cpu", landed="cpu", reply="cpu")
    args = SimpleNamespace(summary_json=str(tmp_path / "s.json"), started=0.0, world_size=2,
                           devices=("cpu", "cpu"), device_map=None, iterations=1)
    extras.summary(args, 1)  # not worker0: nothing
    assert capsys.readouterr().out == ""
    extras.summary(args, 0)
    line = capsys.readouterr().out.strip()
    assert re.fullmatch(SUMMARY, line) and "(4.0x), on the CPU, no device map;" in line, line
    figures = json.loads((tmp_path / "s.json").read_text())
    assert figures["seconds"] == {"cpu": 2.0, "cuda": 0.5} and figures["speedup"] == 4.0
    assert figures["device_map"] is None and figures["world_size"] == 2
    assert figures["devices"] == {"worker0": "cpu", "worker1": "cpu"}
    assert figures["landed"] == {"sent": "cpu", "landed": "cpu", "reply": "cpu"}


def test_a_summary_that_cannot_be_written_says_so_after_the_figures(fresh_figures, capsys,
                                                                       tmp_path):
    extras.record("cpu", 1.0)
    extras.record("cuda", 1.0)
    args = SimpleNamespace(summary_json=str(tmp_path / "gone" / "s.json"), started=0.0,
                           world_size=2, devices=("cpu", "cpu"), device_map=None, iterations=1)
    with pytest.raises(SystemExit) as end:
        extras.summary(args, 0)
    assert end.value.code == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2].startswith("Summary: cpu RPC 1.000 s, cuda RPC 1.000 s")
    assert lines[-1].startswith(f"--summary_json {args.summary_json}: not written (")


# --------- End to end, on the machine at hand --------------------

def test_the_folder_imports_nothing_from_outside_it():
    assert outside_imports(FOLDER) == []


def check_run(output, summary):
    """What a complete run printed and wrote, on this machine's devices (no --device_map)."""
    lines = output.splitlines()
    assert lines[0] == expected_first_line(GPUS), output
    order = [next(i for i, line in enumerate(lines) if re.fullmatch(pattern, line))
             for pattern in (r"cpu RPC total execution time: [\d.e-]+",
                             r"cuda RPC total execution time: [\d.e-]+",
                             r"worker0 sent a tensor on \S+: it arrived on worker1's \S+, and "
                             r"worker1's reply arrived on worker0's \S+",
                             SUMMARY)]
    assert order == sorted(order), output
    assert "Traceback" not in output and "ProcessGroup" not in output, output
    local, remote, device_map = extras.choose_devices(GPUS)
    assert summary["landed"] == {"sent": local, "landed": remote, "reply": local}, summary
    assert summary["devices"] == {"worker0": local, "worker1": remote}
    assert summary["device_map"] == (None if device_map is None else
                                     {str(k): v for k, v in device_map.items()})
    assert summary["iterations"] == 1
    assert summary["seconds"]["cpu"] > 0 and summary["seconds"]["cuda"] > 0


@pytest.fixture(scope="module")
def spawn_all(tmp_path_factory):
    """The brief's smoke test: the folder copied alone, its plain command (both workers from
    one command, the recipe's mp.spawn) in a Python where rpc_harness cannot be imported."""
    top = tmp_path_factory.mktemp("alone")
    copy = copy_example("cuda_rpc", top / "copy")
    run = Run([*ALONE, "main.py", "--iterations", 1, "--summary_json", top / "summary.json",
               "--master_port", find_free_port()], top / "logs", cwd=copy, merged=True)
    run.wait(180)
    alive = run.leftovers()
    run.kill_session()
    assert not alive, f"processes left running after {run.cmd}: {alive}"
    return run, top / "summary.json"


def test_every_worker_from_one_command(spawn_all):
    run, summary = spawn_all
    assert run.returncode == 0, run.output
    check_run(run.stdout, json.loads(summary.read_text()))


@pytest.mark.slow
@pytest.mark.launch_modes
def test_one_worker_per_command(runs, tmp_path):
    """worker1 first, then worker0, each its own plain command (the recipe's mp.Process):
    worker0's command ends with the summary."""
    common = ["--world_size", 2, "--iterations", 1, "--master_port", find_free_port()]
    worker1 = runs.start("cuda_rpc", *common, "--rank", 1, merged=True)
    worker0 = runs.start("cuda_rpc", *common, "--rank", 0, "--summary_json",
                         tmp_path / "summary.json", merged=True)
    for run in (worker0, worker1):
        run.wait(timeout=180)
        assert run.returncode == 0, run.output
        assert not run.leftovers()
    assert worker1.stdout.splitlines() == [expected_first_line(GPUS)], worker1.stdout
    assert re.fullmatch(SUMMARY, worker0.last_line), worker0.stdout
    check_run(worker0.stdout, json.loads((tmp_path / "summary.json").read_text()))


@pytest.mark.slow
@pytest.mark.launch_modes
def test_under_torchrun(runs, tmp_path):
    """torchrun starts both workers; each takes its rank and the meeting point from it."""
    script = example_command("cuda_rpc", "--iterations", 1, "--summary_json",
                             tmp_path / "summary.json")
    run = runs.start_command([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                              "2", "--master_port", str(find_free_port()), *script[1:]],
                             merged=True)
    run.wait(timeout=240)
    assert run.returncode == 0, run.output
    assert not run.leftovers()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 2
    first = expected_first_line(GPUS)
    assert run.stdout.count(first + "\n") == 2, run.stdout  # one a worker
    assert re.search(SUMMARY, run.stdout), run.stdout


# --------- bench/cuda_roundtrip.py, where it can run here --------------------

@pytest.fixture(scope="module")
def roundtrip():
    """bench/cuda_roundtrip.py as the module `cuda_roundtrip`, as RPC's pickles name it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("cuda_roundtrip",
                                                  ROOT / "bench" / "cuda_roundtrip.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["cuda_roundtrip"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("cuda_roundtrip", None)


def test_the_bench_says_in_one_line_that_it_needs_a_gpu(roundtrip, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(SystemExit) as end:
        roundtrip.main(["--output", "/nonexistent/CUDA-RPC.md"])
    assert end.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured
    assert captured.err.startswith("cuda_roundtrip.py: no GPU here (torch ")


@pytest.mark.parametrize("gpu_count, where", [
    (1, "one GPU: worker0 and worker1 both on cuda:0, device map {0: 0}"),
    (2, "worker0 on cuda:0, worker1 on cuda:1, the recipe's device map {0: 1}"),
])
def test_the_bench_page_names_the_machine_and_quotes_the_recipe(roundtrip, gpu_count, where):
    results = {1: {"staged": [0.004, 0.002, 0.003], "device map": [0.001, 0.002, 0.001]},
               256: {"staged": [0.5], "device map": [0.05]}}
    text = roundtrip.page(results, 3, 12.0, "Linux x86_64, a CPU, 16 cores; NVIDIA H100",
                          gpu_count, "2026-11-28")
    assert "Machine: Linux x86_64, a CPU, 16 cores; NVIDIA H100." in text
    assert where in text
    assert "| 1 MB | 3.00 ms (2.00) | 1.00 ms (1.00) | 3.0 |" in text
    assert "| 256 MB | 500.00 ms (500.00) | 50.00 ms (50.00) | 10.0 |" in text
    assert f"> {roundtrip.RECIPE_CLAIM}" in text and "34X speed up" in text


def test_the_bench_round_trip_on_a_cpu_stand_in(roundtrip, rpc_world, monkeypatch):
    """measure()'s two ways, to this process itself and on the CPU (CUDA's synchronize made a
    no-op): each repetition timed, the reply checked against the tensor sent."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    times = roundtrip.measure(1, 3, "cpu", "cpu", peer=rpc_world)
    assert set(times) == {"staged", "device map"}
    assert all(len(values) == 3 and min(values) > 0 for values in times.values()), times
