"""What main.py adds beside the recipe, small enough to read and to delete: the command line
(the recipe has none) and its checks, --profile (every rank profiles itself, as today's torch
no longer shows the callee's operators in the caller's profile), and the run's summary."""

import argparse
import datetime
import json
import os
import resource
import socket
import sys
import tempfile
import threading
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

# init_rpc uses its agent's Gloo process group through an API that torch itself deprecated
# since 2.0, and warns so in every rank: nothing that the recipe's code can change.
warnings.filterwarnings("ignore", message=r".*as a ProcessGroup\. This usage is deprecated")

# Every line of every rank written whole, in one write, as soon as it is printed: the ranks
# share one terminal or file, and where Python writes a line's text and its newline apart
# (PYTHONUNBUFFERED=1), another rank's line can fall between them. A terminal shows lines so
# already; a file or pipe now does too.
if hasattr(sys.stdout, "reconfigure"):
    sys.stdout.reconfigure(line_buffering=True, write_through=False)


# --------- The command line --------------------

def at_least(low):
    """An argparse type: a whole number of at least `low`."""
    def number(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, got {text}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    return number


def port(text):
    """An argparse type: a TCP port."""
    value = at_least(1)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port from 1 to 65535, got {value}")
    return value


def parse_args(argv=None):
    """The flags, checked: bad input ends the command here, in one line with status 2."""
    parser = argparse.ArgumentParser(
        description="The recipe: worker0 sends worker1 two operators and a function under the "
                    "profiler. With --profile DIR, every rank also profiles itself.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)

    def error(message):  # one line: argparse's usage lines left out (--help shows them)
        parser.exit(2, f"{parser.prog}: error: {message}\n")

    parser.error = error
    parser.add_argument("--world_size", "--world-size", type=at_least(2), default=2,
                        metavar="N", help="number of ranks: worker0 sends the RPCs, worker1 "
                                          "runs them, any others only join")
    parser.add_argument("--rank", type=at_least(0), default=None, metavar="R",
                        help="run only this rank (start the others in other terminals); "
                             "without it, every rank starts here, or torchrun's RANK")
    parser.add_argument("--master_addr", "--master-addr", default="localhost", metavar="ADDR",
                        help="worker0's address, where the ranks meet (trusted networks only)")
    parser.add_argument("--master_port", "--master-port", type=port, default=29500,
                        metavar="PORT", help="worker0's port, where the ranks meet")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="every rank profiles itself into DIR/<its name>.json (made if "
                             "missing), and the recipe's trace goes to DIR/trace.json; rpcrun "
                             "merges the ranks' traces into DIR/timeline.json")
    parser.add_argument("--seed", type=at_least(0), default=1, metavar="N",
                        help="random seed of every rank")
    parser.add_argument("--summary_json", "--summary-json", default=None, metavar="PATH",
                        help="worker0 writes the run's figures to this JSON file at the end")
    args = parser.parse_args(argv)
    check_args(parser, args)
    return args


def check_args(parser, args):
    """What argparse cannot check, before any rank starts; torchrun's rank and world."""
    args.started = time.time()  # the summary's wall seconds count from here
    args.torchrun = args.rank is None and "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if args.torchrun:  # run the one rank that torchrun started this process for
        for name in ("RANK", "WORLD_SIZE"):
            if not os.environ[name].isdigit():
                parser.error(f"torchrun's {name} is {os.environ[name]}, not a number")
        args.rank, args.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if args.world_size < 2:
            parser.error(f"torchrun started {args.world_size} process: the recipe needs 2 "
                         "(--nproc_per_node 2)")
        args.master_addr = os.environ.get("MASTER_ADDR", args.master_addr)
        args.master_port = int(os.environ.get("MASTER_PORT", args.master_port))
    if args.rank is not None and args.rank >= args.world_size:
        parser.error(f"argument --rank: {args.rank} is outside a world of {args.world_size} "
                     f"(ranks 0 to {args.world_size - 1})")
    if not args.torchrun and args.rank in (None, 0):  # this command hosts worker0, and its port
        try:
            family = socket.getaddrinfo(args.master_addr, args.master_port)[0][0]
        except (OSError, UnicodeError):
            parser.error(f"argument --master_addr: no such host, {args.master_addr}")
        try:
            socket.create_server((args.master_addr, args.master_port), family=family).close()
        except OSError as err:
            reason = os.strerror(err.errno) if err.errno else err
            parser.error(f"cannot listen on {args.master_addr}:{args.master_port} ({reason}): "
                         "choose another --master_port")
    if args.profile:
        try:
            os.makedirs(args.profile, exist_ok=True)
            tempfile.TemporaryFile(dir=args.profile).close()
        except OSError as err:
            parser.error(f"argument --profile: cannot write in {args.profile} "
                         f"({err.strerror or err})")
    if args.summary_json and args.rank in (None, 0):  # worker0 writes it
        folder = os.path.dirname(os.path.abspath(args.summary_json))
        if os.path.isdir(args.summary_json):
            parser.error(f"argument --summary_json: {args.summary_json} is a folder")
        if not os.path.isdir(folder):
            parser.error(f"argument --summary_json: no such folder, {folder}")
        try:
            tempfile.TemporaryFile(dir=folder).close()
        except OSError as err:
            parser.error(f"argument --summary_json: cannot write in {folder} "
                         f"({err.strerror or err})")


# --------- --profile: every rank profiles itself --------------------
#
# worker1 records from the end of its init_rpc until worker0 has sent it the recipe's RPCs
# again, this time under worker0's own profiler; then each writes its trace. worker0 first
# asks whether worker1's profiler runs, and at the end tells it to stop.

# Whether this torch's profiler records every thread, and so the RPCs that worker1 runs on
# TensorPipe's threads (torch 2.4 records only the thread that started it).
try:
    torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    ALL_THREADS = True
except TypeError:
    ALL_THREADS = False

decided = threading.Event()  # set on a rank other than 0 once it knows whether it profiles
profiling = threading.Event()  # set once its profiler runs
worker0_done = threading.Event()  # set by worker0 when it has sent its RPCs


def profiler(rank):
    """torch.profiler, of every thread where this torch can, with the rank in its trace."""
    options = {"activities": [torch.profiler.ProfilerActivity.CPU]}
    if ALL_THREADS:
        options["experimental_config"] = torch._C._profiler._ExperimentalConfig(
            profile_all_threads=True)
    prof = torch.profiler.profile(**options)
    prof.preset_metadata_json("rank", json.dumps(rank))
    return prof


def write_trace(prof, args, name):
    """DIR/<name>.json, written whole; the line that says so, and its top operators."""
    path = os.path.join(args.profile, f"{name}.json")
    part = os.path.join(args.profile, f".{name}.json")
    prof.export_chrome_trace(part)
    os.replace(part, path)
    with open(path) as file:
        events = json.load(file)["traceEvents"]
    operators = sum(1 for event in events
                    if event.get("ph") == "X" and event.get("name", "").startswith("aten::"))
    line = f"{name}: profiled, wrote {path} ({os.path.getsize(path) // 1024} kB)"
    if not ALL_THREADS:
        line += (f"; torch {torch.__version__} records only the thread that started the "
                 "profiler, not the threads where RPCs run")
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=6)
    # one print: the ranks share the terminal, and a table in pieces would mix with another's
    print(f"{line}\n{name}: top operators (self CPU time)\n{table}", flush=True)
    return {"trace_bytes": os.path.getsize(path), "operators": operators}


def profiler_started():
    """Asked by worker0: whether this rank's profiler runs."""
    decided.wait()
    return profiling.is_set()


def stop():
    """Called by worker0 when it has sent its RPCs."""
    worker0_done.set()


def profile_every_rank(args, worker_name, dst_worker_name, t1, t2, udf_with_ops):
    """worker0, after the recipe: with --profile, the same RPCs again under torch.profiler,
    each inside a span named as the recipe's table row; then the other ranks may stop."""
    others = [f"worker{rank}" for rank in range(1, args.world_size)]
    if args.profile:
        with profiler(0) as prof:
            for other in others:  # their profilers must run before the RPCs reach them
                rpc.rpc_sync(other, profiler_started)
            print("--profile: the same RPCs again, under torch.profiler in every rank; "
                  "worker0 wraps each in a span named as the recipe's table row", flush=True)
            with torch.profiler.record_function(
                    f"rpc_async#aten::add({worker_name} -> {dst_worker_name})"):
                rpc.rpc_async(dst_worker_name, torch.add, args=(t1, t2)).wait()
            with torch.profiler.record_function(
                    f"rpc_async#aten::mul({worker_name} -> {dst_worker_name})"):
                rpc.rpc_async(dst_worker_name, torch.mul, args=(t1, t2)).wait()
            with torch.profiler.record_function(
                    f"rpc_async#udf_with_ops({worker_name} -> {dst_worker_name})"):
                rpc.rpc_async(dst_worker_name, udf_with_ops).wait()
        report(worker_name, write_trace(prof, args, worker_name))
    for other in others:
        rpc.rpc_sync(other, stop)


def profile_until_worker0_is_done(args, rank, worker_name):
    """A rank other than 0: with --profile, record until worker0 has sent its RPCs, write the
    trace, and send worker0 its figures."""
    if not args.profile:
        decided.set()
        return
    with profiler(rank) as prof:
        profiling.set()
        decided.set()
        worker0_done.wait()
    figures = write_trace(prof, args, worker_name)
    rpc.rpc_sync("worker0", report, args=(worker_name, {**figures, "rss": peak_rss_mb()}))


# --------- The summary --------------------

recipe = {}  # worker0's: what the recipe's profiles hold
ranks = {}  # worker0's: each rank's figures, the others' sent by rpc_sync before rpc.shutdown


def report(name, figures):
    """On worker0: a rank's figures for the summary."""
    ranks.setdefault(name, {}).update(figures)


def peak_rss_mb():
    """This process's most resident memory so far, in MB (ru_maxrss: kB on Linux, bytes on
    macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss // (2**20 if sys.platform == "darwin" else 2**10)


def say_what_the_recipes_profiles_hold(prof, p, dst_worker_name):
    """The recipe's tables once listed the callee's operators (Node ID 1); say what they hold
    on this torch."""
    events = list(prof.function_events) + list(p.function_events)
    remote = [event for event in events if getattr(event, "node_id", -1) not in (-1, 0)]
    recipe.update(events=len(events), remote_events=len(remote))
    print(f"The recipe's two profiles hold {len(events)} events, {len(remote)} of them run on "
          f"{dst_worker_name} (torch {torch.__version__}: the profiler records the caller only; "
          "torch 1.6, the recipe's, showed the callee's operators as remote_op rows).",
          flush=True)


def summary(args, rank):
    """worker0's last line, after its rpc.shutdown(), and --summary_json."""
    if rank != 0:
        return
    report("worker0", {"rss": peak_rss_mb()})
    figures = {
        "example": "rpc_profiling", "torch": torch.__version__, "world_size": args.world_size,
        "all_threads": ALL_THREADS, "recipe_events": recipe["events"],
        "recipe_remote_events": recipe["remote_events"],
        "worker1_operators": ranks.get("worker1", {}).get("operators"),
        "trace_bytes": {name: got["trace_bytes"] for name, got in sorted(ranks.items())
                        if "trace_bytes" in got},
        "peak_memory_mb": {name: {"rss": got["rss"]} for name, got in sorted(ranks.items())},
        "wall_seconds": round(time.time() - args.started, 3),
    }
    line = (f"the recipe's profiles: {figures['recipe_events']} events, "
            f"{figures['recipe_remote_events']} of worker1")
    if figures["worker1_operators"] is not None:
        line += f"; worker1's own profile: {figures['worker1_operators']} operators"
    print(f"Summary: {line}; {figures['wall_seconds']:.1f} s in all", flush=True)
    if args.summary_json:
        try:
            with open(args.summary_json, "w") as file:
                file.write(json.dumps(figures, indent=2) + "\n")
        except OSError as err:
            print(f"--summary_json {args.summary_json}: not written ({err.strerror or err}); "
                  "the Summary line has the run's figures", flush=True)
            sys.exit(1)


# --------- ours: torch's store, kept until every rank is past rpc.shutdown() --------------------

def hold_store(args, rank, port=None):
    """torch's graceful rpc.shutdown() ends with a barrier on the store where the ranks met, in
    rank 0's process, after which each rank reads a count there once more. Rank 0 may be first
    past it and end, closing the store under a rank still reading it: that rank's
    rpc.shutdown() fails ("Connection reset by peer", seen on a busy machine). So every rank
    opens the store once more before rpc.shutdown() (rank 0's shares its server, as torch's
    multi-tenant stores of one port do), and rank 0 keeps it until every rank says it is past
    rpc.shutdown() (release_store). Under torchrun, its agent holds the store: nothing to do."""
    if getattr(args, "torchrun", False):
        return None
    return dist.TCPStore(args.master_addr, int(port or args.master_port), is_master=rank == 0,
                         multi_tenant=True, timeout=datetime.timedelta(seconds=60))


def release_store(args, rank, store):
    """After rpc.shutdown(): say so in the store; rank 0 waits until every rank has (60 s at
    most), before its store closes."""
    if store is None:
        return
    if store.add("ranks past rpc.shutdown", 1) == args.world_size:
        store.set("every rank past rpc.shutdown", "")
    if rank == 0:
        store.wait(["every rank past rpc.shutdown"])
