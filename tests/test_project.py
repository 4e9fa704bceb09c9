"""What the project promises of itself, read from its files: each example folder stands alone
(no import from outside it), each entry point makes its tutorial's calls, no module imports the
script that runs, and the requirements give every claimed Python one release of each package."""

import ast

import pytest
from conftest import ROOT, outside_imports

# --------- The requirements --------------------

def test_monarch_is_asked_for_only_where_it_has_wheels():
    """torchmonarch's wheels are for Linux and Python 3.10 to 3.13; torch has 3.14's too.
    requirements.txt's marker, evaluated for each: everything else installs on 3.14."""
    from packaging.markers import Marker
    from packaging.requirements import Requirement

    for path in ("requirements.txt", "requirements-newest.txt", "requirements-oldest.txt"):
        lines = (ROOT / path).read_text().splitlines()
        wanted = [Requirement(line) for line in lines if line.strip().startswith("torchmonarch")]
        assert len(wanted) == 1, path
        marker = wanted[0].marker or Marker("python_version >= '0'")
        for python, platform_name, expected in (("3.10", "linux", True),
                                                ("3.13", "linux", True),
                                                ("3.14", "linux", False),
                                                ("3.12", "darwin", False)):
            environment = {"python_version": python, "sys_platform": platform_name}
            assert marker.evaluate(environment) is expected, (path, python, platform_name)


def test_the_newest_pins_give_every_claimed_python_one_release_of_each_package():
    """requirements-newest.txt pins each package once for every Python that pyproject.toml
    claims (3.10 to 3.14), its markers evaluated for each: where the newest release has no
    wheel for an older Python, that Python gets the newest one that does."""
    from packaging.requirements import Requirement

    lines = (ROOT / "requirements-newest.txt").read_text().splitlines()
    pins = [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]
    for python in ("3.10", "3.11", "3.12", "3.13", "3.14"):
        environment = {"python_version": python, "sys_platform": "linux"}
        chosen = [pin.name for pin in pins
                  if pin.marker is None or pin.marker.evaluate(environment)]
        assert len(chosen) == len(set(chosen)), (python, chosen)
        assert {"torch", "torchvision", "numpy", "gymnasium"} <= set(chosen), python
        assert ("torchmonarch" in chosen) == (python != "3.14")


# --------- What every example keeps --------------------

EXAMPLES = ["param_server", "rl_cartpole", "rnn_model_parallel", "ddp_rpc_hybrid",
            "pipeline_parallel", "rpc_profiling", "cuda_rpc"]
# Each example's entry points: main.py, and a variant's script of its own.
ENTRY_POINTS = [f"{example}/{script}" for example in EXAMPLES for script in
                ("main.py", "batch.py", "remote_module.py", "pipelining.py")
                if (ROOT / example / script).exists()]


def test_every_example_is_covered():
    assert {p.name for p in ROOT.iterdir() if (p / "main.py").exists()} == set(EXAMPLES)


def _calls(tree):
    return [ast.unparse(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)]


def _assigned_environment(tree):
    """The names of the environment variables that the code sets: os.environ[NAME] = ..."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if (isinstance(target, ast.Subscript) and ast.unparse(target.value) == "os.environ"
                        and isinstance(target.slice, ast.Constant)):
                    names.add(target.slice.value)
    return names


@pytest.mark.parametrize("path", ENTRY_POINTS)
def test_each_entry_point_makes_the_tutorials_calls(path):
    """rpc.init_rpc(...) and rpc.shutdown() (dist.init_process_group(...) too where the tutorial
    has it) as the tutorial writes them, MASTER_ADDR and MASTER_PORT set in os.environ, and the
    ranks started by torch.multiprocessing itself: mp.spawn for every rank, mp.Process for one."""
    tree = ast.parse((ROOT / path).read_text())
    calls = _calls(tree)
    assert ("rpc.init_rpc" in calls) == ("rpc.shutdown" in calls), path
    if path.endswith("main.py"):
        assert "rpc.init_rpc" in calls, path
    if path in ("ddp_rpc_hybrid/main.py", "pipeline_parallel/pipelining.py"):
        assert "dist.init_process_group" in calls
    if path == "pipeline_parallel/pipelining.py":  # no RPC: the pipelining tutorial's calls
        assert {"PipelineStage", "dist.new_group", "dist.destroy_process_group"} <= set(calls)
    assert {"MASTER_ADDR", "MASTER_PORT"} <= _assigned_environment(tree), path
    assert {"mp.spawn", "mp.Process"} <= set(calls), path
    assert not [call for call in calls if call.startswith("rpc_harness.")], path


@pytest.mark.parametrize("example", EXAMPLES)
def test_no_module_imports_the_script_that_runs(example):
    """From each entry point, the modules of its folder that it imports, and theirs, never lead
    back to it: a script imported as a module would load a second time, with a second copy of
    every class and global."""
    folder = ROOT / example
    local = {path.stem for path in folder.glob("*.py")}
    imports = {}
    for path in folder.glob("*.py"):
        tree = ast.parse(path.read_text())
        imports[path.stem] = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                              for alias in node.names} | {
            node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        imports[path.stem] &= local
    for entry in ("main", "batch", "remote_module", "pipelining"):
        if entry not in local:
            continue
        reached, todo = set(), list(imports[entry])
        while todo:
            module = todo.pop()
            if module not in reached:
                reached.add(module)
                todo.extend(imports[module])
        assert entry not in reached, (example, entry, reached)


@pytest.mark.parametrize("example", [*EXAMPLES, "cuda_rpc"])
def test_each_example_folder_stands_alone(example):
    """No file of an example's folder imports anything but the folder's own modules, the
    packages of requirements.txt and the standard library: a folder copied alone runs."""
    if not (ROOT / example).is_dir():
        pytest.skip(f"no {example}/ here")
    assert outside_imports(ROOT / example) == []
