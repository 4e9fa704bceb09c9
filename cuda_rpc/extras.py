"""What main.py adds beside the recipe, small enough to read and to delete: the command line (the
recipe has none) and its checks, the choice of devices and of the device map (the recipe's
{0: 1} needs two GPUs), where a tensor lands on each side, and the run's summary."""

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


def two(text):
    """An argparse type: the recipe's world of two workers."""
    value = at_least(2)(text)
    if value != 2:
        raise argparse.ArgumentTypeError(f"the recipe has two workers: must be 2, got {value}")
    return value


def device_map(text):
    """An argparse type: a device map from worker0's GPUs to worker1's, "0:1" or "0:1,1:0",
    as a dict {0: 1}; one to one, as torch requires."""
    found = {}
    for pair in text.split(","):
        source, _, target = pair.strip().partition(":")
        if not (source.isdigit() and target.isdigit()):
            raise argparse.ArgumentTypeError(
                f"must be pairs of GPU numbers, worker0's:worker1's, such as 0:1 or 0:1,1:0; "
                f"got {text}")
        source, target = int(source), int(target)
        if source in found:
            raise argparse.ArgumentTypeError(f"maps worker0's cuda:{source} twice")
        if target in found.values():
            other = next(key for key, value in found.items() if value == target)
            raise argparse.ArgumentTypeError(
                f"maps worker0's cuda:{other} and cuda:{source} both to worker1's "
                f"cuda:{target}: a device map must be one to one")
        found[source] = target
    return found


def parse_args(argv=None):
    """The flags, checked: bad input ends the command here, in one line with status 2. Then the
    devices, said in the command's first line."""
    parser = argparse.ArgumentParser(
        description="The recipe: worker0 drives a model of two linear layers, the second on "
                    "worker1, first staging tensors through the CPU, then sending them GPU to "
                    "GPU through a device map. Without CUDA, both modes use the CPU.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)

    def error(message):  # one line: argparse's usage lines left out (--help shows them)
        parser.exit(2, f"{parser.prog}: error: {message}\n")

    parser.error = error
    parser.add_argument("--world_size", "--world-size", type=two, default=2, metavar="N",
                        help="number of workers: the recipe's two, worker0 and worker1")
    parser.add_argument("--rank", type=at_least(0), default=None, metavar="R",
                        help="run only this worker (start the other in another terminal); "
                             "without it, both start here, or torchrun's RANK")
    parser.add_argument("--master_addr", "--master-addr", default="localhost", metavar="ADDR",
                        help="worker0's address, where the workers meet (trusted networks only)")
    parser.add_argument("--master_port", "--master-port", type=port, default=29500,
                        metavar="PORT", help="worker0's port, where the workers meet")
    parser.add_argument("--device_map", "--device-map", type=device_map, default=None,
                        metavar="MAP",
                        help="worker0's GPUs to worker1's, such as 0:1; without it, 0:1 on two "
                             "GPUs or more, 0:0 on one, none without CUDA")
    parser.add_argument("--iterations", type=at_least(1), default=10, metavar="N",
                        help="timed forward and backward passes in each mode")
    parser.add_argument("--seed", type=at_least(0), default=1, metavar="N",
                        help="random seed of every worker")
    parser.add_argument("--summary_json", "--summary-json", default=None, metavar="PATH",
                        help="worker0 writes the run's figures to this JSON file at the end")
    args = parser.parse_args(argv)
    check_args(parser, args)
    print(devices_line(args), flush=True)
    return args


def check_args(parser, args):
    """What argparse cannot check, before any worker starts; torchrun's rank and world; the
    devices and the device map."""
    args.started = time.time()  # the summary's wall seconds count from here
    args.torchrun = args.rank is None and "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if args.torchrun:  # run the one rank that torchrun started this process for
        for name in ("RANK", "WORLD_SIZE"):
            if not os.environ[name].isdigit():
                parser.error(f"torchrun's {name} is {os.environ[name]}, not a number")
        args.rank, args.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if args.world_size != 2:
            parser.error(f"torchrun started {args.world_size} process(es): the recipe needs 2 "
                         "(--nproc_per_node 2)")
        args.master_addr = os.environ.get("MASTER_ADDR", args.master_addr)
        args.master_port = int(os.environ.get("MASTER_PORT", args.master_port))
    if args.rank is not None and args.rank >= args.world_size:
        parser.error(f"argument --rank: {args.rank} is outside a world of {args.world_size} "
                     f"(ranks 0 to {args.world_size - 1})")
    check_devices(parser, args, torch.cuda.device_count())
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


# --------- The devices --------------------

def choose_devices(gpu_count, chosen_map=None):
    """(worker0's device, worker1's device, the device map from worker0 to worker1 or None):
    the recipe's {0: 1} on two GPUs or more, both workers on cuda:0 with {0: 0} on one GPU,
    the CPU and no map without CUDA; a map given (--device_map) decides, its first pair
    placing the two modules. Tests fake gpu_count."""
    if chosen_map is None:
        if gpu_count == 0:
            return "cpu", "cpu", None
        chosen_map = {0: 1} if gpu_count >= 2 else {0: 0}
    first = next(iter(chosen_map))
    return f"cuda:{first}", f"cuda:{chosen_map[first]}", chosen_map


def check_devices(parser, args, gpu_count):
    """--device_map against this machine's GPUs, for the workers that this command runs:
    worker0 uses the map's first numbers, worker1 its second ones. Sets args.devices (worker0's
    and worker1's) and args.device_map."""
    chosen = args.device_map
    if chosen is not None:
        if gpu_count == 0:
            parser.error("argument --device_map: this machine has no GPU that torch can use "
                         "(CUDA is not available); leave --device_map out to run on the CPU")
        sides = {0: chosen.keys(), 1: chosen.values()}
        for rank in ((0, 1) if args.rank is None else (args.rank,)):
            for index in sides[rank]:
                if index >= gpu_count:
                    parser.error(f"argument --device_map: worker{rank}'s cuda:{index} does not "
                                 f"exist; this machine has {gpu_count} GPU(s), cuda:0 to "
                                 f"cuda:{gpu_count - 1}")
    local, remote, args.device_map = choose_devices(gpu_count, chosen)
    args.devices, args.gpu_count, args.map_given = (local, remote), gpu_count, chosen is not None


def devices_line(args):
    """The command's first line: where the two modules run, and through which device map."""
    local, remote = args.devices
    if args.device_map is None:
        return ("No CUDA here: worker0 and worker1 run the recipe's calls on the CPU, with CPU "
                "tensors and no device map, so its cpu and cuda modes move the same tensors")
    if args.map_given:
        why = "--device_map"
    elif args.gpu_count == 1:
        why = "One GPU here"
    else:
        why = f"{args.gpu_count} GPUs here, the recipe's map"
    where = (f"worker0 and worker1 share {local}" if local == remote
             else f"worker0 on {local}, worker1 on {remote}")
    return f"{why}: {where}, with the device map {args.device_map} from worker0 to worker1"


# --------- Where a tensor lands --------------------

landed = {}  # worker0's: where its tensor landed on worker1, and where the reply landed


def device_of(tensor):
    """On worker1: where an RPC's tensor argument arrived, and the tensor back, as the reply."""
    return str(tensor.device), tensor


def where_tensors_land(device):
    """On worker0: send worker1 a tensor on worker0's device, and say where it arrived and
    where its reply arrived (through the device map, and its inverse for the reply)."""
    sent = torch.ones(2, device=device)
    there, back = rpc.rpc_sync("worker1", device_of, args=(sent,))
    landed.update(sent=str(sent.device), landed=there, reply=str(back.device))
    print(f"worker0 sent a tensor on {sent.device}: it arrived on worker1's {there}, and "
          f"worker1's reply arrived on worker0's {back.device}", flush=True)


# --------- The summary --------------------

seconds = {}  # worker0's: each mode's timed seconds


def record(comm_mode, elapsed):
    """On worker0: a mode's seconds, as measure() printed them."""
    seconds[comm_mode] = elapsed


def peak_rss_mb():
    """This process's most resident memory so far, in MB (ru_maxrss: kB on Linux, bytes on
    macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss // (2**20 if sys.platform == "darwin" else 2**10)


def summary(args, rank):
    """worker0's last line, after its rpc.shutdown(), and --summary_json."""
    if rank != 0:
        return
    cpu, cuda = seconds["cpu"], seconds["cuda"]
    figures = {
        "example": "cuda_rpc", "torch": torch.__version__, "world_size": args.world_size,
        "devices": {"worker0": args.devices[0], "worker1": args.devices[1]},
        "device_map": None if args.device_map is None else {
            str(source): target for source, target in args.device_map.items()},
        "iterations": args.iterations,
        "seconds": {"cpu": round(cpu, 6), "cuda": round(cuda, 6)},
        "speedup": round(cpu / cuda, 3) if cuda > 0 else None,
        "landed": dict(landed),
        "peak_memory_mb": {"worker0": {"rss": peak_rss_mb()}},
        "wall_seconds": round(time.time() - args.started, 3),
    }
    if args.devices[0] != "cpu":
        figures["peak_memory_mb"]["worker0"]["cuda"] = round(
            torch.cuda.max_memory_allocated(args.devices[0]) / 2**20, 1)
    way = ("on the CPU, no device map" if args.device_map is None
           else f"device map {args.device_map}")
    ratio = f"{figures['speedup']:.1f}x" if figures["speedup"] else "-"
    print(f"Summary: cpu RPC {cpu:.3f} s, cuda RPC {cuda:.3f} s for {args.iterations} "
          f"iteration(s) ({ratio}), {way}; {figures['wall_seconds']:.1f} s in all", flush=True)
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
