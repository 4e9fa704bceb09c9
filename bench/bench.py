"""`make bench`: what RPC costs in these examples, as ratios measured side by side in one run.

Every comparison runs its variants in turn (A, B, C, A, B, C, ...), so that the noise of a busy
machine falls on all of them alike; each figure is the median of the repetitions, with min and
max. While an example trains, the CPU time of its threads is read from /proc and grouped by
thread name, which shows where the time goes. The RPC programs run plain, each rank with the
share of the cores that rpcrun would give it (OMP_NUM_THREADS). Writes bench/RESULTS-<N>-cores.md,
bench/ratios-<N>-cores.png and bench/SUPERVISOR-<N>-cores.md (what rpcrun costs: each command
plain and under rpcrun, in turn), N being this machine's cores, so that machines keep their own
files.

    python bench/bench.py               # three repetitions and the test suite
    python bench/bench.py --quick       # one repetition of shorter runs
    python bench/bench.py --supervisor  # only what rpcrun costs: SUPERVISOR-<N>-cores.md
    python bench/bench.py --solve       # rl_cartpole until solved, three ways: bench/SOLVE.md
"""

import argparse
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from ports import free_port
from rpc_roundtrip import SIZES

from rpc_harness import command as rpcrun_command  # what rpcrun reads of a command, and sets

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
PY = sys.executable
TICKS = os.sysconf("SC_CLK_TCK")
CORES = len(os.sched_getaffinity(0))
RESULTS, CHART = BENCH / f"RESULTS-{CORES}-cores.md", BENCH / f"ratios-{CORES}-cores.png"
PIPELINES = BENCH / f"PIPELINES-{CORES}-cores.md"
MONARCH_RESULTS = BENCH / f"MONARCH-{CORES}-cores.md"
SCALING_CHART = BENCH / f"scaling-{CORES}-cores.png"
# Every run here on the CPU, GPUs hidden: the examples and baselines would pick CUDA on their
# own, and the comparisons are of CPUs.
CPU_ONLY = {**os.environ, "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}


# --------- Running an example and reading its threads' CPU time --------------------

def _session_pids(session):
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:  # the process just ended
            continue
        if int(stat[stat.rindex(")") + 2:].split()[3]) == session:
            pids.append(pid)
    return pids


def _threads(pids):
    """{tid: (thread name, CPU ticks used so far)} of every thread of the processes `pids`."""
    threads = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:  # the process ended
            continue
        for tid in tids:
            try:
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            threads[tid] = (name, int(fields[11]) + int(fields[12]))  # utime + stime
    return threads


@dataclass
class Result:
    summary: dict
    cores_by_thread: Counter  # thread name -> cores busy on average while it trained
    output: str = ""  # what the example printed


def rpcrun_threads(cmd, env):
    """`env`, with OMP_NUM_THREADS where rpcrun would set it for `cmd`, a plain command of one of
    this tree's RPC programs: the cores divided by the ranks of this machine, unless `env` sets
    it (rpc_harness/command.py: what rpcrun reads of the command, and sets). A Monarch program
    (actors.py), another folder's program or Ray's: `env` as it is, as rpcrun never gave those
    a share of the cores."""
    script = Path(cmd[1])
    if script.parent.parent != ROOT or script.name == "actors.py" or script.parent == BENCH:
        return env
    command = rpcrun_command.parse([str(script), *map(str, cmd[2:])])
    share, _ = rpcrun_command.child_environment(command, env)
    if "OMP_NUM_THREADS" not in share:
        return env
    return {**env, "OMP_NUM_THREADS": share["OMP_NUM_THREADS"]}


def run_example(cmd, start, end, timeout=900, env=CPU_ONLY):
    """Run an example (its command may hold {port} and {summary}); return its --summary_json
    and the CPU its threads used between the first output line matching `start` and the first
    matching `end`. An RPC program runs plain, with the share of the cores that rpcrun would
    give its ranks (rpcrun_threads)."""
    env = rpcrun_threads(cmd, env)
    with tempfile.TemporaryDirectory() as tmp:
        summary, log = Path(tmp) / "summary.json", Path(tmp) / "output.log"
        cmd = [str(part).replace("{summary}", str(summary)).replace("{port}", str(free_port()))
               for part in cmd]
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True)
        first = last = None
        pids = []
        deadline = time.monotonic() + timeout
        while proc.poll() is None:
            if time.monotonic() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                raise RuntimeError(f"{' '.join(cmd)} took more than {timeout} s")
            output = log.read_text()
            if first is None and re.search(start, output, re.M):
                pids = pids or _session_pids(proc.pid)
                first = (time.monotonic(), _threads(pids))
            elif first is None:  # starting: find its processes now, as scanning /proc takes
                pids = _session_pids(proc.pid)  # too long once they keep the cores busy
            elif not re.search(end, output, re.M):
                last = (time.monotonic(), _threads(pids))
            time.sleep(0.2)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{log.read_text()[-3000:]}")
        cores = Counter()
        if first and last and last[0] > first[0]:
            seconds = last[0] - first[0]
            for tid, (name, ticks) in last[1].items():
                cores[name] += (ticks - first[1].get(tid, (name, 0))[1]) / TICKS / seconds
        return Result(json.loads(summary.read_text()), cores, log.read_text())


def example(name, *flags, script="main.py"):
    return [PY, ROOT / name / script, "--master_port", "{port}", "--summary_json",
            "{summary}", *flags]


def monarch_example(name, *flags):
    """The example's Monarch program (actors.py), which meets at no port."""
    return [PY, ROOT / name / "actors.py", "--summary_json", "{summary}", *flags]


# --------- Comparisons --------------------

@dataclass
class Variant:
    label: str
    cmd: list = None  # None: the single-process baseline, read from baselines.py's output
    rate: object = None  # summary -> rate
    window: tuple = ()  # (start, end) output patterns of the training, for the CPU profile
    detail: bool = False  # left out of --quick runs
    values: list = field(default_factory=list)
    cores: list = field(default_factory=list)
    memory: list = field(default_factory=list)  # each run's peak memory: {rank: {"rss": MB}}
    env: dict = None  # variables set for this variant's runs alone

    @property
    def median(self):
        return statistics.median(self.values)

    def median_cores(self):
        """Over the runs that were read twice while training (a short one can end between
        two readings): {thread name: cores}, empty if none was."""
        runs = [run for run in self.cores if run]
        names = {name for run in runs for name in run}
        return {name: statistics.median(run.get(name, 0.0) for run in runs) for name in names}


@dataclass
class Comparison:
    key: str  # the baseline's name in baselines.py
    title: str
    unit: str
    variants: list

    def ratios(self):
        base = self.variants[0].median
        return [(variant, variant.median / base) for variant in self.variants]

    def find(self, label):
        return next((variant for variant in self.variants if variant.label == label), None)


def example_with(folder, name, example_name, module, old, new):
    """A copy of the example's folder whose `module` has `new` where it has `old`, for a
    "before" or a lever's variant. Returns the copy's folder."""
    copy = Path(folder) / name
    shutil.copytree(ROOT / example_name, copy, ignore=shutil.ignore_patterns("__pycache__"))
    text = (copy / module).read_text()
    assert text.count(old) == 1, f"{example_name}/{module} no longer has {old.strip()}"
    (copy / module).write_text(text.replace(old, new))
    return copy


def ps_batches(quick):
    return 30 if quick else 60


PROFILED = "1 trainer, --profile (steps 3-5 of the trainer)"
# The plain command gives every rank torch's default threads: every core. rpcrun sets
# OMP_NUM_THREADS to the cores divided by the ranks of this machine, unless it is set; the RPC
# variants get that share as a user running them under rpcrun would (rpcrun_threads), these
# every core in every rank.
ALL_CORES = {"OMP_NUM_THREADS": str(CORES)}
ONE_ALL_CORES = f"1 trainer, every rank {CORES} threads (one environment for all)"
THREE_ALL_CORES = f"3 trainers, every rank {CORES} threads (one environment for all)"
# The Monarch programs (actors.py), beside the RPC ones.
MONARCH = "Monarch (actors.py)"
ONE_BATCH = "1 trainer, batch.py"
ONE_MONARCH = f"1 trainer, {MONARCH}"
THREE_MONARCH = f"3 trainers, {MONARCH}"
# The Monarch programs as they were before they were written around calls to whole meshes (the
# commit before: each trainer calls the server, and each observer the agent, as in the RPC
# programs), run from that commit's tree: the "before" of each lever.
MONARCH_BEFORE_COMMIT = "8365101"
ONE_MONARCH_BEFORE = "1 trainer, Monarch before: each trainer calls the server"
THREE_MONARCH_BEFORE = "3 trainers, Monarch before: each trainer calls the server"
MONARCH_BEFORE = "Monarch before: each observer calls the agent"
MONARCH_BEFORE_BATCH = "Monarch before, --batch: one forward pass, each observer calls"
# param_server/actors.py's first lever alone: one call to the trainers' mesh a model version,
# with the weights and gradients as tensors, which Monarch pickles through torch.save (a copy
# whose as_message() leaves out .numpy()).
ONE_MONARCH_MESH_TENSORS = "1 trainer, Monarch, one mesh call a version, tensors"
THREE_MONARCH_MESH_TENSORS = "3 trainers, Monarch, one mesh call a version, tensors"
# The messages of each program: a model version (param_server, T trainers) or an environment
# step (rl_cartpole, N observers), counted in the code; MONARCH-<cores>-cores.md shows them.
PS_RPCS = "T RPCs: each trainer's gradients in, a copy of the model out"
PS_CALLS = "T calls: each trainer's gradients in, a copy of the model out"
PS_MESH = "1 mesh call: the model pickled once, to T trainers; T gradients back"
MESSAGES = {
    ONE_BATCH: PS_RPCS,
    "3 trainers, batch.py": PS_RPCS,
    ONE_MONARCH_BEFORE: PS_CALLS,
    THREE_MONARCH_BEFORE: PS_CALLS,
    ONE_MONARCH_MESH_TENSORS: PS_MESH,
    THREE_MONARCH_MESH_TENSORS: PS_MESH,
    ONE_MONARCH: PS_MESH + ", as numpy",
    THREE_MONARCH: PS_MESH + ", as numpy",
    "tutorial mode": "2N RPCs: each observer asks for an action, and reports a reward",
    "batch.py": "N RPCs: each observer asks for an action",
    MONARCH_BEFORE: "N calls and N one-way: each observer asks for an action, and sends a reward",
    MONARCH_BEFORE_BATCH: "N calls: each observer asks for an action",
    MONARCH: "1 mesh call: the actions out to N observers; N states and rewards back",
}


# Ray Core's synchronous parameter server (bench/ray_param_server.py), where Ray is installed.
RAY = "Ray (its parameter-server example)"
ONE_RAY = f"1 trainer, {RAY}"
THREE_RAY = f"3 trainers, {RAY}"
# How each parameter-server program's rate grows with the trainers (the scaling chart): 1 and
# 3 on every machine, 7 and 15 where there are 16 cores or more.
SCALING_TRAINERS = (1, 3, 7, 15) if CORES >= 16 else (1, 3)


# The scaling chart's programs: (name, script or None for Ray, label of 1 trainer's variant,
# label of 3 trainers').
SCALING_PROGRAMS = [
    ("main.py (RPC, the tutorial's)", "main.py", "1 trainer", "3 trainers"),
    ("batch.py (RPC, batch updates)", "batch.py", ONE_BATCH, "3 trainers, batch.py"),
    ("actors.py (Monarch)", "actors.py", ONE_MONARCH, THREE_MONARCH),
    ("Ray's parameter server", None, ONE_RAY, THREE_RAY),
]


def scaling_label(program, trainers):
    """The variant of `program` (a SCALING_PROGRAMS entry) with `trainers` trainers."""
    name, _, one, three = program
    return {1: one, 3: three}.get(trainers, f"{trainers} trainers, {name}")


def scaling_variants(quick):
    """The parameter-server programs with more trainers than 3 (SCALING_TRAINERS), for the
    scaling chart: each trainer max(10, batches / trainers) batches."""
    samples = lambda s: s["samples_per_second"]  # noqa: E731
    window = (r"training batch 0 loss", r"^Training complete!")
    variants = []
    for trainers in SCALING_TRAINERS:
        if trainers in (1, 3):
            continue
        batches = max(10, ps_batches(quick) // trainers)
        flags = ("--world_size", trainers + 1, "--dataset", "synthetic", "--max_batches", batches)
        for program in SCALING_PROGRAMS:
            label = scaling_label(program, trainers)
            script = program[1]
            if script == "actors.py":
                variants.append(Variant(label, monarch_example("param_server", *flags), samples,
                                        window, detail=True))
            elif script:
                variants.append(Variant(label, example("param_server", *flags, script=script),
                                        samples, window, detail=True))
            elif ray_installed():
                variants.append(Variant(label, ray_example(trainers, batches), samples,
                                        RAY_WINDOW, detail=True))
    return variants


def ray_installed():
    import importlib.util

    return importlib.util.find_spec("ray") is not None


def monarch_installed():
    """Whether torchmonarch is installed for this Python. Its wheels are for Linux and Python
    3.10 to 3.13 (requirements.txt); elsewhere the bench leaves the Monarch programs out."""
    import importlib.util

    return importlib.util.find_spec("monarch") is not None


def runs_monarch(variant):
    """Whether the variant runs a Monarch program (an actors.py, this tree's or another's)."""
    return any(str(part).endswith("actors.py") for part in variant.cmd or ())


# The training's first and last lines in ray_param_server.py's output.
RAY_WINDOW = (r"^Ray: training", r"^Ray: trained")


def ray_example(trainers, batches):
    return [PY, BENCH / "ray_param_server.py", "--trainers", trainers, "--max_batches", batches,
            "--summary_json", "{summary}"]


def monarch_before(folder):
    """The tree of MONARCH_BEFORE_COMMIT (its param_server, rl_cartpole and rpc_harness), and
    the environment that runs its programs with its own harness. None where git cannot give
    it (a copy without the history)."""
    tree = Path(folder) / "monarch_before"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", ROOT, "archive", MONARCH_BEFORE_COMMIT,
                              "param_server", "rl_cartpole", "rpc_harness"],
                             capture_output=True, check=False)
    if archive.returncode != 0:
        return None, None
    subprocess.run(["tar", "-x", "-C", tree], input=archive.stdout, check=True)
    # Its harness first, then whatever the caller's PYTHONPATH holds (where Monarch may be).
    search_path = os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))
    return tree, {"PYTHONPATH": search_path}


def comparisons(quick, folder):
    short = 0.5 if quick else 1.0
    rl_episodes, rl_episodes_4 = round(40 * short), round(25 * short)
    samples = lambda s: s["samples_per_second"]  # noqa: E731
    steps = lambda s: s["steps_per_second"]  # noqa: E731
    rnn_rate = lambda s: s["iterations"] / s["train_seconds"]  # noqa: E731
    ddp_rate = lambda s: s["iterations_per_trainer"]["trainer0"] / s["train_seconds"]  # noqa: E731
    ps_window = (r"training batch 0 loss", r"^Training complete!")
    rl_window = (r"^Episode \d+\t", r"^(Stopped after|Solved!)")
    rnn_epochs = 2 if quick else 3
    rnn_window = (r"^Embedding table on ps", rf"^Training epoch {rnn_epochs - 1}$")
    ddp_epochs = 15 if quick else 30
    ddp_window = (r"^Training done for epoch 0$", r"^Dense layer")
    one_trainer = ("--world_size", 2, "--dataset", "synthetic",
                   "--max_batches", ps_batches(quick))
    three_trainers = ("--world_size", 4, "--dataset", "synthetic",
                      "--max_batches", ps_batches(quick) // 3)
    before_tree, before_env = monarch_before(folder)

    def before(name, *flags):
        return [PY, before_tree / name / "actors.py", "--summary_json", "{summary}", *flags]

    mesh_tensors = example_with(
        folder, "ps_mesh_tensors", "param_server", "actors.py",
        "    return parameters_to_vector(tensors).detach().cpu().numpy()\n",
        "    return parameters_to_vector(tensors).detach().cpu()\n") / "actors.py"

    def with_mesh_tensors(*flags):
        return [PY, mesh_tensors, "--summary_json", "{summary}", *flags]

    all_comparisons = [
        Comparison("param_server", "param_server: training throughput", "samples/s", [
            Variant("one process"),
            Variant("1 trainer", example("param_server", *one_trainer), samples, ps_window),
            Variant(ONE_ALL_CORES, example("param_server", *one_trainer), samples, ps_window,
                    env=ALL_CORES),
            Variant(PROFILED, example("param_server", *one_trainer, "--profile",
                                      Path(folder) / "profile"), samples, ps_window),
            Variant("3 trainers",
                    example("param_server", "--world_size", 4, "--dataset", "synthetic",
                            "--max_batches", ps_batches(quick) // 3), samples, ps_window),
            Variant(THREE_ALL_CORES,
                    example("param_server", "--world_size", 4, "--dataset", "synthetic",
                            "--max_batches", ps_batches(quick) // 3), samples, ps_window,
                    env=ALL_CORES),
            Variant("3 trainers, batch.py",
                    example("param_server", "--world_size", 4, "--dataset", "synthetic",
                            "--max_batches", ps_batches(quick) // 3, script="batch.py"), samples,
                    (r"training batch 0 loss", r"^Training complete!")),
            Variant(ONE_BATCH, example("param_server", *one_trainer, script="batch.py"),
                    samples, ps_window),
            Variant(ONE_MONARCH, monarch_example("param_server", *one_trainer), samples,
                    ps_window),
            Variant(THREE_MONARCH, monarch_example("param_server", *three_trainers), samples,
                    ps_window),
            *([Variant(ONE_MONARCH_BEFORE, before("param_server", *one_trainer), samples,
                       ps_window, env=before_env),
               Variant(THREE_MONARCH_BEFORE, before("param_server", *three_trainers), samples,
                       ps_window, env=before_env)] if before_tree else []),
            Variant(ONE_MONARCH_MESH_TENSORS, with_mesh_tensors(*one_trainer), samples,
                    ps_window),
            Variant(THREE_MONARCH_MESH_TENSORS, with_mesh_tensors(*three_trainers), samples,
                    ps_window),
            *([Variant(ONE_RAY, ray_example(1, ps_batches(quick)), samples, RAY_WINDOW),
               Variant(THREE_RAY, ray_example(3, ps_batches(quick) // 3), samples, RAY_WINDOW)]
              if ray_installed() else []),
            *scaling_variants(quick),
        ]),
        Comparison("rl_cartpole_1", "rl_cartpole, 1 observer: environment steps", "steps/s", [
            Variant("one process, 1 environment"),
            Variant("tutorial mode", example("rl_cartpole", "--max_episodes", rl_episodes),
                    steps, rl_window),
            Variant("batch.py", example("rl_cartpole", "--max_episodes", rl_episodes,
                                        script="batch.py"), steps, rl_window),
            Variant(MONARCH, monarch_example("rl_cartpole", "--max_episodes", rl_episodes),
                    steps, rl_window),
            *([Variant(MONARCH_BEFORE, before("rl_cartpole", "--max_episodes", rl_episodes),
                       steps, rl_window, env=before_env)] if before_tree else []),
        ]),
        Comparison("rl_cartpole_4", "rl_cartpole, 4 observers: environment steps", "steps/s", [
            Variant("one process, 4 environments"),
            Variant("tutorial mode",
                    example("rl_cartpole", "--world_size", 5, "--max_episodes", rl_episodes_4),
                    steps, rl_window),
            Variant("batch.py",
                    example("rl_cartpole", "--world_size", 5, "--max_episodes", rl_episodes_4,
                            script="batch.py"), steps, rl_window),
            Variant(MONARCH,
                    monarch_example("rl_cartpole", "--world_size", 5, "--max_episodes",
                                    rl_episodes_4), steps, rl_window),
            *([Variant(MONARCH_BEFORE, before("rl_cartpole", "--world_size", 5, "--max_episodes",
                                              rl_episodes_4), steps, rl_window, env=before_env),
               Variant(MONARCH_BEFORE_BATCH, before("rl_cartpole", "--batch", "--world_size", 5,
                                                    "--max_episodes", rl_episodes_4),
                       steps, rl_window, env=before_env)]
              if before_tree else []),
        ]),
        Comparison("rnn_model_parallel", "rnn_model_parallel: iterations", "it/s", [
            Variant("one process"),
            Variant("ps + trainer", example("rnn_model_parallel", "--epochs", rnn_epochs),
                    rnn_rate, rnn_window),
        ]),
        Comparison("ddp_rpc_hybrid", "ddp_rpc_hybrid: iterations per trainer", "it/s", [
            Variant("one process"),
            Variant("2 trainers under DDP, master, ps",
                    example("ddp_rpc_hybrid", "--epochs", ddp_epochs), ddp_rate, ddp_window),
        ]),
        pipeline_comparison(quick),
    ]
    for comparison in all_comparisons:
        comparison.variants = [v for v in comparison.variants if not (quick and v.detail)]
        if not monarch_installed():
            comparison.variants = [v for v in comparison.variants if not runs_monarch(v)]
    return all_comparisons


def pipeline_comparison(quick, title="pipeline_parallel: batches of 16 images of 64 x 64",
                        schedules=(("GPipe", (1, 2, 4)), ("1F1B", (2, 4)))):
    """main.py over RPC (num_split 1, 2, 4) beside pipelining.py's schedules (1F1B needs a
    micro-batch per stage), each setting a run of its own, for its peak memory."""
    flags = ("--batch_size", 16, "--num_batches", 5 if quick else 8)
    rpc_rate = lambda n: lambda s: 1 / s["splits"][str(n)]["seconds_per_batch"]  # noqa: E731
    stage_rate = lambda schedule, n: (  # noqa: E731
        lambda s: 1 / s["schedules"][schedule][str(n)]["seconds_per_batch"])
    return Comparison("pipeline_parallel", title, "batches/s", [Variant("one process")] + [
        Variant(f"RPC, num_split {n}", example("pipeline_parallel", "--num_split", n, *flags),
                rpc_rate(n), (r"^Processing batch 1$", r"^number of splits"))
        for n in (1, 2, 4)] + [
        Variant(f"pipelining, {schedule}, n_microbatches {n}",
                example("pipeline_parallel", "--schedule", schedule, "--num_split", n, *flags,
                        script="pipelining.py"),
                stage_rate(schedule, n), (r", batch 1: loss", r"^Summary:"))
        for schedule, counts in schedules for n in counts])


def baselines(names, quick, env):
    """The one-process rates of `names`, from one process, with its peak memory."""
    out = subprocess.run([PY, BENCH / "baselines.py", *names, "--scale", "0.5" if quick else "1"],
                         cwd=ROOT, env=env, capture_output=True, text=True, check=True,
                         timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(all_comparisons, repeats, quick, env=CPU_ONLY):
    for rep in range(repeats):
        print(f"== repetition {rep + 1} of {repeats}", flush=True)
        keys = [comparison.key for comparison in all_comparisons]
        others = [key for key in keys if key != "pipeline_parallel"]
        base = baselines(others, quick, env) if others else {}
        if "pipeline_parallel" in keys:  # alone, for its peak memory
            base.update(pipeline := baselines(["pipeline_parallel"], quick, env))
        for comparison in all_comparisons:
            for variant in comparison.variants:
                if variant.cmd is None:
                    variant.values.append(base[comparison.key])
                    if comparison.key == "pipeline_parallel":
                        variant.memory.append({"one process": pipeline["peak_memory_mb"]})
                    continue
                began = time.perf_counter()
                variant_env = {**env, **(variant.env or {})}
                result = run_example(variant.cmd, *variant.window, env=variant_env)
                variant.values.append(variant.rate(result.summary))
                variant.cores.append(result.cores_by_thread)
                variant.memory.append(result.summary["peak_memory_mb"])
                memory = sum(m["rss"] for m in variant.memory[-1].values())
                print(f"   {comparison.title}, {variant.label}: {variant.values[-1]:.1f} "
                      f"{comparison.unit}, peak memory {memory:.0f} MB in all "
                      f"({time.perf_counter() - began:.0f} s)", flush=True)


def measure_threads(repeats, quick):
    """param_server, 1 and 3 trainers: each rank its share of the cores (OMP_NUM_THREADS as
    rpcrun sets it: the cores divided by the ranks), against every rank with every core; into
    THREADS-<cores>-cores.md."""
    keep = ("one process", "1 trainer", ONE_ALL_CORES, "3 trainers", THREE_ALL_CORES)
    with tempfile.TemporaryDirectory() as folder:
        ps = next(c for c in comparisons(quick, folder) if c.key == "param_server")
        ps.variants = [variant for variant in ps.variants if variant.label in keep]
        measure([ps], repeats, quick)
    lines = ["# param_server: each rank its share of the cores, or every rank every core", "",
             f"Written by `python bench/bench.py --threads{' --quick' if quick else ''}` on "
             f"{time.strftime('%Y-%m-%d')}: {repeats} repetition(s), the variants in turn. "
             f"Machine: {machine()}. Each command plain; \"1 trainer\" and \"3 trainers\" with "
             "`OMP_NUM_THREADS` as rpcrun sets it (the cores divided by the ranks), the others "
             f"with `OMP_NUM_THREADS={CORES}`.", "",
             "| Variant | Median | Min | Max | Ratio to one process |", "|---|---|---|---|---|"]
    for variant, ratio in ps.ratios():
        lines.append(f"| {variant.label} | {variant.median:.0f} samples/s | "
                     f"{min(variant.values):.0f} | {max(variant.values):.0f} | {ratio:.2f} |")
    path = BENCH / f"THREADS-{CORES}-cores.md"
    path.write_text("\n".join(lines) + "\n")
    print(path.read_text())


def rpc_roundtrip(repeats):
    """{payload: {"rpc": [...], "tcp": [...], "monarch ipc": [...], ...}}: seconds a round trip
    (or, for Monarch's one-way sends and RDMABuffer reads, a message one way), one figure a
    repetition, from rpc_roundtrip.py and monarch_roundtrip.py."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "roundtrip.json"
        subprocess.run([PY, BENCH / "rpc_roundtrip.py", "--repeats", str(repeats), "--port",
                        str(free_port()), "--tcp_port", str(free_port()), "--out", str(out)],
                       env=CPU_ONLY, check=True, capture_output=True, timeout=600)
        results = json.loads(out.read_text())
        for transport in MONARCH_TRANSPORTS if monarch_installed() else ():
            subprocess.run([PY, BENCH / "monarch_roundtrip.py", "--repeats", str(repeats),
                            "--transport", transport, "--out", str(out)], env=CPU_ONLY,
                           check=True, capture_output=True, timeout=600)
            for size, times in json.loads(out.read_text()).items():
                results.setdefault(size, {}).update(times)
        return results


# Where torchmonarch is not installed: the bench runs everything else.
MONARCH_MISSING = ("`pip install torchmonarch` where it has wheels (Linux, Python 3.10 to 3.13); "
                   "without it, the bench runs every other program")

# Monarch's channels between processes that monarch_roundtrip.py measures: Unix sockets (its
# default on one host) and TCP.
MONARCH_TRANSPORTS = ("ipc", "tcp")


# (label, script, flags, runs): the default command several times, as runs of one seed drift
# apart (rl_cartpole/README.md, "Seeding").
SOLVES = [
    ("`python rl_cartpole/main.py`: tutorial mode, 1 observer", "main.py", (), 3),
    ("`python rl_cartpole/batch.py --world_size 5`: 4 observers, batched actions", "batch.py",
     ("--world_size", 5), 1),
    ("`python rl_cartpole/actors.py`: Monarch actors, 1 observer", "actors.py", (), 1),
]


def solve_runs():
    """Train rl_cartpole until solved, at the default seed, each way in SOLVES."""
    results = []
    for label, script, flags, runs in SOLVES:
        if script == "actors.py" and not monarch_installed():
            print(f"== rl_cartpole until solved, {label}: left out, {MONARCH_MISSING}",
                  flush=True)
            continue
        for run in range(runs):
            print(f"== rl_cartpole until solved, {label}, run {run + 1} of {runs}", flush=True)
            if script == "actors.py":
                cmd = monarch_example("rl_cartpole", *flags)
            else:
                cmd = example("rl_cartpole", *flags, script=script)
            result = run_example(cmd, r"^Episode \d+\t", r"^(Stopped after|Solved!)",
                                 timeout=1800)
            print("".join(result.output.splitlines(keepends=True)[-12:]), flush=True)
            results.append((label, result.summary))
    return results


def test_suite_seconds():
    """Wall seconds of the fast test suite, and its last line if it failed (else None); a
    failure is printed and written into the results, not raised, so the measurements stay."""
    started = time.perf_counter()
    done = subprocess.run([PY, "-m", "pytest", "-q", "-m", "not slow", "-p", "no:cacheprovider"],
                          cwd=ROOT, env=CPU_ONLY, capture_output=True, text=True, timeout=900)
    seconds = time.perf_counter() - started
    if done.returncode == 0:
        return seconds, None
    print(done.stdout[-5000:], done.stderr[-2000:], flush=True)
    return seconds, (done.stdout.strip().splitlines() or ["no output"])[-1]


# --------- Writing the results --------------------

THREADS = {
    "TP_SHM_reactor": "TensorPipe's shared-memory transport: one thread a process, polling "
                      "without pause",
    "TP_UV_loop": "TensorPipe's TCP transport: its event loop",
    "pt_thread_pool": "RPC's request threads: they run the called functions (forward passes, "
                      "`select_action`, ...) and the OpenMP threads those start",
    "PTThreadPool": "ATen's inter-op pool, where distributed autograd runs backward passes on "
                    "the callee, with its OpenMP threads",
    "python": "the processes' main threads (the training loops) and their OpenMP threads",
}


def machine(hidden="every run on the CPU"):
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")),
               platform.processor())
    gpus = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    return (f"{platform.system()} {platform.machine()}, {cpu}, {CORES} cores; "
            f"{gpus or 'no GPU'}{f' (hidden: {hidden})' if gpus else ''}; "
            f"Python {platform.python_version()}, torch {torch.__version__}")


def ms(rate, per=1):
    """Milliseconds that `per` units of work take at `rate` units a second."""
    return 1000 * per / rate


def write_results(all_comparisons, roundtrip, suite_seconds, repeats, seconds, quick):
    by_key = {comparison.key: comparison for comparison in all_comparisons}
    ps, rl1, rl4 = by_key["param_server"], by_key["rl_cartpole_1"], by_key["rl_cartpole_4"]
    rnn, ddp = by_key["rnn_model_parallel"], by_key["ddp_rpc_hybrid"]
    ps_local, ps_now = ps.variants[0], ps.find("1 trainer")
    ps_all_cores, ps_three_all_cores = ps.find(ONE_ALL_CORES), ps.find(THREE_ALL_CORES)
    rl4_tutorial, rl4_batch = rl4.find("tutorial mode"), rl4.find("batch.py")
    rnn_auto = rnn.find("ps + trainer")
    ddp_rpc = ddp.find("2 trainers under DDP, master, ps")
    ps_ratio = ps_now.median / ps_local.median
    batch_ratio = rl4_batch.median / rl4_tutorial.median
    rl1_ratio = rl1.find("batch.py").median / rl1.find("tutorial mode").median
    ps_three = ps.find("3 trainers").median / ps_now.median
    pp = by_key["pipeline_parallel"]
    pp_best = max((v for v in pp.variants if v.label.startswith("RPC, num_split")
                   and v.label != "RPC, num_split 1"), key=lambda variant: variant.median)
    pp_ratio = pp_best.median / pp.find("RPC, num_split 1").median

    lines = [
        "# Benchmark results", "",
        f"Written by `make bench{' QUICK=1' if quick else ''}` on {time.strftime('%Y-%m-%d')}: "
        f"{repeats} repetition(s), {seconds:.0f} s in all. Machine: {machine()}.", "",
        "Each figure is the median of the repetitions, with min and max; the variants of a "
        "measurement ran in turn, so that a noisy machine slows them alike. What is measured, "
        "how the overheads were profiled, and what was tried: [README.md](README.md). Solving "
        "CartPole: [SOLVE.md](SOLVE.md).", "",
        f"![Rates as fractions of one process]({CHART.name})", "",
        "## Side by side", "",
        "| Measurement | Variant | Median | Min | Max | Ratio to the first |",
        "|---|---|---|---|---|---|"]
    for comparison in all_comparisons:
        for variant, ratio in comparison.ratios():
            lines.append(f"| {comparison.title} | {variant.label} | {variant.median:.4g} "
                         f"{comparison.unit} | {min(variant.values):.4g} | "
                         f"{max(variant.values):.4g} | {ratio:.2f} |")
    lines += ["", "pipeline_parallel, setting by setting: RPC (`main.py`) beside "
              "`torch.distributed.pipelining` (`pipelining.py`), each setting a run of its own "
              "(medians; peak memory: resident, of each rank's process):", "", *pipeline_table(pp)]
    lines += ["", "RPC round trip: `rpc_sync` of a function that returns its tensor argument, "
              "against a ping-pong of the same bytes over a TCP connection between the same two "
              "processes (the floor):", "",
              "| Payload | TCP ping-pong | `rpc_sync` | Ratio |", "|---|---|---|---|"]
    for size in SIZES:
        times = roundtrip[size]
        tcp, rpc = statistics.median(times["tcp"]), statistics.median(times["rpc"])
        lines.append(f"| {size} | {tcp * 1e3:.3f} ms | {rpc * 1e3:.3f} ms | {rpc / tcp:.1f} |")
    if monarch_installed():
        lines += ["", "Monarch beside RPC (the actor programs, their round trip, their memory): "
                  f"[{MONARCH_RESULTS.name}]({MONARCH_RESULTS.name})."]
    else:
        lines += ["", f"torchmonarch was not installed here: no Monarch rows. {MONARCH_MISSING}"]
    if suite_seconds is not None:
        seconds, failed = suite_seconds
        lines += ["", f"Test suite, `pytest -m 'not slow'`: {seconds:.0f} s wall"
                      + (f"; it FAILED: {failed}" if failed else ".")]

    lines += [
        "", "## Targets", "",
        "Those set for many cores (16), with the figures of `make bench` of 2026-11-22 (commit "
        "d5dd70a) as the floor on 2 cores:", "",
        "| Target | Measured | |", "|---|---|---|",
        f"| param_server, 1 trainer, at least 0.6 of one process (2 cores: no less than 0.74) "
        f"| {ps_ratio:.2f} | {'met' if ps_ratio >= (0.74 if CORES <= 2 else 0.6) else 'not met'} |",
        f"| param_server, 3 trainers at least 1.5 times 1 trainer's samples/s (2 cores: no "
        f"less than 0.67 / 0.74 = 0.91) | {ps_three:.2f} | "
        f"{'met' if ps_three >= (0.91 if CORES <= 2 else 1.5) else 'not met'} |",
        f"| rl_cartpole, 4 observers, batch.py at least 2 times tutorial mode (2 cores: no "
        f"less than 2.34) | {batch_ratio:.2f} | "
        f"{'met' if batch_ratio >= (2.34 if CORES <= 2 else 2) else 'not met'} |",
        f"| rl_cartpole, 1 observer, batch.py no slower than tutorial mode | {rl1_ratio:.2f} | "
        f"{'met' if rl1_ratio >= 1 else 'not met'} |",
        f"| pipeline_parallel, the best `num_split` ({pp_best.label}) at least 1.3 times "
        f"`num_split 1` (on 16 cores) | {pp_ratio:.2f} | "
        f"{('met' if pp_ratio >= 1.3 else 'not met') if CORES >= 16 else '16 cores only'} |",
        "", "## Threads: each rank its share, or every core in every rank", "",
        "The plain command starts every rank with torch's default threads, every core; under "
        "rpcrun each rank gets `OMP_NUM_THREADS` = the cores divided by the ranks of this "
        "machine. The RPC rows above ran with that share, as under rpcrun (the variable set as "
        "rpcrun sets it, the command itself plain); the rows \"every rank N threads\" with "
        f"`OMP_NUM_THREADS={CORES}`. param_server: 1 trainer {ps_now.median:.0f} samples/s "
        f"with shares, {ps_all_cores.median:.0f} with all cores everywhere "
        f"({ps_now.median / ps_all_cores.median:.2f} times); 3 trainers "
        f"{ps.find('3 trainers').median:.0f} against {ps_three_all_cores.median:.0f} "
        f"({ps.find('3 trainers').median / ps_three_all_cores.median:.2f} times). What rpcrun "
        f"itself costs: [{SUPERVISOR_RESULTS.name}]({SUPERVISOR_RESULTS.name}).",
        "", "## --profile", "",
        f"param_server, 1 trainer, {ps_batches(quick)} batches: with `--profile` "
        f"{ps.find(PROFILED).median:.0f} samples/s, {ps.find(PROFILED).median / ps_now.median:.2f}"
        " of the same run without it (the trainer's steps 3-5 recorded and its trace written "
        "inside the timed training; the server records every call, and writes its trace after "
        "its `rpc.shutdown()`). Without `--profile` each rank's profiler is an object whose "
        "`step()` and `stop()` do nothing.",
        "", "## Where the time goes", "",
        f"CPU used while the example trained, in cores ({CORES:.2f}: all {CORES} cores of this "
        "machine busy all the time), by thread name, summed over the example's processes "
        "(medians of the repetitions); threads under 0.02 left out:", ""]
    for comparison in all_comparisons:
        for variant in comparison.variants[1:]:
            cores = sorted(variant.median_cores().items(), key=lambda item: -item[1])
            shown = ", ".join(f"`{name}` {value:.2f}" for name, value in cores if value >= 0.02)
            total = sum(value for _, value in cores)
            lines.append(f"- {comparison.title}, {variant.label}: {total:.2f}: {shown}" if cores
                         else f"- {comparison.title}, {variant.label}: not read (each run's "
                              "training ended between two readings)")
    lines += ["", "Thread names:", ""]
    lines += [f"- `{name}`: {text}" for name, text in THREADS.items()]

    lines += [
        "", "## What RPC costs, example by example", "",
        f"- **param_server.** A batch of 32 takes {ms(ps_local.median, 32):.1f} ms in one "
        f"process and {ms(ps_now.median, 32):.1f} ms with one trainer: "
        f"{ms(ps_now.median, 32) - ms(ps_local.median, 32):.1f} ms more, for three round trips "
        "(the forward pass, which carries 100 KB of images, the distributed backward pass, the "
        "optimizer step) and the server's work in RPC's threads. The arithmetic is the same and "
        "all on the server, so three trainers add little: one keeps its cores busy.",
        f"- **rl_cartpole.** One process steps CartPole {rl1.variants[0].median:.0f} times a "
        f"second, the tutorial's agent and one observer {rl1.find('tutorial mode').median:.0f}: "
        "each step is two nested `rpc_sync` calls from the observer to the agent, and the "
        "policy is so small that the calls, not the arithmetic, set the pace. batch.py makes "
        "it one call a step, and one forward pass for all observers: with four observers "
        f"{rl4_batch.median:.0f} steps a second against {rl4_tutorial.median:.0f} "
        f"({batch_ratio:.1f} times). Five processes share {CORES} cores; where their CPU goes: "
        "above, under \"Where the time goes\".",
        f"- **rnn_model_parallel.** An iteration takes {ms(rnn.variants[0].median):.2f} ms in "
        f"one process and {ms(rnn_auto.median):.2f} ms over RPC: two round trips to ps (the "
        "embedding lookup, the decoder), the distributed backward pass through both, and the "
        "optimizer step on both workers, for a model of 2 and 3 units: all latency.",
        f"- **ddp_rpc_hybrid.** An iteration takes {ms(ddp.variants[0].median):.2f} ms in one "
        f"process and {ms(ddp_rpc.median):.2f} ms on each of two trainers: the lookup on ps, "
        "the distributed backward pass to ps, the optimizer step there, and DDP's allreduce "
        "of the dense layer's gradients over Gloo, all for tensors of a few hundred floats.",
    ]
    RESULTS.write_text("\n".join(lines) + "\n")


def pipeline_table(comparison):
    """Seconds a batch (median, min-max), the ratio to one process, each rank's peak memory."""
    lines = ["| Setting | Seconds a batch | Ratio to one process | Cores busy | Peak memory of "
             "each rank, MB |", "|---|---|---|---|---|"]
    for variant, ratio in comparison.ratios():
        ranks = {}
        for run in variant.memory:
            for rank, memory in run.items():
                ranks.setdefault(rank, []).append(memory)
        shown = ", ".join(f"{rank} {statistics.median(m['rss'] for m in runs):.0f}" + (
            f" (GPU {statistics.median(m['cuda'] for m in runs):.0f})" if "cuda" in runs[0]
            else "") for rank, runs in ranks.items())
        cores = sum(variant.median_cores().values())
        lines.append(f"| {variant.label} | {1 / variant.median:.3f} ({1 / max(variant.values):.3f}"
                     f"-{1 / min(variant.values):.3f}) | {ratio:.2f} | "
                     f"{f'{cores:.2f}' if cores else ''} | {shown} |")
    return lines


def measure_pipelines(repeats, quick):
    """--pipelines: the pipeline comparison alone, on the CPU and, where CUDA is, on the GPU."""
    started = time.perf_counter()
    cpu = pipeline_comparison(quick)
    measure([cpu], repeats, quick)
    lines = ["# pipeline_parallel: RPC against torch.distributed.pipelining", "",
             f"Written by `python bench/bench.py --pipelines` on {time.strftime('%Y-%m-%d')}: "
             f"{repeats} repetition(s). Machine: {machine('in the CPU runs')}. What is measured: "
             "[README.md](README.md); the programs: "
             "[pipeline_parallel/README.md](../pipeline_parallel/README.md).", "",
             "## On the CPU", "", *pipeline_table(cpu)]
    PIPELINES.write_text("\n".join(lines) + "\n")
    if torch.cuda.is_available():
        two = torch.cuda.device_count() >= 2  # pipelining.py: NCCL with a GPU for each stage
        gpu = pipeline_comparison(quick, schedules=(("GPipe", (1, 2, 4)), ("1F1B", (2, 4)))
                                  if two else ())
        measure([gpu], repeats, quick, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        lines += ["", "## On the GPU", "", "The same settings with the GPU visible: one process "
                  "and RPC's shards on it (both shards on `cuda:0` where there is one GPU)"
                  + ("; pipelining.py's stages on `cuda:0` and `cuda:1` over NCCL." if two else
                     "; pipelining.py not, as NCCL needs a GPU for each stage and this machine "
                     "has one."), "", *pipeline_table(gpu)]
    lines += ["", f"{time.perf_counter() - started:.0f} s in all."]
    PIPELINES.write_text("\n".join(lines) + "\n")
    print(PIPELINES.read_text())


# --------- What rpcrun costs: the plain command against the same under rpcrun -----------

SUPERVISOR_RESULTS = BENCH / f"SUPERVISOR-{CORES}-cores.md"
PLAIN, SUPERVISED = "plain", "rpcrun"
# The bound: a supervised run within 2% of the plain run's time.
SUPERVISOR_BOUND = 0.02


@dataclass
class Twin:
    """One command of an example, run plain (`python SCRIPT ARGS`) and under rpcrun (`python -m
    rpc_harness SCRIPT ARGS`) in turn, with the same environment: OMP_NUM_THREADS set in both as
    rpcrun would set it, so that only the supervisor differs."""

    label: str
    script: Path
    flags: tuple
    rate: object  # summary -> the training rate
    unit: str
    ranks: int = 0  # 0: every rank from one command; N: N commands (--rank 0..N-1), at once
    runs: dict = field(default_factory=lambda: {PLAIN: [], SUPERVISED: []})  # each run's figures

    def commands(self, mode, summary):
        """The terminals' commands of one run: one, or one a rank (rank 0's first)."""
        port = free_port()
        flags = [*map(str, self.flags), "--master_port", str(port), "--summary_json", summary]
        front = [PY, "-m", "rpc_harness"] if mode == SUPERVISED else [PY]
        if not self.ranks:
            return [[*front, str(self.script), *flags]]
        if mode == SUPERVISED:  # where the supervisors meet: a free port, not --master_port - 100
            front = [*front, "--port", str(free_port())]
        return [[*front, str(self.script), *flags, "--rank", str(rank)]
                for rank in range(self.ranks)]


def supervisor_twins(quick):
    short = 0.5 if quick else 1.0
    episodes = round(40 * short)
    samples = lambda s: s["samples_per_second"]  # noqa: E731
    steps = lambda s: s["steps_per_second"]  # noqa: E731
    return [
        Twin("param_server/main.py, 1 trainer, every rank from one command",
             ROOT / "param_server" / "main.py",
             ("--world_size", 2, "--dataset", "synthetic", "--max_batches", ps_batches(quick)),
             samples, "samples/s"),
        Twin("rl_cartpole/main.py, 1 observer, every rank from one command",
             ROOT / "rl_cartpole" / "main.py", ("--world_size", 2, "--max_episodes", episodes),
             steps, "steps/s"),
        Twin("rl_cartpole/main.py, 1 observer, a rank a terminal (`--rank 0`, `--rank 1`)",
             ROOT / "rl_cartpole" / "main.py", ("--world_size", 2, "--max_episodes", episodes),
             steps, "steps/s", ranks=2),
    ]


def _cpu_seconds(pid):
    """CPU seconds that process `pid` has used itself (its threads, not its children), or None
    where it has ended."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def run_terminals(commands, env, timeout=900):
    """Start `commands` at once, each in a session of its own with its output to a file, as in
    terminals of their own; wait for every one. Returns (seconds from the first start to the
    last end, CPU seconds that the commands' first processes used, as last read while they ran:
    under rpcrun, the supervisors' own)."""
    with tempfile.TemporaryDirectory() as tmp:
        logs = [Path(tmp) / f"terminal{i}.log" for i in range(len(commands))]
        procs = []
        started = time.perf_counter()
        try:
            for cmd, log in zip(commands, logs, strict=True):
                with open(log, "w") as out:
                    procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=out,
                                                  stderr=subprocess.STDOUT, env=env,
                                                  start_new_session=True))
            cpu = {}
            while any(proc.poll() is None for proc in procs):
                if time.perf_counter() - started > timeout:
                    raise RuntimeError(f"{' '.join(commands[0])} took more than {timeout} s")
                for proc in procs:
                    seconds = _cpu_seconds(proc.pid) if proc.returncode is None else None
                    cpu[proc.pid] = seconds if seconds is not None else cpu.get(proc.pid, 0.0)
                time.sleep(0.05)
            seconds = time.perf_counter() - started
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        failed = [(cmd, log) for cmd, log, proc in zip(commands, logs, procs, strict=True)
                  if proc.returncode != 0]
        if failed:
            cmd, log = failed[0]
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{log.read_text()[-3000:]}")
        return seconds, sum(cpu.values())


def measure_supervisor_cost(twins, repeats, env=CPU_ONLY):
    """Each twin plain and under rpcrun, the twins in turn, `repeats` times: plain first in the
    odd repetitions, rpcrun first in the even ones, so that a machine whose speed drifts (a
    load that comes or goes, a cloud machine's CPU credit) favours neither."""
    for rep in range(repeats):
        print(f"== rpcrun's cost: repetition {rep + 1} of {repeats}", flush=True)
        for twin in twins:
            same = rpcrun_threads([PY, twin.script, *map(str, twin.flags)], env)
            for mode in (PLAIN, SUPERVISED)[::1 if rep % 2 == 0 else -1]:
                with tempfile.TemporaryDirectory() as tmp:
                    summary = Path(tmp) / "summary.json"
                    seconds, cpu = run_terminals(twin.commands(mode, str(summary)), same)
                    figures = json.loads(summary.read_text())
                twin.runs[mode].append({"rate": twin.rate(figures),
                                        "wall": figures["wall_seconds"], "seconds": seconds,
                                        "cpu": cpu})
                print(f"   {twin.label}, {mode}: {twin.runs[mode][-1]['rate']:.1f} {twin.unit}, "
                      f"{figures['wall_seconds']:.1f} s in the summary, {seconds:.1f} s by the "
                      "clock", flush=True)


def _spread(values, digits):
    return (f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-"
            f"{max(values):.{digits}f})")


def supervisor_rows(twin):
    """The table's rows of one twin: each figure plain and supervised, the ratio of the
    medians, the ratios run by run (each supervised run to the plain run of its repetition),
    and whether the medians are within SUPERVISOR_BOUND."""
    rows = []
    for key, name, higher_is_better in (("rate", f"training rate, {twin.unit}", True),
                                        ("wall", "wall seconds in the summary", False),
                                        ("seconds", "the command's seconds, by the clock", False)):
        plain = [run[key] for run in twin.runs[PLAIN]]
        supervised = [run[key] for run in twin.runs[SUPERVISED]]
        paired = [s / p for s, p in zip(supervised, plain, strict=True)]
        ratio = statistics.median(supervised) / statistics.median(plain)
        cost = 1 / ratio - 1 if higher_is_better else ratio - 1
        digits = 0 if key == "rate" else 1
        rows.append(f"| {twin.label} | {name} | {_spread(plain, digits)} | "
                    f"{_spread(supervised, digits)} | {ratio:.3f} | {_spread(paired, 3)} | "
                    f"{'yes' if cost <= SUPERVISOR_BOUND else 'no'} ({cost:+.1%}) |")
    return rows


def supervisor_cpu(twin):
    """The median CPU seconds of the supervisors' own processes in a supervised run."""
    return statistics.median(run["cpu"] for run in twin.runs[SUPERVISED])


def write_supervisor(twins, repeats, seconds, quick, loads, alone):
    """SUPERVISOR-<cores>-cores.md: what rpcrun costs, each command plain and supervised."""
    command = (f"python bench/bench.py --supervisor{' --quick' if quick else ''}" if alone
               else f"make bench{' QUICK=1' if quick else ''}")
    before, after = (", ".join(f"{load:.2f}" for load in pair) for pair in loads)
    lines = ["# What rpcrun costs: the plain command against the same under rpcrun", "",
             f"Written by `{command}` on {time.strftime('%Y-%m-%d')}: {repeats} repetition(s), "
             f"{seconds:.0f} s in all. Machine: {machine()}. Load averages (1, 5, 15 minutes) "
             f"before: {before}; after: {after}.", "",
             "Each command ran plain (`python SCRIPT ARGS`) and under the supervisor "
             "(`python -m rpc_harness SCRIPT ARGS`, which `rpcrun` is), the commands in turn "
             "(plain first in odd repetitions, rpcrun first in even ones), with the same "
             "environment: `OMP_NUM_THREADS` set in both as rpcrun sets it (the "
             "cores divided by the ranks), so that only the supervisor differs. What rpcrun "
             "sets besides (TensorPipe and Gloo on the loopback interface, torch's C++ log "
             "level, each rank's output on a pty) it sets as it does for a user. A rank a "
             "terminal: both commands started at once; under rpcrun, rank 1's supervisor "
             "meets rank 0's first and starts its command once admitted. Figures: the "
             "training rate and the wall seconds that rank 0 writes in its `--summary_json` "
             "(from its command's start to its summary), and the seconds from starting the "
             "commands to the end of the last one, by this script's clock (rpcrun's own start "
             "and end included). Ratios: rpcrun's figure over the plain one's, of the medians, "
             "and run by run (each supervised run against the plain run of its repetition). "
             f"Within {SUPERVISOR_BOUND:.0%}: the medians' cost (a lower rate, more "
             "seconds) is no more than that.", "",
             "| Command | Figure | Plain: median (min-max) | Under rpcrun: median (min-max) | "
             "Ratio of the medians | Ratio run by run: median (min-max) | Within 2%? |",
             "|---|---|---|---|---|---|---|"]
    for twin in twins:
        lines += supervisor_rows(twin)
    lines += ["", "CPU that the supervisors used themselves (rpcrun's own process, every "
              "terminal's together, not its command's), medians of the runs: " + "; ".join(
                  f"{twin.label}: {supervisor_cpu(twin):.2f} s in a run of "
                  f"{statistics.median(run['seconds'] for run in twin.runs[SUPERVISED]):.1f} s"
                  for twin in twins) + "."]
    SUPERVISOR_RESULTS.write_text("\n".join(lines) + "\n")


def measure_supervisor(repeats, quick, alone=True):
    """--supervisor: only what rpcrun costs, into SUPERVISOR-<cores>-cores.md."""
    started = time.perf_counter()
    load_before = os.getloadavg()
    twins = supervisor_twins(quick)
    measure_supervisor_cost(twins, repeats)
    write_supervisor(twins, repeats, time.perf_counter() - started, quick,
                     (load_before, os.getloadavg()), alone)
    print(SUPERVISOR_RESULTS.read_text())


# --------- Monarch beside RPC --------------------

# (comparison, variants, the RPC program that the Monarch and Ray rows mirror): what
# MONARCH-<cores>-cores.md shows.
MONARCH_TABLES = [
    ("param_server", ("one process", "1 trainer", ONE_BATCH, ONE_MONARCH_BEFORE,
                      ONE_MONARCH_MESH_TENSORS, ONE_MONARCH, ONE_RAY), ONE_BATCH),
    ("param_server", ("one process", "3 trainers", "3 trainers, batch.py", THREE_MONARCH_BEFORE,
                      THREE_MONARCH_MESH_TENSORS, THREE_MONARCH, THREE_RAY),
     "3 trainers, batch.py"),
    ("rl_cartpole_1", ("one process, 1 environment", "tutorial mode", "batch.py",
                       MONARCH_BEFORE, MONARCH), "tutorial mode"),
    ("rl_cartpole_4", ("one process, 4 environments", "tutorial mode", "batch.py",
                       MONARCH_BEFORE, MONARCH_BEFORE_BATCH, MONARCH), "batch.py"),
]


def monarch_comparisons(quick, folder):
    """The comparisons that MONARCH_TABLES shows, with only its variants (--monarch)."""
    keep = {(key, label) for key, labels, _ in MONARCH_TABLES for label in labels}
    scaling = {scaling_label(program, trainers) for program in SCALING_PROGRAMS
               for trainers in SCALING_TRAINERS}
    chosen = []
    for comparison in comparisons(quick, folder):
        comparison.variants = [v for v in comparison.variants
                               if (comparison.key, v.label) in keep or v.label in scaling]
        if comparison.variants:
            chosen.append(comparison)
    return chosen


def memory_of(variant):
    """"name MB, name MB, ...; in all MB": the median peak resident memory of each process
    over the runs, and their sum."""
    by_process = {}
    for run in variant.memory:
        for process, memory in run.items():
            by_process.setdefault(process, []).append(memory["rss"])
    medians = {process: statistics.median(values) for process, values in by_process.items()}
    shown = ", ".join(f"{process} {megabytes:.0f}" for process, megabytes in medians.items())
    return f"{shown}; in all {sum(medians.values()):.0f}"


def write_monarch(all_comparisons, roundtrip, repeats, seconds, quick, alone=False):
    """MONARCH-<cores>-cores.md: the Monarch programs (and Ray's parameter server) beside the
    RPC ones, from one run; and the scaling chart."""
    by_key = {comparison.key: comparison for comparison in all_comparisons}
    command = (f"python bench/bench.py --monarch{' --quick' if quick else ''}" if alone
               else f"make bench{' QUICK=1' if quick else ''}")
    lines = ["# Monarch actors and Ray beside RPC", "",
             f"Written by `{command}` on {time.strftime('%Y-%m-%d')}: {repeats} repetition(s), "
             f"the variants in turn, {seconds:.0f} s in all. Machine: {machine()}. torchmonarch "
             f"{_version('torchmonarch')}"
             f"{ray_version()}.",
             "",
             "Each rate is the median of the repetitions (min-max); the first ratio is to the same "
             "work in one process, the second to the RPC program that the row's program mirrors "
             "(named in each table's title). Peak memory: resident, of each process (MB, "
             "medians); the RPC programs' command, which only starts and waits for the ranks, is "
             "not counted; the Monarch programs' controller is, as it holds the parameter server "
             "or the agent; Ray's processes are not measured. What each row runs: "
             "[README.md](README.md#monarch-and-ray-beside-rpc).", ""]
    for key, labels, mirrored in MONARCH_TABLES:
        comparison = by_key[key]
        title = comparison.title if key != "param_server" else (
            f"param_server, {labels[1]}: training throughput")
        per = "a model version, T trainers" if key == "param_server" else "a step, N observers"
        lines += [f"## {title}", "",
                  f"| Program | {comparison.unit} | Ratio to one process | Ratio to "
                  f"{mirrored.split(', ')[-1]} | Messages ({per}) | Peak memory, MB |",
                  "|---|---|---|---|---|---|"]
        base = comparison.find(labels[0]).median
        rpc = comparison.find(mirrored).median
        for label in labels:
            variant = comparison.find(label)
            if variant is None or not variant.values:  # Ray not installed, or no git history
                continue
            memory = memory_of(variant) if variant.memory else ""
            versus = f"{variant.median / rpc:.2f}" if label in labels[3:] else ""
            lines.append(f"| {label} | {variant.median:.0f} ({min(variant.values):.0f}-"
                         f"{max(variant.values):.0f}) | {variant.median / base:.2f} | {versus} | "
                         f"{MESSAGES.get(label, '')} | {memory} |")
        lines.append("")
    lines += scaling_section(by_key["param_server"])
    lines += ["## Moving a tensor", "",
              "Between two processes of this machine, each figure in ms: a round trip (the tensor "
              "goes and comes back) for the TCP ping-pong of the same bytes (the floor, "
              "bench/rpc_roundtrip.py), `rpc_sync` of a function that returns its argument, and "
              "a Monarch endpoint that does the same (`call_one(...).get()`); one way for a "
              "Monarch one-way send (`broadcast`, many in a row) and a read of an `RDMABuffer` "
              "over its TCP fallback (no RDMA hardware here). Monarch over each of its channels: "
              "Unix sockets (ipc, its default on one host) and TCP (bench/monarch_roundtrip.py). "
              "MB/s: the 5 MB payload's bytes moved a second (both ways for a round trip).", "",
              "| Way | " + " | ".join(SIZES) + " | MB/s at 5 MB |",
              "|---|" + "---|" * (len(SIZES) + 1)]
    ways = [("TCP ping-pong (round trip)", "tcp", 2), ("`rpc_sync` (round trip)", "rpc", 2)]
    for transport in MONARCH_TRANSPORTS:
        ways += [(f"Monarch {transport}: `call_one` (round trip)", f"monarch {transport}", 2),
                 (f"Monarch {transport}: `call_one` of a numpy array (round trip)",
                  f"monarch {transport} numpy", 2),
                 (f"Monarch {transport}: `broadcast` (one way)", f"monarch {transport} one-way",
                  1),
                 (f"Monarch {transport}: `RDMABuffer.read_into` (one way)",
                  f"monarch {transport} RDMABuffer", 1)]
    for name, key, directions in ways:
        cells = [f"{statistics.median(roundtrip[size][key]) * 1e3:.3f}" for size in SIZES]
        five = statistics.median(roundtrip["5 MB"][key])
        lines.append(f"| {name} | " + " | ".join(cells) +
                     f" | {directions * 5 * 1024 * 1024 / five / 1e6:.0f} |")
    rpc_call = statistics.median(roundtrip["tiny"]["rpc"])
    lines += ["", "A CartPole step's messages, no work in them, ms a step: main.py's two "
              f"`rpc_sync` round trips (tiny payload, above): {2 * rpc_call * 1e3:.3f}; "
              f"batch.py's one: {rpc_call * 1e3:.3f}. rl_cartpole/actors.py before, an actor's "
              "awaited `call_one` and a `broadcast` to an actor in another process: " + "; ".join(
                  f"{transport} {step_ms(roundtrip, transport, 'step'):.3f}"
                  for transport in MONARCH_TRANSPORTS) + ". Now, an actor's awaited `call` to "
              "a mesh of one actor in another process: " + "; ".join(
                  f"{transport} {step_ms(roundtrip, transport, 'mesh step'):.3f}"
                  for transport in MONARCH_TRANSPORTS) + "."]
    MONARCH_RESULTS.write_text("\n".join(lines) + "\n")
    write_scaling_chart(by_key["param_server"])


def step_ms(roundtrip, transport, kind):
    """Milliseconds of a CartPole step's Monarch messages (monarch_roundtrip.py's Stepper):
    kind "step" (before) or "mesh step" (now)."""
    return statistics.median(roundtrip["step"][f"monarch {transport} {kind}"]) * 1e3


def scaling_section(ps):
    """The scaling table: each parameter-server program's samples/s by number of trainers."""
    lines = ["## param_server: samples/s as the trainers grow", "",
             f"Each program with {', '.join(map(str, SCALING_TRAINERS))} trainers (more than 3: "
             f"max(10, {ps_batches(False)} / trainers) batches each), beside one process "
             f"({ps.variants[0].median:.0f} samples/s). Chart: [{SCALING_CHART.name}]"
             f"({SCALING_CHART.name}).", "",
             "| Program | " + " | ".join(f"{n} trainer{'s' * (n > 1)}" for n in SCALING_TRAINERS)
             + " |", "|---|" + "---|" * len(SCALING_TRAINERS)]
    for program in SCALING_PROGRAMS:
        cells = []
        for trainers in SCALING_TRAINERS:
            variant = ps.find(scaling_label(program, trainers))
            cells.append(f"{variant.median:.0f}" if variant and variant.values else "")
        if any(cells):
            lines.append(f"| {program[0]} | " + " | ".join(cells) + " |")
    return lines + [""]


def write_scaling_chart(ps):
    """bench/scaling-<cores>-cores.png: samples/s against trainers, a line a program."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for program in SCALING_PROGRAMS:
        points = [(trainers, variant.median) for trainers in SCALING_TRAINERS
                  if (variant := ps.find(scaling_label(program, trainers))) and variant.values]
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=program[0])
    ax.axhline(ps.variants[0].median, color="black", linewidth=0.8, linestyle="--",
               label="one process")
    ax.set_xticks(SCALING_TRAINERS)
    ax.set_xlabel("trainers")
    ax.set_ylabel("samples/s")
    ax.set_ylim(bottom=0)
    ax.set_title(f"param_server: synchronous training as the trainers grow ({CORES} cores)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(SCALING_CHART, dpi=100)


def ray_version():
    """", ray <version>" where Ray is installed, else nothing."""
    return f", ray {_version('ray')}" if ray_installed() else ""


def _version(package):
    from importlib.metadata import version

    return version(package)


def measure_monarch(repeats, quick):
    """--monarch: only the comparisons of the Monarch programs with the RPC ones, and the round
    trips: MONARCH-<cores>-cores.md."""
    started = time.perf_counter()
    print("== round trips", flush=True)
    roundtrip = rpc_roundtrip(repeats=3 if quick else 5)
    with tempfile.TemporaryDirectory() as folder:
        chosen = monarch_comparisons(quick, folder)
        measure(chosen, repeats, quick)
    write_monarch(chosen, roundtrip, repeats, time.perf_counter() - started, quick, alone=True)
    print(MONARCH_RESULTS.read_text())


def write_solves(solves):
    lines = ["# Solving CartPole", "",
             f"Written by `make bench SOLVE=1` on {time.strftime('%Y-%m-%d')}. Machine: "
             f"{machine()}. rl_cartpole at the default seed, until the running reward passes 475 "
             "(or 2000 episodes), one run after the other:", "",
             "| Command | Solved | Episodes | Environment steps | Training | Wall | Steps/s |",
             "|---|---|---|---|---|---|---|"]
    for label, s in solves:
        lines.append(f"| {label} | {'yes' if s['solved'] else 'no'} | {s['episodes']} | "
                     f"{s['env_steps']} | {s['training_seconds']:.0f} s | "
                     f"{s['wall_seconds']:.0f} s | {s['steps_per_second']:.0f} |")
    lines += ["", "The episodes to solve vary from run to run even at one seed: runs drift apart "
              "after some tens of episodes. The agent's forward passes run on whichever RPC "
              "thread takes the request, so the backward pass adds up the gradients in an order "
              "that varies. The weights then differ in their last bits, and in time an action "
              "comes out differently."]
    (BENCH / "SOLVE.md").write_text("\n".join(lines) + "\n")


def write_chart(all_comparisons):
    """One bar per variant: its rate as a fraction of the same work in one process."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [(f"{c.title.split(':')[0]}: {variant.label}", ratio) for c in all_comparisons
            for variant, ratio in c.ratios()[1:]]
    fig, ax = plt.subplots(figsize=(10, 0.4 * len(bars) + 1.4))
    ax.barh([label for label, _ in bars][::-1], [ratio for _, ratio in bars][::-1])
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("rate as a fraction of the same work in one process")
    ax.set_title(f"RPC against one process ({CORES} cores, torch {torch.__version__})")
    fig.tight_layout()
    fig.savefig(CHART, dpi=100)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="one repetition of shorter runs, and no test suite")
    parser.add_argument("--pipelines", action="store_true",
                        help="only pipeline_parallel's RPC and pipelining settings, on the CPU "
                             "and the GPU if any: bench/PIPELINES-<cores>-cores.md")
    parser.add_argument("--threads", action="store_true",
                        help="only param_server with each rank's share of the cores against "
                             "every rank with every core: bench/THREADS-<cores>-cores.md")
    parser.add_argument("--monarch", action="store_true",
                        help="only the Monarch programs beside the RPC ones, and the round "
                             "trips: bench/MONARCH-<cores>-cores.md")
    parser.add_argument("--supervisor", action="store_true",
                        help="only what rpcrun costs: param_server and rl_cartpole, each plain "
                             "and under rpcrun in turn: bench/SUPERVISOR-<cores>-cores.md "
                             "(6 minutes on 2 quiet cores; --quick: 1 repetition, 2 minutes)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="repetitions (default: 3; 1 with --quick)")
    parser.add_argument("--solve", action="store_true",
                        help="only train rl_cartpole until solved, three ways, and write "
                             "SOLVE.md (17 minutes here; more when a run needs many episodes)")
    args = parser.parse_args()
    if args.solve:
        write_solves(solve_runs())
        print((BENCH / "SOLVE.md").read_text())
        return
    repeats = args.repeats or (1 if args.quick else 3)
    if args.pipelines:
        return measure_pipelines(repeats, args.quick)
    if args.threads:
        return measure_threads(repeats, args.quick)
    if args.monarch and not monarch_installed():
        parser.error(f"--monarch needs torchmonarch: {MONARCH_MISSING}")
    if args.monarch:
        return measure_monarch(repeats, args.quick)
    if args.supervisor:
        return measure_supervisor(repeats, args.quick)
    started = time.perf_counter()
    print("== RPC round trip", flush=True)
    roundtrip = rpc_roundtrip(repeats=3 if args.quick else 5)
    with tempfile.TemporaryDirectory() as folder:
        all_comparisons = comparisons(args.quick, folder)
        measure(all_comparisons, repeats, args.quick)
    measure_supervisor(repeats, args.quick, alone=False)
    suite = None
    if not args.quick:
        print("== the test suite", flush=True)
        suite = test_suite_seconds()
    seconds = time.perf_counter() - started
    write_results(all_comparisons, roundtrip, suite, repeats, seconds, args.quick)
    if monarch_installed():
        write_monarch(all_comparisons, roundtrip, repeats, seconds, args.quick)
    else:
        print(f"== {MONARCH_RESULTS.name} left as it was: {MONARCH_MISSING}", flush=True)
    write_chart(all_comparisons)
    print(RESULTS.read_text())


if __name__ == "__main__":
    main()
