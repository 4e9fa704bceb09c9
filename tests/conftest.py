"""What every example's tests need: free ports, a bounded runner for an example's command line
that also checks nothing is left running, tiny MNIST files, and in-process access to a main.py."""

import gzip
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ("param_server", "rl_cartpole", "rnn_model_parallel", "ddp_rpc_hybrid")


# --------- Ports --------------------

def _port_is_free(port):
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def find_free_port():
    """A port that is free, with the next one free too (ddp_rpc_hybrid uses master_port + 1)."""
    for _ in range(100):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port < 65535 and _port_is_free(port + 1):
            return port
    raise RuntimeError("no two adjacent free ports found")


@pytest.fixture
def free_port():
    return find_free_port()


# --------- Running examples --------------------

def example_command(example, *args):
    return [sys.executable, str(ROOT / example / "main.py"), *map(str, args)]


def _session_processes(session_id):
    """Pids of the live processes in a session (zombies excluded: they are already gone)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        state, session = fields[0], int(fields[3])
        if session == session_id and state != "Z":
            pids.append(int(entry.name))
    return pids


class Run:
    """One example process started in a session of its own, so that everything it starts can
    be found, checked and cleaned up afterwards."""

    def __init__(self, cmd, env=None, cwd=None):
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            if env is None or name not in env:
                full_env.pop(name, None)
        self.cmd = cmd
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, env=full_env, cwd=cwd or ROOT, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     start_new_session=True)
        self.returncode = self.stdout = self.stderr = None
        self.seconds = None

    @property
    def output(self):
        return (self.stdout or "") + (self.stderr or "")

    def wait(self, timeout):
        """Wait for the process; on timeout kill its whole session and fail the test."""
        try:
            self.stdout, self.stderr = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_session()
            self.stdout, self.stderr = self.proc.communicate()
            pytest.fail(f"{' '.join(self.cmd)} did not finish within {timeout} s\n"
                        f"{self.stdout[-3000:]}\n{self.stderr[-3000:]}")
        self.seconds = time.monotonic() - self.started
        self.returncode = self.proc.returncode
        return self

    def leftovers(self, grace=10.0):
        """Processes of this run still alive after `grace` seconds (polled, not slept)."""
        deadline = time.monotonic() + grace
        while True:
            alive = _session_processes(self.proc.pid)
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.1)

    def kill_session(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_example(example, *args, timeout=120, env=None, check_leftovers=True):
    """Run an example to completion; fail the test if it times out or leaves processes."""
    run = Run(example_command(example, *args), env=env).wait(timeout)
    if check_leftovers:
        alive = run.leftovers()
        run.kill_session()
        assert not alive, f"processes left running after {example}: {alive}"
    return run


def start_example(example, *args, env=None):
    return Run(example_command(example, *args), env=env)


@pytest.fixture
def runs():
    """Collects Run objects started in a test and makes sure none survives it."""
    started = []
    yield started
    for run in started:
        run.kill_session()
        if run.proc.poll() is None:
            run.proc.wait(timeout=10)


# --------- Loading an example in-process --------------------

def load_example(example):
    """Import <example>/main.py as a module (examples are scripts, not packages)."""
    name = f"{example}_main"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / example / "main.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


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
    synthetic_digits = load_example("param_server").synthetic_digits
    raw = Path(root) / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for prefix, size, offset in (("train", train_size, 0), ("t10k", test_size, 1)):
        images, labels = synthetic_digits(size, seed + offset).tensors
        pixels = ((images * 0.3081 + 0.1307).clamp(0, 1) * 255).round().squeeze(1).numpy()
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", pixels, compress)
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels.numpy(), compress)
    return Path(root)
