"""`make versions`: every entry point on every torch and Python this project claims, each in an
environment of its own, and the table of what ran (docs/versions.md).

The environments, one at a time (made, used, removed: each torch with its CUDA libraries is
about 6 GB):

    torch 2.4 ... newest   the newest patch of each torch minor from requirements.txt's floor to
                           the newest the registry serves, with the torchvision that pairs with
                           it, on this Python (the default)
    Python 3.10 ... 3.14   each Python that pyproject.toml claims, on the newest torch that has
                           wheels for it; a Python this machine lacks is resolved only (what
                           its markers give), and its cells say that it was not run

In each environment, every entry point runs its README's first command shortened by flags only,
in every launch mode it has. From one command (`spawn-all`, every rank; the Monarch programs'
own way, `monarch`) it runs long enough to learn, and counts only when it exits 0 and its
summary shows that it learned what its tests check at that size (Program.learned below). A rank
a process, as a terminal each (`per-rank`, the last rank started first), and `torchrun` start
the same program another way: there it runs to the end at its smallest (tests/conftest.py's
RUNS), and counts when it exits 0, has written its summary and left nothing running. A cell (an
entry point on one environment) is marked ran when every one of its runs counted; otherwise it
holds each failing run's last line.

Installs use uv: 20 to 50 s an environment here with nothing cached, against minutes with pip.
Each environment has a uv cache of its own, removed with it, so that the disk holds one torch
at a time (`--shared_cache`: uv's own cache, which keeps every torch). The results go to
bench/versions.json after every run, so Ctrl-C stops and a later run picks up where it stopped
(`--again` to start over). At the end, and with `--report`, docs/versions.md is written.
A lent GPU machine's runs, recorded with `--here` into bench/versions-gpu.json, get a section
of their own there (`--lent`).

    python bench/versions.py                    # the whole matrix
    python bench/versions.py --env "torch 2.6"  # the environments whose label starts so
    python bench/versions.py --here --label "GPU machine, torch 2.11.0" \
        --state bench/versions-gpu.json --output /tmp/versions-gpu.md
                                                # this interpreter as it is, no install
    python bench/versions.py --report           # docs/versions.md from bench/versions.json
"""

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ports import free_port

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
STATE = BENCH / "versions.json"
REPORT = ROOT / "docs" / "versions.md"
# A lent GPU machine's own torch, run with --here: a section of its own in REPORT.
LENT = BENCH / "versions-gpu.json"
RUN_SECONDS = 300  # one run's bound: the slowest here takes about 40 s on 2 busy cores
MODES = ("spawn-all", "per-rank", "torchrun")


# --------- What is claimed --------------------

def torch_floor():
    """The oldest torch minor that requirements.txt allows, as (major, minor)."""
    text = (ROOT / "requirements.txt").read_text()
    found = re.search(r"^torch>=(\d+)\.(\d+)", text, re.M)
    return int(found[1]), int(found[2])


def claimed_pythons():
    """The Python minors that pyproject.toml's classifiers claim, oldest first ("3.10", ...)."""
    text = (ROOT / "pyproject.toml").read_text()  # read as text: tomllib is 3.11's
    found = re.findall(r'"Programming Language :: Python :: (3\.\d+)"', text)
    return sorted(found, key=lambda version: int(version.split(".")[1]))


def served_torch_minors(python):
    """The newest patch of each torch minor from the floor up that the registry serves:
    ["2.4.1", "2.5.1", ...]. Asks the registry (pip index), as a user's pip would."""
    listing = subprocess.run([python, "-m", "pip", "index", "versions", "torch"],
                             capture_output=True, text=True, check=True).stdout
    versions = re.search(r"Available versions: (.*)", listing)[1].split(", ")
    newest = {}
    for version in versions:
        if re.fullmatch(r"\d+\.\d+\.\d+", version):  # no local builds such as 2.13.0+cpu
            major, minor, patch = map(int, version.split("."))
            if (major, minor) >= torch_floor():
                newest[(major, minor)] = max(newest.get((major, minor), -1), patch)
    return [f"{major}.{minor}.{patch}" for (major, minor), patch in sorted(newest.items())]


def find_python(minor):
    """The path of the newest Python `minor` ("3.12") that pyenv holds here, or None."""
    try:
        listed = subprocess.run(["pyenv", "versions", "--bare"], capture_output=True,
                                text=True, check=True).stdout.split()
        root = subprocess.run(["pyenv", "root"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        listed, root = [], ""
    matching = [v for v in listed if re.fullmatch(re.escape(minor) + r"\.\d+", v)]
    if matching:
        newest = max(matching, key=lambda v: int(v.split(".")[2]))
        return str(Path(root) / "versions" / newest / "bin" / f"python{minor}")
    if f"{sys.version_info.major}.{sys.version_info.minor}" == minor:
        return sys.executable
    return None


@dataclass
class Environment:
    """One column of the table: a Python and a torch (None: the newest with wheels for it)."""

    label: str
    python_minor: str
    torch: str | None
    python: str | None  # the interpreter's path; None: this machine lacks it


def environments(default_python):
    """Every environment of the matrix, in the order it runs them: the torch minors on the
    default Python, then every other claimed Python on its newest torch."""
    default_minor = "{}.{}".format(*sys.version_info[:2])
    found = [Environment(f"torch {version}", default_minor, version, default_python)
             for version in served_torch_minors(default_python)]
    for minor in claimed_pythons():
        if minor != default_minor:
            found.append(Environment(f"Python {minor}", minor, None, find_python(minor)))
    return found


# --------- The entry points, their short runs, and what each must learn --------------------

EPISODE = re.compile(r"^Episode \d+\tLast reward: (\S+)\t", re.M)


def _rewards_rose(factor):
    """The mean of the last 10 episodes' rewards is `factor` times that of the first 10 (a random
    policy lasts about 20 steps): rl_cartpole's tests' bound for the same run."""
    def check(summary, output):
        rewards = [float(reward) for reward in EPISODE.findall(output)]
        if len(rewards) < 20:
            return f"only {len(rewards)} episodes logged"
        first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
        if last > factor * first:
            return None
        return f"did not learn: last 10 episodes' mean reward {last:.1f}, first 10's {first:.1f}"
    return check


def _accuracy_at_least(bound):
    def check(summary, output):
        accuracy = summary.get("accuracy")
        if accuracy is None:
            accuracy = min(summary["accuracy_per_trainer"].values())
        return None if accuracy >= bound else f"did not learn: accuracy {accuracy:.3f}"
    return check


def _loss_fell(ratio, *, first_of=lambda s: s["first_loss"], last_of=lambda s: s["last_loss"]):
    """Each of the summary's losses (one, or one per trainer or schedule) fell below `ratio`
    of its first."""
    def check(summary, output):
        firsts, lasts = first_of(summary), last_of(summary)
        if not isinstance(firsts, dict):
            firsts, lasts = {"": firsts}, {"": lasts}
        for name, first in firsts.items():
            if not lasts[name] < ratio * first:
                return f"did not learn: {name} loss {first:.3f} -> {lasts[name]:.3f}".replace(
                    "  ", " ")
        return None
    return check


def _profiled(summary, output):
    """The recipe's run: worker1's own profile holds its operators, or this torch's profiler
    records only the main thread and the run said so (rpc_harness.compat.profiler_options)."""
    if summary["worker1_operators"] > 0 or summary["all_threads"] is False:
        return None
    return "worker1's profile holds no operators"


def _cuda_rpc_ran(summary, output):
    """cuda_rpc: both of the recipe's modes were timed, and the test tensor went where the
    device map sends it, and came back."""
    devices = summary["devices"]
    if not (summary["seconds"]["cpu"] > 0 and summary["seconds"]["cuda"] > 0):
        return "a mode was not timed"
    expected = {"sent": devices["worker0"], "landed": devices["worker1"],
                "reply": devices["worker0"]}
    if summary["landed"] != expected:
        return f"the tensor landed on {summary['landed']}, not {expected}"
    return None


def _schedules(summary):
    return {name: figures["2"] for name, figures in summary["schedules"].items()}


@dataclass
class Program:
    """An entry point: its script, its world and flags for a run that learns, the check of that
    run's summary and output (None when it learned, else what it did not), and the smallest
    world and flags of a complete run (tests/conftest.py's RUNS), for the other launch modes."""

    key: str
    world_size: int
    flags: list
    learned: object
    quick_world_size: int = 2
    quick: list = field(default_factory=list)
    monarch: bool = False
    # the torch versions ("2.9.1+cu128") that the program refuses by design, in one line and
    # status 2, where the runs here use Gloo: their cells do not apply, the line noted
    refuses: object = lambda torch_version: False

    @property
    def script(self):
        return ROOT / self.key

    @property
    def modes(self):
        return ("monarch",) if self.monarch else MODES


PARAM_SERVER = ["--dataset", "synthetic", "--max_batches", "60", "--log_interval", "20"]
PARAM_SERVER_QUICK = ["--dataset", "synthetic", "--max_batches", "5"]
PIPELINE = ["--num_split", "2", "--batch_size", "16", "--lr", "0.02"]
PIPELINE_QUICK = ["--num_split", "2", "--batch_size", "4", "--num_batches", "2"]
PROGRAMS = [
    Program("param_server/main.py", 3, PARAM_SERVER, _accuracy_at_least(0.5), 2,
            PARAM_SERVER_QUICK),
    Program("param_server/batch.py", 3, PARAM_SERVER, _accuracy_at_least(0.7), 3,
            PARAM_SERVER_QUICK),
    Program("param_server/actors.py", 3, PARAM_SERVER, _accuracy_at_least(0.7), monarch=True),
    Program("rl_cartpole/main.py", 2, ["--max_episodes", "60", "--log_interval", "1"],
            _rewards_rose(1.5), 2, ["--max_episodes", "5"]),
    Program("rl_cartpole/batch.py", 3, ["--max_episodes", "30", "--log_interval", "1"],
            _rewards_rose(1.3), 3, ["--max_episodes", "5"]),
    Program("rl_cartpole/actors.py", 2, ["--max_episodes", "60", "--log_interval", "1"],
            _rewards_rose(1.5), monarch=True),
    Program("rnn_model_parallel/main.py", 2, ["--epochs", "4"], _loss_fell(0.6), 2,
            ["--epochs", "1", "--max_batches", "20"]),
    Program("ddp_rpc_hybrid/main.py", 4, ["--epochs", "10"], _loss_fell(0.5), 3,
            ["--epochs", "2"]),
    Program("ddp_rpc_hybrid/remote_module.py", 4, ["--epochs", "10"], _loss_fell(0.5), 3,
            ["--epochs", "2"]),
    Program("pipeline_parallel/main.py", 3, [*PIPELINE, "--num_batches", "12"],
            _loss_fell(0.8, first_of=lambda s: s["splits"]["2"]["first_loss"],
                       last_of=lambda s: s["splits"]["2"]["last_loss"]), 3, PIPELINE_QUICK),
    Program("pipeline_parallel/pipelining.py", 2, [*PIPELINE, "--num_batches", "10"],
            _loss_fell(0.8, first_of=lambda s: {k: v["first_loss"] for k, v in
                                                _schedules(s).items()},
                       last_of=lambda s: {k: v["last_loss"] for k, v in _schedules(s).items()}),
            2, PIPELINE_QUICK, refuses=lambda version: version.startswith("2.9.")),
    Program("rpc_profiling/main.py", 2, [], _profiled, 2, []),
    Program("cuda_rpc/main.py", 2, ["--iterations", "3"], _cuda_rpc_ran, 2,
            ["--iterations", "1"]),
]

# The flags that make a run shorter (or say where it writes), which a cell may add to a command
# that its README shows; any other flag picks another path (--num_split, --schedule,
# --batch_update_size), and the command must be one that a README shows with it.
SHORTENING = {"--max_batches", "--max_episodes", "--epochs", "--num_batches", "--iterations",
              "--log_interval", "--world_size", "--summary_json", "--profile", "--master_port"}


def shown_command(program, flags):
    """The command that a README shows, of which a cell's run is a shortening: `flags` without
    the SHORTENING flags and their values."""
    words, skipping = [], False
    for word in flags:
        if word.startswith("--"):
            skipping = word.split("=")[0] in SHORTENING
            if skipping:
                continue
        elif skipping:
            continue
        words.append(word)
    return ["python", program.key, *words]


def commands_section():
    """The page's list of what each cell ran: for each program, the command from one command
    (the run that learns), and the smallest run that the other launch modes use."""
    lines = ["## The commands", "",
             "Each cell's runs, from the repository's root. The other launch modes run the "
             "second command, with `--rank` (one rank a terminal) or under torchrun. Each is a "
             "command that the program's README shows, with only flags that make it shorter "
             "(" + ", ".join(f"`{flag}`" for flag in sorted(SHORTENING)) + ").", "",
             "| program | from one command | the other launch modes |", "|---|---|---|"]
    for program in PROGRAMS:
        learn = " ".join(["python", program.key, "--world_size", str(program.world_size),
                          *program.flags])
        quick = "" if program.monarch else " ".join(
            ["python", program.key, "--world_size", str(program.quick_world_size),
             *program.quick])
        lines.append(f"| `{program.key}` | `{learn}` | {f'`{quick}`' if quick else '–'} |")
    lines.append("")
    return lines


# --------- Running one entry point in one mode --------------------

_running = set()  # the process groups of the runs under way, killed on Ctrl-C
_running_lock = threading.Lock()


_stopping = threading.Event()  # set on Ctrl-C: no run starts after it


class Stopped(Exception):
    """A run that was not started, or not finished, because Ctrl-C stopped the matrix."""


def _start(command, log, env):
    with _running_lock:
        if _stopping.is_set():
            raise Stopped
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                   cwd=ROOT, start_new_session=True, stdin=subprocess.DEVNULL)
        _running.add(process.pid)
    return process


def _stop_every_run():
    """Ctrl-C: start nothing more, and kill every run under way."""
    with _running_lock:
        _stopping.set()
        for pid in _running:
            _kill_group(pid)


def _kill_group(pid, grace=0.0):
    """Kill what is left of a process group after `grace` seconds (polled, as the tests'
    leftovers() does: a rank's helper processes end just after it); True when something was
    left."""
    deadline = time.monotonic() + grace
    while True:
        try:
            os.killpg(pid, 0)
        except (ProcessLookupError, PermissionError):  # gone (PermissionError: a zombie)
            return False
        if time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _last_line(path):
    lines = [line for line in Path(path).read_text(errors="replace").splitlines()
             if line.strip()]
    return lines[-1].strip() if lines else "(no output)"


def run_program(program, mode, python, env_vars, folder, torch_version=""):
    """Run `program` in `mode` with `python`; a result: ok, seconds, last_line, why (None
    when it ran and learned)."""
    summary = folder / "summary.json"
    # What it learns, from one command and in Monarch's way; the other modes start the same
    # program another way, and run it to the end at its smallest.
    learns = mode in ("spawn-all", "monarch")
    world = str(program.world_size if learns else program.quick_world_size)
    flags = [*(program.flags if learns else program.quick), "--summary_json", str(summary)]
    if program.key == "rpc_profiling/main.py":
        flags += ["--profile", str(folder / "traces")]
    script = str(program.script)
    port = str(free_port())
    if mode == "spawn-all":
        commands = [[python, script, "--world_size", world, *flags, "--master_port", port]]
    elif mode == "per-rank":
        commands = [[python, script, "--world_size", world, "--rank", str(rank), *flags,
                     "--master_port", port] for rank in range(int(world))]
    elif mode == "torchrun":
        commands = [[python, "-m", "torch.distributed.run", "--nproc_per_node", world,
                     "--master_port", port, script, *flags]]
    else:
        commands = [[python, script, "--world_size", world, *flags]]
    started = time.monotonic()
    logs = [folder / f"terminal{index}.log" for index in range(len(commands))]
    processes = []
    # The last rank first: start order must not matter.
    for index in reversed(range(len(commands))):
        with open(logs[index], "w") as log:
            processes.append((index, _start(commands[index], log, env_vars)))
    processes.sort()
    why = None
    for _, process in processes:
        left = RUN_SECONDS - (time.monotonic() - started)
        try:
            process.wait(timeout=max(left, 1))
        except subprocess.TimeoutExpired:
            why = why or f"did not finish within {RUN_SECONDS} s"
            _kill_group(process.pid)
            process.wait()
        if process.returncode != 0 and why is None:
            why = f"exit status {process.returncode}"
    seconds = time.monotonic() - started
    for _, process in processes:
        if _kill_group(process.pid, grace=10) and why is None:
            why = "left processes running"
        with _running_lock:
            _running.discard(process.pid)
    output = "".join(log.read_text(errors="replace") for log in logs)
    last_line = _last_line(logs[0])
    if program.refuses(torch_version):
        # refused by design: status 2 and its one line is what is expected
        # under torchrun, each rank says so and exits 2, and torchrun's agent exits 1
        refused = (why == "exit status 2" and "cannot run" in last_line) or (
            mode == "torchrun" and why == "exit status 1" and ": error: " in output
            and "cannot run" in output)
        return {"ok": None if refused else False, "seconds": round(seconds, 1),
                "last_line": last_line,
                "why": "refuses this torch, in one line" if refused else
                f"{why or 'ran'}, where it should refuse this torch in one line"}
    if why is None:
        if not summary.exists():
            why = "no summary written"
        else:
            try:
                figures = json.loads(summary.read_text())
                why = program.learned(figures, output) if learns else None
            except (KeyError, TypeError, ValueError) as error:
                why = f"its summary lacks a figure ({error!r})"
    return {"ok": why is None, "seconds": round(seconds, 1), "last_line": last_line, "why": why}


# --------- Environments: made, used, removed --------------------

def uv():
    """The uv command: beside this Python (make versions installs it into .venv), or on PATH."""
    beside = Path(sys.executable).with_name("uv")
    if beside.exists():
        return str(beside)
    found = shutil.which("uv")
    if found is None:
        sys.exit("make versions needs uv (pip install uv): it installs each environment")
    return found


def requirements(environment):
    """What an environment installs: requirements.txt, with the column's torch pinned."""
    pins = [f"torch=={environment.torch}"] if environment.torch else []
    return ["-r", str(ROOT / "requirements.txt"), *pins]


def installed_versions(python):
    """The versions of the packages that matter, as this environment's Python reports them."""
    code = ("import importlib.metadata as m, json, platform\n"
            "found = {'python': platform.python_version()}\n"
            "for name in ('torch', 'torchvision', 'gymnasium', 'numpy', 'torchmonarch'):\n"
            "    try: found[name] = m.version(name)\n"
            "    except m.PackageNotFoundError: found[name] = None\n"
            "print(json.dumps(found))")
    return json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True,
                                     check=True).stdout)


def make_environment(environment, folder, cache):
    """A virtual environment in `folder` with the column's packages; its Python's path. `cache`:
    uv's cache folder for it (None: uv's own, shared by every environment)."""
    uv_env = {**os.environ, **({"UV_CACHE_DIR": str(cache)} if cache else {})}
    subprocess.run([uv(), "venv", "--quiet", "--python", environment.python, str(folder)],
                   check=True, env=uv_env)
    python = str(folder / "bin" / "python")
    subprocess.run([uv(), "pip", "install", "--quiet", "--python", python,
                    *requirements(environment)], check=True, env=uv_env)
    return python


def resolve_only(environment):
    """For a Python this machine lacks: what requirements.txt resolves to for it (its markers
    evaluated), from the registry, as {name: version}."""
    with tempfile.TemporaryDirectory() as folder:
        wanted = Path(folder) / "requirements.in"  # uv pip compile takes one file, not -r
        wanted.write_text(f"-r {ROOT / 'requirements.txt'}\n" +
                          (f"torch=={environment.torch}\n" if environment.torch else ""))
        pins = subprocess.run([uv(), "pip", "compile", "--quiet", "--no-header",
                               "--python-version", environment.python_minor,
                               "--python-platform", "x86_64-manylinux_2_28", str(wanted)],
                              capture_output=True, text=True)
    if pins.returncode != 0:
        return {"error": _last_line_of(pins.stderr)}
    found = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", pins.stdout, re.M))
    return {name: found.get(name) for name in ("torch", "torchvision", "gymnasium", "numpy",
                                                 "torchmonarch")}


def _last_line_of(text):
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


# --------- The matrix --------------------

def _save(state, path):
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(state, indent=1, sort_keys=True) + "\n")
    temporary.replace(path)


def _minutes(seconds):
    seconds = int(seconds)
    return f"{seconds // 3600} h {seconds % 3600 // 60} min" if seconds >= 3600 else \
        f"{seconds // 60} min {seconds % 60} s"


class Progress:
    """The terminal's progress lines: which environment, which run, time so far, time left."""

    def __init__(self, total_runs, done_runs, environments_left):
        self.started = time.monotonic()
        self.total, self.done = total_runs, done_runs
        self.run_seconds = []
        self.environments_left = environments_left
        self.install_seconds = [25.0]

    def estimate(self, jobs):
        per_run = (sum(self.run_seconds) / len(self.run_seconds)) if self.run_seconds else 25.0
        installs = self.environments_left * (sum(self.install_seconds) /
                                             len(self.install_seconds))
        return (self.total - self.done) * per_run / jobs + installs

    def say(self, text, jobs):
        elapsed = time.monotonic() - self.started
        print(f"[{_minutes(elapsed)} so far, about {_minutes(self.estimate(jobs))} left] {text}",
              flush=True)


def run_matrix(args):
    state = json.loads(args.state.read_text()) if args.state.exists() and not args.again else {}
    state.setdefault("environments", {})
    if args.here:
        chosen = [Environment(args.label, "{}.{}".format(*sys.version_info[:2]), None,
                              sys.executable)]
    else:
        chosen = [e for e in environments(args.python)
                  if not args.env or any(e.label.startswith(p) for p in args.env)]
    programs = [p for p in PROGRAMS if not args.program or p.key in args.program]
    jobs = args.jobs

    def modes(program):
        return [mode for mode in program.modes if not args.mode or mode in args.mode]

    def pending(environment):
        recorded = state["environments"].get(environment.label, {}).get("runs", {})
        return [(p, m) for p in programs for m in modes(p) if f"{p.key} {m}" not in recorded]

    todo = {e.label: pending(e) for e in chosen if e.python}
    total = sum(len(runs) for runs in todo.values())
    done_before = sum(len(modes(p)) for e in chosen if e.python for p in programs) - total
    progress = Progress(total + done_before, done_before, sum(1 for r in todo.values() if r))
    matrix_started = time.monotonic()
    state["machine"] = machine()
    state["updated"] = datetime.date.today().isoformat()
    if not args.here and not args.env:
        state["planned"] = [environment.label for environment in chosen]
    try:
        for environment in chosen:
            record = state["environments"].setdefault(environment.label, {"runs": {}})
            record["python_minor"] = environment.python_minor
            if environment.python is None:
                record["missing_python"] = True
                record["resolved"] = resolve_only(environment)
                progress.say(f"{environment.label}: no such Python here; resolved only: "
                             f"{record['resolved']}", jobs)
                _save(state, args.state)
                continue
            if not todo[environment.label]:
                continue
            run_environment(environment, record, todo[environment.label], progress, args,
                            state)
            progress.environments_left -= 1
    except KeyboardInterrupt:
        _stop_every_run()
        state["seconds"] = state.get("seconds", 0) + time.monotonic() - matrix_started
        _save(state, args.state)
        print(f"\nStopped: {progress.done} of {progress.total} runs recorded in "
              f"{_shown(args.state)}; `make versions` again picks up here.",
              flush=True)
        return 130
    state["seconds"] = state.get("seconds", 0) + time.monotonic() - matrix_started
    _save(state, args.state)
    print(f"Done: {progress.done} runs in {_minutes(time.monotonic() - matrix_started)} "
          f"this time, {_minutes(state['seconds'])} in all.", flush=True)
    if args.state == STATE or args.output != REPORT:
        write_report(state, args.output, lent_machine(args))
    return 0


def _shown(path):
    """A path as a reader of the terminal wants it: from the checkout where it lies there."""
    path = Path(path).resolve()
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def lent_machine(args):
    """The runs recorded on a lent GPU machine (--lent), where they exist, for the report of a
    matrix (not for that of a --here run)."""
    if args.here or not args.lent or not args.lent.exists():
        return None
    return json.loads(args.lent.read_text())


def run_environment(environment, record, runs, progress, args, state):
    """Make the environment (unless --here), run its pending runs, remove it."""
    folder = Path(tempfile.mkdtemp(prefix="versions-", dir=args.scratch))
    try:
        if args.here:
            python = environment.python
        else:
            progress.say(f"{environment.label}: installing", args.jobs)
            started = time.monotonic()
            try:
                # A cache of its own, removed with it: uv's shared cache keeps every torch, and
                # twelve of them with their CUDA libraries took 45 GB here.
                cache = None if args.shared_cache else folder / "uv-cache"
                python = make_environment(environment, folder / "venv", cache)
            except subprocess.CalledProcessError as error:
                record["install_error"] = f"install failed (status {error.returncode})"
                progress.say(f"{environment.label}: {record['install_error']}", args.jobs)
                _save(state, args.state)
                return
            progress.install_seconds.append(time.monotonic() - started)
            record["install_seconds"] = round(time.monotonic() - started, 1)
        record["versions"] = installed_versions(python)
        record.setdefault("commits", [])
        if commit() not in record["commits"]:
            record["commits"].append(commit())
        # The examples run on the environment's packages alone: nothing of this checkout is on
        # their path but their own folder (a folder copied alone runs the same way).
        env_vars = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env_vars.pop("PYTHONPATH", None)
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env_vars.pop(name, None)
        monarch = record["versions"].get("torchmonarch") is not None

        def one(item):
            program, mode = item
            if program.monarch and not monarch:
                return program, mode, {"ok": None, "seconds": 0, "why": "torchmonarch is "
                                       "not installed (no wheel)", "last_line": ""}
            run_folder = Path(tempfile.mkdtemp(prefix="run-", dir=folder))
            # Each run's own short temporary folder: Monarch puts Unix sockets there.
            run_env = {**env_vars, "TMPDIR": str(run_folder)}
            try:
                return program, mode, run_program(program, mode, python, run_env, run_folder,
                                                  record["versions"].get("torch") or "")
            finally:
                shutil.rmtree(run_folder, ignore_errors=True)

        pool = ThreadPoolExecutor(max_workers=args.jobs)
        try:
            for program, mode, result in pool.map(one, runs):
                record["runs"][f"{program.key} {mode}"] = result
                progress.done += 1
                if result["seconds"]:
                    progress.run_seconds.append(result["seconds"])
                mark = {True: "ran", False: "FAILED", None: "does not apply"}[result["ok"]]
                detail = f": {result['why']}; last line: {result['last_line']}" \
                    if result["ok"] is False else ""
                progress.say(f"{environment.label} {progress.done}/{progress.total} "
                             f"{program.key} {mode}: {mark} ({result['seconds']:.0f} s)"
                             f"{detail}", args.jobs)
                _save(state, args.state)
        except (KeyboardInterrupt, Stopped):
            # The runs under way are killed first, so that the pool's threads end at once;
            # what they were running is not recorded, and runs again next time.
            _stop_every_run()
            pool.shutdown(wait=True, cancel_futures=True)
            raise KeyboardInterrupt from None
        pool.shutdown(wait=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def commit():
    """The checkout's commit (with "+" where files differ from it), which the runs ran. The
    results that this script writes as it goes (the state, the table) are not counted."""
    def git(*words):
        return subprocess.run(["git", *words], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip()
    written_here = [f":(exclude){path.relative_to(ROOT)}" for path in (STATE, LENT, REPORT)]
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", *written_here)
    return git("rev-parse", "--short", "HEAD") + ("+" if changed else "")


def machine():
    """This machine in words: the processor, its cores, the GPU where there is one."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = ""
    if shutil.which("nvidia-smi"):
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                               capture_output=True, text=True).stdout.split("\n")
        gpu = f", {names[0].strip()}" if names and names[0].strip() else ""
    return f"{platform.system()} {platform.machine()}, {model}, " \
           f"{len(os.sched_getaffinity(0))} cores{gpu}"


# --------- docs/versions.md --------------------

MARKS = {"ran": "✓", "partly": "✓·", "failed": "✗", "pending": "·", "none": "–"}


def cell_mark(record, program):
    """A cell's mark and its failing runs [(mode, result)]."""
    if record.get("missing_python"):
        return "none", []
    if record.get("install_error"):
        return "failed", [("install", {"why": record["install_error"], "last_line": ""})]
    results = [(mode, record["runs"].get(f"{program.key} {mode}")) for mode in program.modes]
    if all(result and result["ok"] is None for _, result in results):
        refused = [(mode, result) for mode, result in results if result["last_line"]]
        return "none", refused[:1]
    failing = [(mode, result) for mode, result in results if result and result["ok"] is False]
    if failing:
        return "failed", failing
    if any(result is None for _, result in results):
        learned = [result for mode, result in results if mode in ("spawn-all", "monarch")]
        return ("partly" if learned and learned[0] and learned[0]["ok"] else "pending"), []
    return "ran", []


def write_report(state, path=REPORT, lent=None):
    """The page: the matrix's table, its notes, then the lent GPU machine's column, if any."""
    # Every environment of the matrix, in its order, those not run yet too; then any other.
    planned = state.get("planned", [])
    labels = planned + [label for label in state["environments"] if label not in planned]
    columns = [(label, state["environments"].get(label, {"runs": {}})) for label in labels]
    commits = sorted({c for _, record in columns for c in record.get("commits", [])})
    torch_python = next((record["python_minor"] for label, record in columns
                         if label.startswith("torch ") and record.get("python_minor")), "?")
    lines = ["# Which program runs on which torch and Python", "",
             "Written by `make versions` (bench/versions.py). "
             f"Last run: {state.get('updated', '?')}, on {state.get('machine', '?')}. "
             f"It ran for {_minutes(state.get('seconds', 0))}, installs included. "
             f"Commits of this repository: {', '.join(commits) or '?'}.", "",
             "Each column is an environment of its own. A torch column is that minor's newest "
             f"patch, on Python {torch_python}. A Python column is that Python on the newest "
             "torch that has wheels for it.", "",
             "A cell is one program in one environment. It runs in every launch mode the "
             "program has: every rank from one command, a rank a terminal, and torchrun. The "
             "Monarch programs run their own way. Each run is a command that the program's "
             "README shows, made shorter by flags only (the commands are below).", "",
             "- ✓: every run exited 0 and left nothing running. The run from one command, or "
             "the Monarch program's run, also learned what its tests check at that size. The "
             "other runs are the program's smallest, and wrote their summary.",
             "- ✓·: the run from one command learned; the other launch modes have not run "
             "yet.",
             "- ✗ n: see note n below.",
             "- ·: not run yet.",
             "- –: does not apply: no wheel, or no such Python on this machine.",
             "- – n: the program refuses this torch by design, in one line (note n).", ""]
    notes = []
    lines += table(columns, notes)
    for label, record in columns:
        if record.get("missing_python"):
            resolved = record.get("resolved", {})
            lines.append(f"{label}: this machine has no such Python, so nothing ran. uv "
                         "resolved requirements.txt for it, its markers evaluated: "
                         + ", ".join(f"{name} {version or 'none'}"
                                     for name, version in resolved.items()) + ".")
            lines.append("")
    if lent:
        lent_columns = list(lent["environments"].items())
        lent_commits = sorted({c for _, record in lent_columns
                               for c in record.get("commits", [])})
        lines += ["## On a GPU machine", "",
                  f"The same runs on a lent machine ({lent.get('machine', '?')}), "
                  f"{lent.get('updated', '?')}, with the torch it has (a CUDA build): "
                  "`--here` installs nothing (a package the machine lacked travelled as a "
                  "wheel; the versions that ran are in bench/versions-gpu.json). Commits: "
                  f"{', '.join(lent_commits) or '?'}. These runs "
                  "use the CPU, as the READMEs' first commands do. The GPU paths are the `gpu` "
                  "tests (tests/test_gpu.py, `pytest -m gpu`). A – here means that the "
                  "machine did not have the package: torchmonarch was not installed there.", ""]
        lines += table(lent_columns, notes)
    lines += commands_section()
    if notes:
        lines += ["## The notes", ""]
        for number, (label, key, failing) in enumerate(notes, 1):
            for mode, result in failing:
                lines.append(f"{number}. `{key}`, {label}, {mode}: {result['why']}. Its "
                             f"last line: `{result['last_line']}`")
        lines.append("")
    path.write_text("\n".join(lines))
    print(f"Wrote {path}", flush=True)


def table(columns, notes):
    """The table's lines: programs down, columns across; each failing cell's note appended to
    notes, numbered on from those already there."""
    header = "| program | " + " | ".join(label for label, _ in columns) + " |"
    lines = [header, "|---" * (len(columns) + 1) + "|"]
    versions_row = []
    for _, record in columns:
        found = record.get("versions") or record.get("resolved") or {}
        versions_row.append(", ".join(f"{label} {found[name]}" for name, label in
                                      (("python", "Python"), ("torch", "torch"),
                                       ("torchvision", "vision"),
                                       ("torchmonarch", "Monarch")) if found.get(name))
                            or "·")
    lines.append("| (what it had) | " + " | ".join(versions_row) + " |")
    for program in PROGRAMS:
        cells = []
        for label, record in columns:
            mark, failing = cell_mark(record, program)
            if failing:
                notes.append((label, program.key, failing))
                cells.append(f"{MARKS[mark]} {len(notes)}")
            else:
                cells.append(MARKS[mark])
        lines.append(f"| `{program.key}` | " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--env", action="append",
                        help="run only the environments whose label starts with this "
                             "(\"torch 2.6\", \"Python 3.12\"); again for more")
    parser.add_argument("--program", action="append", choices=[p.key for p in PROGRAMS],
                        help="run only this entry point; again for more")
    parser.add_argument("--mode", action="append", choices=[*MODES, "monarch"],
                        help="run only this launch mode; again for more (the runs that learn "
                             "first: --mode spawn-all --mode monarch)")
    parser.add_argument("--python", default=sys.executable,
                        help="the Python of the torch columns (default: this one)")
    parser.add_argument("--jobs", type=int, default=2,
                        help="runs at a time (default: 2: ranks spend much of a run waiting)")
    parser.add_argument("--shared_cache", "--shared-cache", action="store_true",
                        help="install from uv's own cache, shared by every environment: faster "
                             "where a torch repeats, but it keeps every torch (45 GB here); by "
                             "default each environment has a cache of its own, removed with it")
    parser.add_argument("--again", action="store_true",
                        help="forget the recorded runs and start over")
    parser.add_argument("--here", action="store_true",
                        help="one environment: this Python as it is, nothing installed")
    parser.add_argument("--label", default="this Python",
                        help="--here's column label")
    parser.add_argument("--state", type=Path, default=STATE,
                        help=f"the recorded runs (default: {STATE.relative_to(ROOT)})")
    parser.add_argument("--scratch", type=Path, default=None,
                        help="where environments are made (default: the temporary folder)")
    parser.add_argument("--report", action="store_true",
                        help="write the table from the recorded runs, and run nothing")
    parser.add_argument("--lent", type=Path, default=LENT,
                        help="the runs recorded with --here on a lent GPU machine, given a "
                             f"section of their own in the table (default: {_shown(LENT)}, "
                             "where it exists)")
    parser.add_argument("--output", type=Path, default=REPORT,
                        help=f"where the table goes (default: {REPORT.relative_to(ROOT)})")
    args = parser.parse_args()
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    if args.report:
        write_report(json.loads(args.state.read_text()), args.output, lent_machine(args))
        return 0
    args.state.parent.mkdir(parents=True, exist_ok=True)
    # `kill` (SIGTERM) stops it as Ctrl-C does: what was recorded stays, for the next run.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    # Started in the background of a non-interactive shell (`make versions &`, nohup), this
    # process inherits SIGINT ignored: Python's own handler, so that Ctrl-C (or kill -INT) stops
    # it there too.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return run_matrix(args)
    except KeyboardInterrupt:  # while it was still listing the torch versions: nothing ran yet
        print("\nStopped before any run; nothing new was recorded.", flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
