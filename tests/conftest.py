"""What every example's tests need: free ports, a bounded runner for an example's command line
that also checks nothing is left running, --profile's timeline, and tiny MNIST files.
In-process access to an example's modules is in example_modules.py."""

import contextlib
import gzip
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch.distributed.rpc as rpc
from example_modules import load_example

from rpc_harness.timeline import merge, read_traces

ROOT = Path(__file__).resolve().parent.parent

# The tests send Ctrl-C (SIGINT) to the commands they start, which must act on it as they would
# in a terminal. A pytest started in the background of a non-interactive shell (`make test &`,
# nohup) inherits SIGINT ignored, and so would every command it starts: that run's Ctrl-C tests
# failed, their commands deaf to SIGINT. Python's own handler here: a command started from this
# process then gets SIGINT's default, as exec resets a handled signal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# --------- Monarch, where it has wheels --------------------

# torchmonarch's wheels are for Linux and Python 3.10 to 3.13 (requirements.txt's marker): on
# another Python the Monarch programs' tests are skipped, saying why.
WHY_NO_MONARCH = ("torchmonarch is not installed for this Python (its wheels: Linux, Python "
                  "3.10 to 3.13)")


def needs_monarch():
    """Skip the test unless Monarch can be imported."""
    pytest.importorskip("monarch.actor", reason=WHY_NO_MONARCH)


def load_actors(example):
    """<example>/actors.py as a module, or the test skipped where Monarch is missing."""
    needs_monarch()
    return load_example(example, "actors")


# --------- Ports --------------------

def _ports_of_this_worker():
    """The ports this pytest process hands out: below the kernel's ephemeral range, so that no
    connection or listener that asks for any port (a rank's own, in any test) takes one between
    the test choosing it and rank 0 listening on it (seen in CI: "Address already in use");
    split between pytest-xdist's workers, so that two tests never choose the same one."""
    try:
        first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first_ephemeral = 32768  # Linux's default
    low = max(1024, first_ephemeral - 12000)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    share = (first_ephemeral - low) // workers
    return range(low + worker * share, low + (worker + 1) * share)


_PORTS = _ports_of_this_worker()
_DEFAULT_PORTS = range(29500, 29510)  # torch's and the examples' defaults, which a run may take
_ports_given = set()
_shuffled = random.Random()  # its own: a test that seeds the random module changes nothing here


def find_free_port():
    """A port that nothing on this machine uses now, not given to another test of this run."""
    for port in _shuffled.sample(_PORTS, len(_PORTS)):
        if port in _ports_given or port in _DEFAULT_PORTS:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _ports_given.add(port)
        return port
    raise RuntimeError(f"no free port in {_PORTS}")


@pytest.fixture
def free_port():
    return find_free_port()


# --------- Running examples --------------------

def example_command(example, *args, script="main.py"):
    """The command line that runs an example's main.py, or another of its entry points."""
    return [sys.executable, str(ROOT / example / script), *map(str, args)]


def _proc_stat(pid):
    """(state, parent pid, session id, start time) of a process, from /proc/<pid>/stat."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    return fields[0], int(fields[1]), int(fields[3]), int(fields[19])


def _processes(match):
    """Pids of the live processes (zombies excluded: they are already gone) whose
    (state, ppid, session, start) stat satisfies `match`, oldest first."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = _proc_stat(entry.name)
        except (OSError, ValueError):
            continue
        if stat[0] != "Z" and match(stat):
            found.append((stat[3], int(entry.name)))
    return [pid for _, pid in sorted(found)]


# The temporary folders that runs made for themselves (a test's own tmp_path aside): removed
# when the session ends, so that the suite leaves nothing in the temporary folder.
_FOLDERS_MADE = []


def pytest_sessionfinish(session, exitstatus):
    for folder in _FOLDERS_MADE:
        shutil.rmtree(folder, ignore_errors=True)


class Run:
    """One example process started in a session of its own, so that everything it starts can
    be found, checked and cleaned up afterwards. Output goes to files (no pipe to fill up);
    merged: its standard error into its standard output's file, in the order a terminal shows
    them (stderr is then empty)."""

    def __init__(self, cmd, log_dir=None, env=None, cwd=None, merged=False):
        if log_dir is None:
            log_dir = tempfile.mkdtemp(prefix="rpc-example-")
            _FOLDERS_MADE.append(log_dir)
        log_dir = Path(log_dir)
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                     "TP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
            full_env.pop(name, None)
        self.cmd = [str(part) for part in cmd]
        if "rpc_harness" not in self.cmd:
            # A plain command: one thread a rank, as rpcrun gives each of 2 or 3 ranks on 2
            # cores (a command under rpcrun gets rpcrun's own share, which its tests check).
            # With torch's default, every core in each rank, the ranks of two test files at
            # once wait on each other's threads.
            full_env["OMP_NUM_THREADS"] = "1"
        full_env.update(env or {})
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir  # the folder of its output, and of what a test writes beside it
        stem = log_dir / f"run{len(list(log_dir.glob('*.out')))}"
        # Its own temporary folder, which every process of the run inherits (processes()
        # finds them by it): a short path, as Monarch's processes put Unix sockets there (at
        # most 108 bytes).
        self.tmpdir = Path(tempfile.mkdtemp(prefix="run-"))
        _FOLDERS_MADE.append(self.tmpdir)
        full_env["TMPDIR"] = str(self.tmpdir)
        self.out_path, self.err_path = stem.with_suffix(".out"), stem.with_suffix(".err")
        self.started = time.monotonic()
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(self.cmd, env=full_env, cwd=cwd or ROOT, stdout=out,
                                         stderr=subprocess.STDOUT if merged else err,
                                         start_new_session=True)
        self.returncode = None
        self.seconds = None

    @property
    def stdout(self):
        return self.out_path.read_text()

    @property
    def stderr(self):
        return self.err_path.read_text()

    @property
    def output(self):
        return self.stdout + self.stderr

    @property
    def last_line(self):
        """The last line that is not empty (of a merged run: what its terminal shows last)."""
        lines = [line for line in self.output.splitlines() if line.strip()]
        return lines[-1] if lines else ""

    def wait(self, timeout):
        """Wait for the process; on timeout kill its whole session and fail the test."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_session()
            self.proc.wait()
            pytest.fail(f"{' '.join(self.cmd)} did not finish within {timeout} s\n"
                        f"{self.stdout[-3000:]}\n{self.stderr[-3000:]}")
        self.seconds = time.monotonic() - self.started
        self.returncode = self.proc.returncode
        return self

    def wait_for_output(self, pattern, timeout):
        """Poll the output until `pattern` (a regex) appears; fail the test after `timeout`."""
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.output, re.M):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill_session()
                pytest.fail(f"{pattern!r} never appeared in the output of "
                            f"{' '.join(self.cmd)}:\n{self.output[-3000:]}")
            time.sleep(0.05)

    def children(self):
        """The processes this one started directly, oldest first (for spawn-all: ranks 0, 1,
        ..., after multiprocessing's resource tracker, which is filtered out)."""
        pids = _processes(lambda stat: stat[1] == self.proc.pid)
        return [pid for pid in pids
                if b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()]

    def processes(self):
        """Every live process of this run, wherever it went (a session of its own, as the
        command that rpcrun supervises; an orphan): each inherited the run's own TMPDIR."""
        token = f"\0TMPDIR={self.tmpdir}\0".encode()
        found = []
        for pid in _processes(lambda stat: True):
            with contextlib.suppress(OSError):
                if token in b"\0" + Path(f"/proc/{pid}/environ").read_bytes():
                    found.append(pid)
        return found

    def leftovers(self, grace=10.0):
        """Processes of this run still alive after `grace` seconds (polled, not slept)."""
        deadline = time.monotonic() + grace
        while True:
            alive = self.processes()
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.1)

    def kill_session(self):
        """Kill whatever of the run is left, and remove its temporary folder."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in self.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        shutil.rmtree(self.tmpdir, ignore_errors=True)


@pytest.fixture
def runs(tmp_path):
    """Starts example processes for a test (runs.start(...)) and makes sure none survives it."""
    started = Runs(tmp_path / "logs")
    yield started
    for run in started:
        run.kill_session()
        if run.proc.poll() is None:
            run.proc.wait(timeout=10)


class Runs(list):
    def __init__(self, log_dir):
        super().__init__()
        self.log_dir = log_dir

    def start(self, example, *args, env=None, prefix=(), script="main.py", merged=False):
        return self.start_command([*prefix, *example_command(example, *args, script=script)],
                                  env=env, merged=merged)

    def start_command(self, cmd, env=None, cwd=None, merged=False):
        run = Run(cmd, self.log_dir, env=env, cwd=cwd, merged=merged)
        self.append(run)
        return run


def start_example(example, *args, env=None, log_dir=None, script="main.py"):
    return Run(example_command(example, *args, script=script), log_dir, env=env)


# --------- The entry points, and their short runs --------------------

@dataclass
class Example:
    """An entry point, and the flags of its short and its endless runs."""

    name: str
    world_size: int  # the smallest world that has every role
    quick: list  # flags for a short complete run
    endless: list  # flags for a run that lasts until it is killed
    roles: dict  # rank -> worker name
    working: str  # a line that shows the run is under way
    script: str = "main.py"


RUNS = {
    "param_server": Example(
        "param_server", 2, ["--dataset", "synthetic", "--max_batches", 5],
        ["--dataset", "synthetic", "--epochs", 1000], {0: "parameter_server", 1: "trainer_1"},
        r"^Rank 1 training batch"),
    "param_server/batch.py": Example(
        "param_server", 3, ["--dataset", "synthetic", "--max_batches", 5],
        ["--dataset", "synthetic", "--epochs", 1000], {0: "ps", 1: "trainer1"},
        r"^Rank 1 training batch", script="batch.py"),
    "rl_cartpole": Example(
        "rl_cartpole", 2, ["--max_episodes", 5], ["--max_episodes", 100000, "--log_interval", 1],
        {0: "agent", 1: "observer1"}, r"^Episode 1\t"),
    "rl_cartpole/batch.py": Example(
        "rl_cartpole", 3, ["--max_episodes", 5], ["--max_episodes", 100000, "--log_interval", 1],
        {0: "agent", 1: "observer1", 2: "observer2"}, r"^Episode 1\t", script="batch.py"),
    "rnn_model_parallel": Example(
        "rnn_model_parallel", 2, ["--epochs", 1, "--max_batches", 20], ["--epochs", 100000],
        {0: "ps", 1: "trainer"}, r"^Training epoch 0"),
    "ddp_rpc_hybrid": Example(
        "ddp_rpc_hybrid", 3, ["--epochs", 2], ["--epochs", 100000],
        {0: "trainer0", 1: "master", 2: "ps"}, r"^Training done for epoch"),
    "ddp_rpc_hybrid/remote_module.py": Example(
        "ddp_rpc_hybrid", 3, ["--epochs", 2], ["--epochs", 100000],
        {0: "trainer0", 1: "master", 2: "ps"}, r"^Training done for epoch",
        script="remote_module.py"),
    "pipeline_parallel": Example(
        "pipeline_parallel", 3, ["--num_split", 2, "--batch_size", 4, "--num_batches", 2],
        ["--num_split", 2, "--batch_size", 4, "--num_batches", 100000],
        {0: "master", 1: "worker1", 2: "worker2"}, r"^Processing batch 1$"),
    "pipeline_parallel/pipelining.py": Example(
        "pipeline_parallel", 2, ["--num_split", 2, "--batch_size", 4, "--num_batches", 2],
        ["--num_split", 2, "--batch_size", 4, "--num_batches", 100000],
        {0: "stage0", 1: "stage1"}, r"^GPipe, n_microbatches 2, batch 1:", "pipelining.py"),
    "rpc_profiling": Example(
        "rpc_profiling", 2, [], [], {0: "worker0", 1: "worker1"},
        r"^DEBUG:root:worker\d+ successfully initialized RPC\."),
    # cuda_rpc prints nothing while its timed passes run: its endless run shows only the
    # command's first line (where the workers run), which comes before the workers start.
    "cuda_rpc": Example(
        "cuda_rpc", 2, ["--iterations", 1], ["--iterations", 100000], {0: "worker0", 1: "worker1"},
        r"^(No CUDA here|One GPU here|\d+ GPUs here|--device_map): "),
}


def finish_together(runs, timeout):
    """Wait for runs that were started together: the ranks of the small examples spend much of
    their time waiting for each other's messages, so two cores serve several runs at once. Fails
    the test on a timeout or on processes left running; nothing survives either way."""
    try:
        for run in runs:
            run.wait(timeout)
            assert not run.leftovers(), f"processes left running after {' '.join(run.cmd)}"
    finally:
        for run in runs:
            run.kill_session()
    return runs


def run_example(example, *args, timeout=120, env=None, log_dir=None, script="main.py",
                folder=None):
    """Run an example to completion; fail the test if it times out or leaves processes.
    folder: a copy of the example's folder, where `python script` runs (from that folder)."""
    if folder is None:
        run = start_example(example, *args, env=env, log_dir=log_dir, script=script)
    else:
        run = Run([sys.executable, script, *args], log_dir, env=env, cwd=folder)
    run.wait(timeout)
    alive = run.leftovers()
    run.kill_session()
    assert not alive, f"processes left running after {example}: {alive}"
    return run


# --------- A folder copied alone --------------------

# The packages a copied folder may import besides its own modules and the standard library:
# requirements.txt's.
THIRD_PARTY = {"torch", "torchvision", "gymnasium", "numpy", "monarch"}

# A Python command that runs a script as `python SCRIPT ARGS...` does, except that this
# project's package cannot be imported (the test's Python has it installed): a folder that
# needed it stops at its first import, as it would in a user's own project. Run it from the
# copied folder (cwd), which is then first on sys.path, as the script's folder is for `python
# SCRIPT`. The ranks that mp.spawn and mp.Process start import the same modules as the script.
ALONE = [sys.executable, "-c",
         "import runpy, sys; sys.modules['rpc_harness'] = None; sys.argv = sys.argv[1:]; "
         "runpy.run_path(sys.argv[0], run_name='__main__')"]


def copy_example(example, destination):
    """The example's folder copied alone to destination (its own modules, README and pictures;
    no cache); returns the copy's path."""
    shutil.copytree(ROOT / example, destination, ignore=shutil.ignore_patterns("__pycache__"))
    return Path(destination)


def outside_imports(folder):
    """The imports of a folder's Python files that name neither a module of the folder, nor a
    package of requirements.txt (THIRD_PARTY), nor the standard library: [(file, module)]."""
    import ast

    own = {path.stem for path in Path(folder).glob("*.py")}
    found = []
    for path in sorted(Path(folder).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module or ""] if node.level == 0 else ["."]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top in own or top in THIRD_PARTY or top in sys.stdlib_module_names:
                    continue
                found.append((path.name, module))
    return found


# --------- Runs under the supervisor --------------------

def supervised_command(example, *args, script="main.py", rpcrun=()):
    """`python -m rpc_harness [RPCRUN FLAGS] <example>/<script> ARGS...`: the example's command
    with the supervisor in front (run it from ROOT, where `-m` finds the package)."""
    return [sys.executable, "-m", "rpc_harness", *map(str, rpcrun), str(ROOT / example / script),
            *map(str, args)]


# --------- Runs that a fault ends (test_failures*.py) --------------------

# How long the other ranks may take to exit after one is killed. Measured: well under a second
# when the machine is idle (a dead process's connections close at once); the bound leaves room
# for a loaded 2-core CI machine.
EXIT_BOUND_SECONDS = 20


def start_run(runs, key, *flags, rank=None, endless=False, **kwargs):
    """A run of an example with its short (or endless) flags, in the smallest world that has
    every role; `rank`: that rank alone."""
    config = RUNS[key]
    return runs.start(config.name, *(config.endless if endless else config.quick),
                      "--world_size", config.world_size, *flags,
                      *(() if rank is None else ("--rank", rank)), script=config.script, **kwargs)


def signal_again_and_again(run, number, times, group=True):
    """Send signal `number` `times` times, 0.3 s apart, to every process of the run's terminal
    (group: as Ctrl-C does) or to its command alone (as `kill` does), as long as it runs: people
    press Ctrl-C again when a program does not stop at once."""
    for _ in range(times):
        with contextlib.suppress(ProcessLookupError):
            if group:
                os.killpg(run.proc.pid, number)
            else:
                run.proc.send_signal(number)
        time.sleep(0.3)


# --------- --profile's timeline --------------------

def check_timeline(runs, folder, ranks, callee, operators):
    """A run with --profile FOLDER (its commands: one, or one per rank), each rank profiled by
    the example's own lines of torch.profiler: every rank's trace, written whole and named in
    its output, which merged (rpcrun's timeline, rpc_harness.timeline) make a track per rank
    (`ranks`, in rank order) whose loops' step spans bound a window, inside which the rank
    `callee` ran one of `operators` (the work the tutorial says runs there), where this torch
    records RPC's threads. Returns the merged timeline's events."""
    for run in runs:
        assert run.returncode == 0, run.output
    stdout = "".join(run.stdout for run in runs)
    for name in ranks:
        assert re.search(rf"^{name}: profiled, wrote .*{name}\.json \(\d+ kB\)", stdout,
                         re.M), stdout
    traces = read_traces(folder)
    assert list(traces) == list(ranks), f"traces in {folder}: {list(traces)}"
    events = merge(traces)["traceEvents"]
    tracks = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    steps = [e for e in events if e.get("ph") == "X" and e["name"].startswith("ProfilerStep#")]
    assert steps, "no step spans of the looping ranks"
    start, end = min(e["ts"] for e in steps), max(e["ts"] + e["dur"] for e in steps)
    if not records_every_thread():
        return events
    work = {e["name"] for e in events if e.get("ph") == "X" and tracks.get(e["pid"]) == callee
            and start <= e["ts"] <= end}
    assert work & set(operators), f"none of {operators} on {callee} in the window: {work}"
    return events


def records_every_thread():
    """Whether this torch's profiler records every thread (2.4 records only the one that
    started it, and so none of RPC's threads: pytorch/pytorch#143659)."""
    import torch

    try:
        torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except TypeError:
        return False
    return True


# --------- An RPC world of this test process alone --------------------

@pytest.fixture(scope="session")
def rpc_world():
    """This test process as the only worker of an RPC world, on loopback and TCP only (the
    shared-memory transport keeps a thread polling for as long as RPC is up). One world for the
    whole session: RRefs of a world that has shut down may still be deleted later, which fails
    in the next world. Yields the worker's name; tests that pickle an example's functions for
    RPC run inside example_modules(example)."""
    saved = {name: os.environ.get(name) for name in ("TP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")}
    os.environ["TP_SOCKET_IFNAME"] = os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{find_free_port()}", rpc_timeout=60, _transports=["uv"])
    rpc.init_rpc("tests", rank=0, world_size=1, rpc_backend_options=options)
    yield "tests"
    rpc.shutdown()
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


# --------- Tiny MNIST --------------------

def _write_idx(path, array, compress):
    """IDX format: magic (0, 0, dtype 0x08 = ubyte, number of dimensions), the sizes as
    big-endian int32, then the data."""
    header = bytes([0, 0, 0x08, array.ndim]) + np.array(array.shape, dtype=">i4").tobytes()
    payload = header + array.astype(np.uint8).tobytes()
    if compress:
        path = path.with_name(path.name + ".gz")
        payload = gzip.compress(payload)
    path.write_bytes(payload)


def write_mnist(root, train_size=600, test_size=200, seed=0, compress=False):
    """Write MNIST-format files under root/MNIST/raw, as torchvision expects them. The digits
    are param_server's synthetic ones turned back into 0..255 pixels, so a model can learn them."""
    synthetic_digits = load_example("param_server", "data").synthetic_digits
    raw = Path(root) / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for prefix, size, offset in (("train", train_size, 0), ("t10k", test_size, 1)):
        images, labels = synthetic_digits(size, seed + offset).tensors
        pixels = ((images * 0.3081 + 0.1307).clamp(0, 1) * 255).round().squeeze(1).numpy()
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", pixels, compress)
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels.numpy(), compress)
    return Path(root)


# --------- Which end-to-end runs the quick suite keeps --------------------

# Fixtures that run an example end to end (module-scoped: several tests read one run). The quick
# suite (pytest -m "not slow") keeps one of them: the parameter server's spawn-all run, profiled
# (the tutorial's join, --profile's timeline, the summary). The others' tests are slow: each
# command costs seconds of CPU for its torch import alone, and a rank that --rank names runs in a
# process of its own beside its command's (the tutorial's mp.Process). pipelining.py, whose API
# changed most between torch versions, runs on the oldest torch in make test-oldest's
# launch-mode runs (tests/test_launch_modes.py), and on every torch in make versions.
END_TO_END_FIXTURES = {"tutorial", "batch", "batch_run", "finished", "spawn_all",
                       "spawn_all_runs", "two_trainers", "pipelining_run", "profiled_run",
                       "monarch_run"}
QUICK_RUNS = {("test_param_server", "two_trainers")}


# pytest-xdist hands whole files to the two workers (pyproject.toml's addopts), in the order of
# collection. Longest first, so that no long file is left for last while the other worker has
# nothing to do. In `make test` on 2 cores (2026-11-29) the files named here took about 177,
# 158, 139, 116, 104, 47, 41, 35, 32, 24, 21 and 17 s of a worker's time; a file not named here
# goes last.
LONGEST_FIRST = ["test_rl_cartpole", "test_failures", "test_param_server",
                 "test_pipeline_parallel", "test_ddp_rpc_hybrid", "test_rnn_model_parallel",
                 "test_rpcrun", "test_monarch_runs", "test_bench", "test_versions",
                 "test_rpc_profiling", "test_cuda_rpc"]


def pytest_collection_modifyitems(items):
    for item in items:
        module = item.module.__name__
        for name in item.fixturenames:
            if name in END_TO_END_FIXTURES and (module, name) not in QUICK_RUNS:
                item.add_marker(pytest.mark.slow)
    rank = {module: place for place, module in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__, len(LONGEST_FIRST)))


# --------- Two hosts --------------------

def _ip(*args, check=True):
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair, with private addresses: two 'machines'."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("needs root and iproute2's ip to create network namespaces")
    tag = f"{os.getpid() % 10000}"
    hosts = [f"rpcA{tag}", f"rpcB{tag}"]
    subnet = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
    addresses = [f"{subnet}.1", f"{subnet}.2"]
    try:
        for host in hosts:
            _ip("netns", "add", host)
        _ip("link", "add", f"ve{tag}a", "type", "veth", "peer", "name", f"ve{tag}b")
        for host, end, address in zip(hosts, "ab", addresses, strict=True):
            _ip("link", "set", f"ve{tag}{end}", "netns", host)
            _ip("-n", host, "addr", "add", f"{address}/24", "dev", f"ve{tag}{end}")
            _ip("-n", host, "link", "set", f"ve{tag}{end}", "up")
            _ip("-n", host, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as err:
        for host in hosts:
            _ip("netns", "del", host, check=False)
        pytest.skip(f"cannot create network namespaces here: {err.stderr.strip()}")
    yield list(zip(hosts, addresses, strict=True))
    for host in hosts:
        for pid in _ip("netns", "pids", host, check=False).stdout.split():
            os.kill(int(pid), signal.SIGKILL)
        _ip("netns", "del", host, check=False)
