"""What rl_cartpole's programs add beside the tutorial: this project's flags and the checks that
argparse cannot make, torchrun's environment, the returns of each observer's own episode,
--profile's few lines of torch.profiler, and the run's summary. main.py and batch.py call it
from lines marked "# ours"."""

import argparse
import datetime
import json
import os
import resource
import socket
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

# rpc.shutdown() gathers the ranks over the RPC agent's own Gloo process group, which recent
# torch then warns about, once in every rank: "You are using a Backend <...> as a
# ProcessGroup. This usage is deprecated". It comes from inside torch, not from the tutorial's
# code, and there is nothing to change in the program, so it is left out.
warnings.filterwarnings("ignore", message=r".*as a ProcessGroup\. This usage is deprecated")
# With --profile, some torch versions (2.11, not 2.15) warn in every rank that "Profiler clears
# events at the end of each cycle". Each rank records one cycle and writes it whole, so nothing
# is lost: left out too.
warnings.filterwarnings("ignore", message="Warning: Profiler clears events at the end of each")

# Every line of every rank written whole, in one write, as soon as it is printed: the ranks
# share one terminal or file, and where Python writes a line's text and its newline apart
# (PYTHONUNBUFFERED=1), another rank's line can fall between them. A terminal shows lines so
# already; a file or pipe now does too.
if hasattr(sys.stdout, "reconfigure"):
    sys.stdout.reconfigure(line_buffering=True, write_through=False)

# --------- The command line --------------------

def at_least(low):
    """An argparse type: an integer of at least `low`."""

    def integer(text):
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {text}")
        return value

    return integer


def port(text):
    """An argparse type: a port number, kept as text, as os.environ['MASTER_PORT'] takes it."""
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port from 1 to 65535, got {text}")
    return str(value)


def add_arguments(parser):
    """The flags this project adds to the tutorial's: one rank a command and where the ranks
    meet (the tutorial starts every rank on one machine), a bound on the run, the summary's
    file and --profile, each with its hyphenated spelling too. And on the tutorial's parser: no
    abbreviated flags (a typo must not pass for another flag), and errors in one line (argparse's
    usage lines left out: --help shows them)."""
    parser.allow_abbrev = False

    def error(message):
        parser.exit(2, f"{parser.prog}: error: {message}\n")

    parser.error = error
    parser.add_argument("--rank", type=at_least(0), default=None,
                        help="this process's rank: 0 for the agent, 1.. for the observers; "
                             "without it, every rank starts here (or torchrun's RANK)")
    parser.add_argument("--master_addr", "--master-addr", default="localhost",
                        help="address of the agent (rank 0), where every rank meets; other "
                             "than localhost, on a trusted network only (default: %(default)s)")
    parser.add_argument("--master_port", "--master-port", type=port, default="29500",
                        help="port that rank 0 listens on, where every rank meets "
                             "(default: %(default)s)")
    parser.add_argument("--max_episodes", "--max-episodes", type=at_least(1), default=2000,
                        metavar="N",
                        help="stop, unsolved, after this many episodes (default: %(default)s)")
    parser.add_argument("--summary_json", "--summary-json", default=None, metavar="PATH",
                        help="write the run's figures to this JSON file at the end")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="write each rank's torch.profiler trace to DIR/<its name>.json: "
                             "the agent's episodes 3 to 5, an observer's whole run")


def check_args(parser, args):
    """What argparse cannot check, before any rank starts or any port opens: bad input ends the
    command here in one line, status 2. Under torchrun (RANK and WORLD_SIZE set, no --rank),
    the rank, world size and meeting point are torchrun's. args.started: the command's start,
    for the summary's wall seconds (args travels to the ranks)."""
    args.started = time.time()
    args.torchrun = args.rank is None and "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if args.torchrun:
        try:
            args.rank = int(os.environ["RANK"])
            args.world_size = int(os.environ["WORLD_SIZE"])
            args.master_port = port(os.environ.get("MASTER_PORT", args.master_port))
        except (ValueError, argparse.ArgumentTypeError):
            parser.error("torchrun's RANK, WORLD_SIZE and MASTER_PORT must be numbers, got "
                         f"{os.environ['RANK']}, {os.environ['WORLD_SIZE']} and "
                         f"{os.environ.get('MASTER_PORT')}")
        args.master_addr = os.environ.get("MASTER_ADDR", args.master_addr)
        if args.world_size < 2:
            parser.error(f"torchrun started {args.world_size} process(es): the agent and at "
                         "least one observer make 2 (--nproc_per_node=2 or more)")
    if args.world_size < 2:  # a world of 1 has no observer, and divides by zero
        parser.error(f"argument --world_size: must be at least 2, got {args.world_size}")
    if args.rank is not None and args.rank >= args.world_size:
        parser.error(f"--rank {args.rank} is outside a world of {args.world_size} "
                     f"(ranks 0 to {args.world_size - 1})")
    if not 0 <= args.gamma <= 1:  # NaN too
        parser.error(f"argument --gamma: must be from 0 to 1, got {args.gamma}")
    if args.seed < 0:  # Gymnasium refuses a negative seed
        parser.error(f"argument --seed: must be at least 0, got {args.seed}")
    if args.log_interval < 1:
        parser.error(f"argument --log_interval: must be at least 1, got {args.log_interval}")
    if args.summary_json and args.rank in (None, 0):  # rank 0 writes it
        check_file(parser, "--summary_json", args.summary_json)
    if args.profile:
        check_folder(parser, "--profile", args.profile)
    check_address(parser, args)


def check_file(parser, flag, path):
    """A file that the run writes at its end: its folder must be there and take a file (one is
    made and removed), and the file, where it is there already, must be writable."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        parser.error(f"{flag} {path}: that is a folder, not a file")
    if not os.path.isdir(folder):
        parser.error(f"{flag} {path}: no such folder ({folder})")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        parser.error(f"{flag} {path}: cannot write that file")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".check-"):
            pass
    except OSError as error:
        parser.error(f"{flag} {path}: cannot write in {folder} ({error.strerror or error})")


def check_folder(parser, flag, folder):
    """A folder that the ranks write in, made if missing."""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as error:
        parser.error(f"{flag} {folder}: cannot make that folder ({error.strerror or error})")
    if not os.access(folder, os.W_OK | os.X_OK):
        parser.error(f"{flag} {folder}: cannot write in that folder")


def check_address(parser, args):
    """--master_addr must resolve; where this command hosts rank 0 (rank 0, or every rank, not
    under torchrun, whose agent holds the port), --master_port must take a listener."""
    address, number = args.master_addr, int(args.master_port)
    try:
        family = socket.getaddrinfo(address, number, type=socket.SOCK_STREAM)[0][0]
    except (OSError, UnicodeError) as error:  # UnicodeError: not a host name at all
        parser.error(f"--master_addr {address}: no such host "
                     f"({getattr(error, 'strerror', None) or error})")
    if args.torchrun or args.rank not in (None, 0):
        return
    try:
        socket.create_server((address, number), family=family).close()
    except OSError as error:
        parser.error(f"cannot listen on {address}:{number} ({error.strerror or error}): "
                     "choose another --master_port")


# --------- The training --------------------

def discounted_returns(rewards_per_observer, gamma, eps):
    """R_t = r_t + gamma * R_(t+1), discounted back from the end of each observer's own episode
    (the tutorial joined the episodes first, so one observer's last step took the next one's
    rewards), then normalised together."""
    returns = []
    for rewards in rewards_per_observer:
        R, observer_returns = 0, []
        for r in rewards[::-1]:
            R = r + gamma * R
            observer_returns.insert(0, R)
        returns.extend(observer_returns)
    returns = torch.tensor(returns)
    return (returns - returns.mean()) / (returns.std() + eps)


# --------- --profile DIR --------------------

class NotProfiling:
    """What profile() returns without --profile: nothing to do."""

    def step(self):
        pass

    def stop(self):
        pass


def profile(args, loops):
    """This rank's torch.profiler, started (call it after init_rpc, which names the rank). A
    rank that loops calls step() once a step and records steps 3 to 5; a rank that serves
    records until stop(). Its trace goes to DIR/<its RPC name>.json, written whole."""
    if not args.profile:
        return NotProfiling()
    me = rpc.get_worker_info()

    def write(prof):
        path = os.path.join(args.profile, f"{me.name}.json")
        part = os.path.join(args.profile, f".{me.name}.json")
        prof.export_chrome_trace(part)
        os.replace(part, path)
        print(f"{me.name}: profiled, wrote {path} ({os.path.getsize(path) // 1024} kB)",
              flush=True)

    try:  # every thread, the RPC threads that run the calls included
        options = {"experimental_config":
                   torch._C._profiler._ExperimentalConfig(profile_all_threads=True)}
    except TypeError:  # torch 2.4 records only the thread that starts the profiler
        options = {}
    if loops:
        options["schedule"] = torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1)
    prof = torch.profiler.profile(on_trace_ready=write, **options)
    prof.preset_metadata_json("rank", json.dumps(me.id))  # rpcrun orders the tracks by rank
    prof.start()
    return prof


# --------- The summary --------------------

FIGURES = {}  # the run's figures, in the agent's process, for finish()


def peak_memory_mb():
    """This process's most resident memory so far (Linux: kB), and its GPU's where it used one,
    in MB."""
    peak = {"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}
    if torch.cuda.is_initialized():
        peak["cuda"] = torch.cuda.max_memory_allocated() // 2**20
    return peak


def figures(agent, episodes, last_reward, seconds):
    """The agent's figures at the end of its loop, and each process's peak memory: the
    observers, waiting in their rpc.shutdown(), still answer RPCs."""
    memory = {rpc.get_worker_info().name: peak_memory_mb()}
    for ob_rref in agent.ob_rrefs:
        memory[ob_rref.owner().name] = rpc.rpc_sync(ob_rref.owner(), peak_memory_mb)
    mode = "batch" if type(agent).__name__ == "BatchAgent" else "tutorial"
    FIGURES.update(
        example="rl_cartpole", mode=mode, episodes=episodes, last_reward=last_reward,
        running_reward=agent.running_reward, env_steps=agent.env_steps,
        solved=agent.running_reward > agent.reward_threshold, training_seconds=round(seconds, 3),
        observers=len(agent.ob_rrefs), gamma=agent.gamma,
        steps_per_second=round(agent.env_steps / seconds, 1), peak_memory_mb=memory)


def finish(args, profiler):
    """After rpc.shutdown(): this rank's --profile trace, and on the agent, the summary as its
    last line and --summary_json. A file that cannot be written then: one line, status 1."""
    profiler.stop()
    if not FIGURES:
        return
    summary = {**FIGURES, "seed": args.seed,
               "wall_seconds": round(time.time() - args.started, 3)}
    print(f"Summary: {summary['episodes']} episodes, "
          f"{'solved' if summary['solved'] else 'not solved'}, running reward "
          f"{summary['running_reward']:.2f}, {summary['env_steps']} environment steps at "
          f"{summary['steps_per_second']:.1f} steps/s; {summary['wall_seconds']:.1f} s in all",
          flush=True)
    if args.summary_json:
        try:
            with open(args.summary_json, "w") as file:
                file.write(json.dumps(summary, indent=2) + "\n")
        except OSError as error:  # one line on standard error, status 1
            sys.exit(f"--summary_json {args.summary_json}: not written "
                     f"({error.strerror or error}); the Summary line has the run's figures")


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
