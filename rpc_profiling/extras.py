"""What rpc_profiling's main.py adds beside the recipe: every rank profiled, one timeline of
them all, the ranks' names and the command line (the recipe has none). main.py imports it, so
that it shows the recipe's code."""

import json
import os
import socket
import threading
import time

import torch
import torch.distributed.rpc as rpc

import rpc_harness  # this project's package: `make run` installs it (or `pip install -e .`)
from rpc_harness import profiling
from rpc_harness.compat import profiler_options

# --------- Every rank profiled, one timeline --------------------
#
# worker0 waits until every other rank's profiler runs, sends worker1 the recipe's RPCs again
# under a profiler of its own, and tells the others to stop; each writes its trace and reports
# it (rpc_harness.report), so that worker0 can merge them at the end even when the ranks run on
# machines that share no folder.

PROFILER_OPTIONS, ALL_THREADS = profiler_options()
profiler_running = threading.Event()  # set on a rank other than 0 while its profiler runs
stop_profiling = threading.Event()  # set by worker0 when it is done


def say_what_the_recipes_profiles_hold(prof, p, dst_worker_name):
    """The recipe's tables list the callee's operators (Node ID 1); say what they hold here."""
    events = list(prof.function_events) + list(p.function_events)
    remote = [event for event in events if getattr(event, "node_id", -1) not in (-1, 0)]
    print(f"The recipe's two profiles hold {len(events)} events, {len(remote)} of them run on "
          f"{dst_worker_name} (torch {torch.__version__}: the profiler records the caller only; "
          "torch 1.6, the recipe's, showed the callee's operators as remote_op rows).")
    return {"events": len(events), "remote_events": len(remote)}


def wait_until_profiling(seconds):
    if not profiler_running.wait(seconds):
        raise RuntimeError(f"{rpc.get_worker_info().name}'s profiler did not start")


def stop():
    stop_profiling.set()


def profile_every_rank(worker_name, dst_worker_name, t1, t2, world_size, args, udf_with_ops):
    others = [f"worker{rank}" for rank in range(1, world_size)]
    for other in others:
        rpc.rpc_sync(other, wait_until_profiling, args=(args.rpc_timeout,))
    print(f"Now every rank profiles itself{'' if ALL_THREADS else ' (main thread only)'}: "
          f"the same RPCs again, each inside a span named as the recipe's table row")
    with torch.profiler.profile(**PROFILER_OPTIONS) as prof:
        with torch.profiler.record_function(f"rpc_async#aten::add({worker_name} -> "
                                            f"{dst_worker_name})"):
            fut1 = rpc.rpc_async(dst_worker_name, torch.add, args=(t1, t2))
            fut1.wait()
        with torch.profiler.record_function(f"rpc_async#aten::mul({worker_name} -> "
                                            f"{dst_worker_name})"):
            fut2 = rpc.rpc_async(dst_worker_name, torch.mul, args=(t1, t2))
            fut2.wait()
        with torch.profiler.record_function(f"rpc_async#udf_with_ops({worker_name} -> "
                                            f"{dst_worker_name})"):
            rpc.rpc_async(dst_worker_name, udf_with_ops).wait()
    for other in others:
        rpc.rpc_sync(other, stop)
    finish_profile(prof, worker_name, args)
    rpc_harness.report(clocks={other: clock_offset(other) for other in others})


def profile_until_worker0_is_done(worker_name, args):
    with torch.profiler.profile(**PROFILER_OPTIONS) as prof:
        profiler_running.set()
        stop_profiling.wait(args.rpc_timeout)
    finish_profile(prof, worker_name, args)


def clock():
    return socket.gethostname(), time.time_ns()


def clock_offset(other):
    """How far this rank's clock is ahead of other's, in ns (0 on one machine: one clock), and
    how far off that may be: half the best of five round trips."""
    samples = []
    for _ in range(5):
        before = time.time_ns()
        host, theirs = rpc.rpc_sync(other, clock)
        after = time.time_ns()
        samples.append((after - before, (before + after) // 2 - theirs))
    if host == socket.gethostname():
        return 0, 0
    round_trip, offset = min(samples)
    return offset, max(1, round_trip // 2)


def finish_profile(prof, worker_name, args):
    """Write this rank's trace, print its top operators, and report the trace to worker0."""
    path = os.path.join(args.profile, f"{worker_name}.json")
    prof.export_chrome_trace(path)
    with open(path) as file:
        text = file.read()
    print(f"{worker_name}: Wrote trace to {path} ({len(text) / 1024:.0f} kB)")
    missing = ("" if ALL_THREADS or worker_name == "worker0" else
               f"; torch {torch.__version__} records the main thread only, which misses the "
               "operators that RPCs run on TensorPipe's threads")
    # one print: the ranks share the terminal, and a table in pieces would mix with another's
    print(f"{worker_name}: top operators (self CPU time){missing}\n"
          + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=6))
    rpc_harness.report(trace=text)


def write_timeline(args, profiled):
    """At the end, on worker0: merge every rank's trace (in rank order) into --profile's
    timeline.json; the summary."""
    clocks = profiled["worker0"]["clocks"]
    for name, (offset, error) in clocks.items():
        if error:  # offset: how far worker0's clock is ahead of theirs
            print(f"{name}'s clock is {-offset / 1e6:+.3f} ms from worker0's (measured over "
                  f"RPC, within {error / 1e6:.3f} ms); its events are moved by that much")
    traces = {name: {**json.loads(profiled[name]["trace"]),
                     "clockOffsetNs": -clocks.get(name, (0, 0))[0]}
              for name in sorted(profiled, key=rank_of)}
    wrote = profiling.save_timeline(args.profile, traces)
    print(wrote[0].upper() + wrote[1:])
    path = os.path.join(args.profile, profiling.TIMELINE)
    recipe = profiled["worker0"]["recipe"]
    on_worker1 = [event["name"] for event in traces["worker1"]["traceEvents"]
                  if event.get("ph") == "X" and event["name"].startswith("aten::")]
    return (
        {"example": "rpc_profiling", "torch": torch.__version__, "all_threads": ALL_THREADS,
         "recipe_events": recipe["events"], "recipe_remote_events": recipe["remote_events"],
         "worker1_operators": len(on_worker1), "timeline": path,
         "trace_bytes": {name: len(profiled[name]["trace"]) for name in traces}},
        f"the recipe's profiles: {recipe['events']} events, {recipe['remote_events']} of "
        f"worker1; worker1's own profile: {len(on_worker1)} operators; a timeline of "
        f"{len(traces)} ranks")


# --------- Names, the threads --------------------

def rank_of(name):
    """The rank of a worker's name: worker1 -> 1."""
    return int(name.removeprefix("worker"))


def worker_name(rank, world_size):
    """Each rank's name in RPC, as the recipe names them, which the harness's messages use too."""
    return f"worker{rank}"


def computes_nothing(rank, world_size):
    """No rank does heavy computing: 3 x 3 tensors need no more than one thread each."""
    return False


# --------- The command line --------------------

def parse_args(argv=None):
    """The command line (the recipe has none: its world size, address and port as flags), with
    this example's --profile and this project's flags, checked: bad input ends the command here
    in one line, status 2."""
    # rpc_harness.ArgumentParser: argparse's, with every default in --help and errors in one
    # line (status 2). rpc_harness.int_at_least(N) and port_number: argument types that refuse
    # what a plain int would let through.
    parser = rpc_harness.ArgumentParser(description=(
        "Profiling RPC: worker0 sends worker1 two operators and a function under the "
        "profiler, as the recipe does, then every rank profiles itself and worker0 writes one "
        "timeline of them all."))
    parser.add_argument(
        "--world_size",
        type=rpc_harness.int_at_least(2),
        default=2,
        metavar="N",
        help="total number of processes: worker0 (sends the RPCs), worker1 (runs them), "
             "others idle")
    parser.add_argument(
        "--rank",
        type=rpc_harness.int_at_least(0),
        default=None,
        metavar="R",
        help="rank of this process. Without it, every rank starts here (or torchrun's RANK)")
    parser.add_argument(
        "--master_addr",
        default="localhost",
        metavar="ADDR",
        help="address of worker0 (rank 0); other than localhost, on a trusted network only")
    parser.add_argument(
        "--master_port",
        type=rpc_harness.port_number,
        default=29500,
        metavar="PORT",
        help="port where the ranks meet, on worker0's address")
    # Not in the recipe: the folder of its trace (its /tmp/trace.json) and of every rank's; then
    # the flags that every example of this project has (timeouts, --seed, --summary_json), but
    # the harness's --profile: this example profiles itself.
    parser.add_argument(
        "--profile", default="traces", metavar="DIR",
        help="folder for the traces: the recipe's trace.json, one per rank (worker0.json, ...) "
             "and worker0's timeline.json of them all; made if missing")
    rpc_harness.add_arguments(parser, rpc_transport="auto", profiled=False)
    args = parser.parse_args(argv)
    # rpc_harness.check_args: the world, the rank, the address and port; torchrun's RANK and
    # WORLD_SIZE stand for --rank and --world_size; and args.harness records what rpc_harness
    # needs in every rank (docs/harness.md). loops=None: no rank calls
    # profile_step(), the recipe's profilers are its own. Then --profile's folder.
    rpc_harness.check_args(parser, args, worker_name, computes=computes_nothing, loops=None,
                           summary=write_timeline, per_rank=["profile"])
    rpc_harness.check_folder(parser, "--profile", args.profile)
    return args
