"""A distributed RNN trained with model parallelism, distributed autograd and
DistributedOptimizer over torch.distributed.rpc.

The runnable companion to the second half of the PyTorch tutorial "Getting Started with
Distributed RPC Framework" (distributed RNN using distributed autograd and distributed
optimizer). The model of pytorch/examples' word_language_model is split in three: rank 0 (`ps`)
holds the embedding table and the decoder, rank 1 (`trainer`) holds the LSTM and runs the
training loop, reaching the two remote parts through RPC.

    python rnn_model_parallel/main.py                        # every rank on this machine
    python rnn_model_parallel/main.py --rank 1               # one rank per terminal
    torchrun --nproc_per_node 2 rnn_model_parallel/main.py   # under torchrun
    python rnn_model_parallel/main.py --corpus book.txt --emsize 64 --nhid 64 --batch_size 20

The last trains a word-level language model of a text file instead of the synthetic task.
See README.md beside this file for what differs from the tutorial, and `--help` for the flags.
"""

import argparse
import ctypes
import fcntl
import io
import ipaddress
import json
import math
import os
import re
import signal
import socket
import struct
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
from torch import optim
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef

# Known-harmless warnings that PyTorch prints from inside its RPC stack, in every process, about
# its own internals: the RPC agent builds its process group through an API deprecated since
# PyTorch 2.0, and DistributedOptimizer uses TorchScript functional optimizers, deprecated too.
# The second is raised under warnings.simplefilter("always"), which overrides
# warnings.filterwarnings, so they are dropped where warnings are shown instead.
KNOWN_HARMLESS_WARNINGS = re.compile(r"as a ProcessGroup\. This usage is deprecated"
                                     r"|`TorchScript` support for functional optimizers")
_show_warning = warnings.showwarning


def _show_useful_warning(message, *args, **kwargs):
    if not KNOWN_HARMLESS_WARNINGS.search(str(message)):
        _show_warning(message, *args, **kwargs)


warnings.showwarning = _show_useful_warning

# The synthetic task: SYNTHETIC_NTOKEN distinct tokens in sequences that count up (each token
# is the previous one plus 1, modulo SYNTHETIC_NTOKEN) and restart from a random token with
# probability SYNTHETIC_RESTART at each step. The tutorial's get_next_batch draws indices from
# uninitialised memory, which no model can learn; these follow a rule, so the loss has somewhere
# to fall to.
SYNTHETIC_NTOKEN = 10  # the tutorial's ntoken
SYNTHETIC_RESTART = 0.1
SYNTHETIC_TOKENS = 2000  # per epoch; 133 batches of 5 steps x 3 sequences


# --------- The model: word_language_model's RNN in three parts, two of them on ps ------------

def choose_embedding_device(gpu_count):
    """Where EmbeddingTable puts its table: cuda:0 when the machine has a GPU, as the tutorial
    does (to show how a remote module on a GPU deals with RPC's CPU tensors), else the CPU.
    `gpu_count` is passed in (normally torch.cuda.device_count()) so that this choice can be
    tested without a GPU."""
    return torch.device("cuda:0" if gpu_count > 0 else "cpu")


class EmbeddingTable(nn.Module):
    """
    Encoding layers of the RNNModel
    """
    def __init__(self, ntoken, ninp, dropout):
        super().__init__()
        self.device = choose_embedding_device(torch.cuda.device_count())
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp).to(self.device)
        self.encoder.weight.data.uniform_(-0.1, 0.1)

    def forward(self, input):
        # RPC (without device maps) delivers the input on the CPU and sends CPU tensors only:
        # move the indices to the table's device, and the embeddings back to the CPU.
        return self.drop(self.encoder(input.to(self.device))).cpu()

    def get_device(self):
        return str(self.device)


class Decoder(nn.Module):
    def __init__(self, ntoken, nhid, dropout):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.decoder.bias.data.zero_()
        self.decoder.weight.data.uniform_(-0.1, 0.1)

    def forward(self, output):
        return self.decoder(self.drop(output))


# On the local node, call a method with first arg as the value held by the RRef. Other args are
# passed in as arguments to the function called. Useful for calling instance methods.
def _call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


# Given an RRef, return the result of calling the passed in method on the value held by the RRef.
# This call is done on the remote node that owns the RRef: _remote_method(Foo.bar, rref, arg)
# runs <foo instance>.bar(arg) there and returns the result.
def _remote_method(method, rref, *args, **kwargs):
    args = [method, rref] + list(args)
    return rpc.rpc_sync(rref.owner(), _call_method, args=args, kwargs=kwargs)


class RNNModel(nn.Module):
    def __init__(self, ps, ntoken, ninp, nhid, nlayers, dropout=0.5):
        super().__init__()

        # setup embedding table remotely
        self.emb_table_rref = rpc.remote(ps, EmbeddingTable, args=(ntoken, ninp, dropout))
        # rpc.remote returns before ps has built the table. Asking where the table lives waits
        # until it exists, so that ps draws the random initial weights of the table and of the
        # decoder in the same order in every run (one seed, one result).
        self.table_device = _remote_method(EmbeddingTable.get_device, self.emb_table_rref)
        # setup LSTM locally
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        # setup decoder remotely
        self.decoder_rref = rpc.remote(ps, Decoder, args=(ntoken, nhid, dropout))

    def forward(self, input, hidden):
        # pass input to the remote embedding table and fetch emb tensor back
        emb = _remote_method(EmbeddingTable.forward, self.emb_table_rref, input)
        output, hidden = self.rnn(emb, hidden)
        # pass output to the remote decoder and get the decoded output back
        decoded = _remote_method(Decoder.forward, self.decoder_rref, output)
        return decoded, hidden

    def parameter_rrefs(self):
        remote_params = []
        # get RRefs of embedding table
        remote_params.extend(_remote_method(_parameter_rrefs, self.emb_table_rref))
        # create RRefs for local parameters
        remote_params.extend(_parameter_rrefs(self.rnn))
        # get RRefs of decoder
        remote_params.extend(_remote_method(_parameter_rrefs, self.decoder_rref))
        return remote_params


# DistributedOptimizer takes RRefs to the parameters, wherever they live: one per parameter.
def _parameter_rrefs(module):
    param_rrefs = []
    for param in module.parameters():
        param_rrefs.append(RRef(param))
    return param_rrefs


# --------- Data --------------------

def synthetic_tokens(length, ntoken, seed):
    """The synthetic task's token stream (see SYNTHETIC_RESTART), the same for a given seed."""
    gen = torch.Generator().manual_seed(seed)
    restarts = (torch.rand(length, generator=gen) < SYNTHETIC_RESTART).tolist()
    random_tokens = torch.randint(ntoken, (length,), generator=gen).tolist()
    tokens = [random_tokens[0]]
    for restart, random_token in zip(restarts[1:], random_tokens[1:], strict=True):
        tokens.append(random_token if restart else (tokens[-1] + 1) % ntoken)
    return torch.tensor(tokens)


def best_synthetic_loss(ntoken, restart):
    """The entropy of the synthetic task's next token, the lowest loss any model can reach: the
    counting rule gives the next token with probability 1 - restart + restart / ntoken, each
    other token has restart / ntoken."""
    other = restart / ntoken
    likely = 1 - restart + other
    return -likely * math.log(likely) - (ntoken - 1) * other * math.log(other)


def tokenize(text):
    """Words split on white space, with <eos> at the end of every line, as word_language_model
    reads its corpus."""
    return [word for line in text.splitlines() for word in line.split() + ["<eos>"]]


def load_corpus(path):
    """(vocabulary, token ids) of a plain-text file: the vocabulary is every distinct word in the
    order it first appears. Raises ValueError with a one-line reason if the file cannot serve."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"--corpus {path}: not a UTF-8 text file") from None
    except OSError as err:
        raise ValueError(f"--corpus {path}: cannot read it ({err.strerror})") from None
    words = tokenize(text)
    if not any(word != "<eos>" for word in words):
        raise ValueError(f"--corpus {path}: the file holds no words")
    word_to_id = {}
    for word in words:
        word_to_id.setdefault(word, len(word_to_id))
    return list(word_to_id), torch.tensor([word_to_id[word] for word in words])


def batchify(data, batch_size):
    """Cut a token stream into batch_size sequences of equal length, one per column (the
    remainder is dropped), as word_language_model does: (length, batch_size)."""
    length = data.size(0) // batch_size
    return data[:length * batch_size].view(batch_size, length).t().contiguous()


def get_next_batch(source, bptt, max_batches=None):
    """Consecutive (data, target) windows of up to bptt steps over a batchified source, in
    order, so that the hidden state carried from one window to the next follows the text.
    target is data one step ahead: at every position, the token that comes next."""
    for batch, start in enumerate(range(0, source.size(0) - 1, bptt)):
        if max_batches is not None and batch >= max_batches:
            return
        seq_len = min(bptt, source.size(0) - 1 - start)
        yield source[start:start + seq_len], source[start + 1:start + 1 + seq_len]


def training_data(args):
    """(ntoken, token stream, what it is) for this run."""
    if args.corpus is None:
        best = best_synthetic_loss(SYNTHETIC_NTOKEN, SYNTHETIC_RESTART)
        about = (f"Synthetic data: {SYNTHETIC_TOKENS} tokens counting up modulo "
                 f"{SYNTHETIC_NTOKEN}, restarting at a random token with probability "
                 f"{SYNTHETIC_RESTART} (lowest possible loss {best:.4f})")
        return (SYNTHETIC_NTOKEN, synthetic_tokens(SYNTHETIC_TOKENS, SYNTHETIC_NTOKEN, args.seed),
                about)
    vocabulary, tokens = load_corpus(args.corpus)
    about = f"Corpus {args.corpus}: {len(tokens)} words, {len(vocabulary)} distinct"
    return len(vocabulary), tokens, about


# --------- Trainer and ps --------------------

def _run_trainer(name, args):
    tag = f"{name}: " if args.world_size > 2 else ""  # whose line, when there are several
    ntoken, tokens, about = training_data(args)
    print(f"{tag}{about}")
    # The tutorial's data is (batch, nindices) = (5, 3), which nn.LSTM (not batch_first) reads
    # as 5 time steps of 3 sequences; the hidden state is (nlayers, nindices, nhid) to match.
    # Here those are --bptt and --batch_size, the names word_language_model gives them.
    source = batchify(tokens, args.batch_size)
    nlayers, nindices, nhid = args.nlayers, args.batch_size, args.nhid
    hidden = (
        torch.randn(nlayers, nindices, nhid),
        torch.randn(nlayers, nindices, nhid)
    )

    model = RNNModel("ps", ntoken, args.emsize, nhid, nlayers, args.dropout)
    print(f"{tag}Embedding table on ps ({model.table_device}), LSTM local, decoder on ps")

    # setup distributed optimizer
    opt = DistributedOptimizer(
        optim.SGD,
        model.parameter_rrefs(),
        lr=args.lr,
    )

    criterion = torch.nn.CrossEntropyLoss()

    losses, iterations = [], 0
    started = time.perf_counter()
    for epoch in range(args.epochs):
        loss_sum, targets = 0.0, 0
        for data, target in get_next_batch(source, args.bptt, args.max_batches):
            # create distributed autograd context
            with dist_autograd.context() as context_id:
                # carry the hidden state over from the previous window, but not its graph
                hidden[0].detach_()
                hidden[1].detach_()
                output, hidden = model(data, hidden)
                # a language-model loss: one prediction per position, against the next token
                loss = criterion(output.view(-1, ntoken), target.view(-1))
                # run distributed backward pass
                dist_autograd.backward(context_id, [loss])
                # run distributed optimizer
                opt.step(context_id)
                # not necessary to zero grads as each iteration creates a different
                # distributed autograd context which hosts different grads
            loss_sum += loss.item() * target.numel()
            targets += target.numel()
            iterations += 1
        losses.append(loss_sum / targets)
        print(f"{tag}Training epoch {epoch} loss {losses[-1]:.4f} "
              f"perplexity {math.exp(losses[-1]):.2f}")
    return {"losses": losses, "iterations": iterations, "ntoken": ntoken,
            "train_seconds": time.perf_counter() - started}


def run_worker(rank, world_size, args):
    started = time.perf_counter()
    name = worker_name(rank, world_size)
    if rank == 0:
        # Seeded for the dropout and the initial weights of the parts that live here.
        torch.manual_seed(args.seed)
        init_rpc_with_timeout(name, rank, world_size, args)
        # parameter server does nothing: it hosts the embedding tables and decoders the
        # trainers create, and answers their calls until every trainer is done
        reports = finish_and_shutdown(name, world_size, args)
        write_summary(args, reports, time.perf_counter() - started)
    else:
        torch.manual_seed(args.seed + rank)
        init_rpc_with_timeout(name, rank, world_size, args)
        report = _run_trainer(name, args)
        finish_and_shutdown(name, world_size, args, report)


def worker_name(rank, world_size):
    """`ps` and `trainer` as in the tutorial; with several trainers, trainer1, trainer2, ..."""
    if rank == 0:
        return "ps"
    return "trainer" if world_size == 2 else f"trainer{rank}"


def write_summary(args, reports, wall_seconds):
    """The run's figures, from what each trainer reported when it finished."""
    trainers = {name: report for name, report in sorted(reports.items()) if report}
    first_loss = sum(r["losses"][0] for r in trainers.values()) / len(trainers)
    last_loss = sum(r["losses"][-1] for r in trainers.values()) / len(trainers)
    summary = {
        "example": "rnn_model_parallel",
        "data": args.corpus or "synthetic",
        "ntoken": next(iter(trainers.values()))["ntoken"],
        "world_size": args.world_size,
        "trainers": len(trainers),
        "epochs": args.epochs,
        "first_loss": first_loss,
        "last_loss": last_loss,
        "first_perplexity": math.exp(first_loss),
        "last_perplexity": math.exp(last_loss),
        "iterations": sum(r["iterations"] for r in trainers.values()),
        "per_trainer": {name: {"losses": r["losses"], "iterations": r["iterations"]}
                        for name, r in trainers.items()},
        "train_seconds": round(max(r["train_seconds"] for r in trainers.values()), 3),
        "wall_seconds": round(wall_seconds, 3),
    }
    print(f"Summary: loss {first_loss:.4f} -> {last_loss:.4f}, perplexity "
          f"{summary['first_perplexity']:.2f} -> {summary['last_perplexity']:.2f} over "
          f"{len(trainers)} trainer(s), {summary['wall_seconds']} s")
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps(summary, indent=2) + "\n")


# --------- Starting, ending and failing safely (the same in each example) --------------------
#
# The tutorial starts each rank with rpc.init_rpc() and ends it with rpc.shutdown(), both of which
# wait for every other rank with no practical time limit: a rank that never starts, or dies
# mid-run, leaves the others waiting forever. Here every wait has a bound:
#   - init_rpc() must complete within --init_timeout seconds;
#   - a rank that has finished its own work tells the others, and waits for them to finish too,
#     checking every HEARTBEAT_SECONDS that the ones still working answer; only when all are done
#     does it call rpc.shutdown(), which then returns at once;
#   - any RPC that fails (a peer died, or did not answer within --rpc_timeout) stops this rank:
#     it names the peers that no longer answer and exits with status 1, without the graceful
#     shutdown that would wait for them.

HEARTBEAT_SECONDS = 1.0
_reports = {}  # peer name -> what it reported when it finished
_reports_changed = threading.Condition()
_rpc_ready = threading.Event()


def _report_finished(name, report):
    with _reports_changed:
        _reports[name] = report
        _reports_changed.notify_all()


def _answer():
    return True


def init_rpc_with_timeout(name, rank, world_size, args):
    """rpc.init_rpc(), bounded by --init_timeout."""
    def give_up():
        _exit(f"{name}: not all {world_size} ranks joined at {os.environ['MASTER_ADDR']}:"
              f"{os.environ['MASTER_PORT']} within {args.init_timeout:g} s (--init_timeout); "
              f"start every rank with the same --world_size, --master_addr and --master_port")

    timer = threading.Timer(args.init_timeout, give_up)
    timer.daemon = True
    timer.start()
    try:
        # Rank 0 hosts the rendezvous; open its port ourselves so that it listens on
        # --master_addr only (see _listen_for_rendezvous). Under torchrun, torchrun hosts it.
        if rank == 0 and not args.torchrun:
            _listen_for_rendezvous(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        # --rpc_transport tcp: TensorPipe's TCP transport ("uv") only, no shared memory.
        transports = ["uv"] if args.rpc_transport == "tcp" else None
        options = rpc.TensorPipeRpcBackendOptions(init_method="env://",
                                                  rpc_timeout=args.rpc_timeout,
                                                  _transports=transports)
        rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)
    except Exception as err:  # noqa: BLE001 - any failure to join ends this rank with one line
        _exit(f"{name}: could not join the other ranks at {os.environ['MASTER_ADDR']}:"
              f"{os.environ['MASTER_PORT']}: {_first_line(err)}")
    finally:
        timer.cancel()
    _rpc_ready.set()


def _listen(addr, port):
    family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((addr, port), family=family)


def _listen_for_rendezvous(addr, port):
    """Open the rendezvous port of rank 0 on `addr` only. init_rpc's TCPStore would listen on
    every interface, which for a local run exposes an unauthenticated port to the network; created
    first, this store's server is shared by init_rpc's (multi_tenant). A busy port fails here with
    a clear message instead of deep inside init_rpc."""
    global _rendezvous_store  # kept for the life of the process
    try:
        sock = _listen(addr, port)
    except OSError as err:
        _exit(f"cannot listen on {addr}:{port} ({err.strerror}); "
              f"if the port is in use, choose another with --master_port", status=2)
    _rendezvous_store = dist.TCPStore(addr, port, is_master=True, master_listen_fd=sock.detach(),
                                      wait_for_workers=False, multi_tenant=True)


def finish_and_shutdown(name, world_size, args, report=None):
    """Tell every peer that this rank is done (with its report), wait until every peer is done,
    then shut RPC down. Returns every peer's report."""
    peers = [worker_name(rank, world_size) for rank in range(world_size)
             if worker_name(rank, world_size) != name]
    for peer in peers:
        rpc.rpc_sync(peer, _report_finished, args=(name, report))
    while True:
        with _reports_changed:
            working = [peer for peer in peers if peer not in _reports]
            if not working:
                break
            _reports_changed.wait(HEARTBEAT_SECONDS)
        for peer in working:
            rpc.rpc_sync(peer, _answer)  # raises if the peer is gone
    rpc.shutdown(timeout=args.rpc_timeout)
    return dict(_reports)


def run_rank(rank, args):
    """Everything one rank does, in its own process; a failure ends the process with status 1."""
    name = worker_name(rank, args.world_size)
    try:
        run_worker(rank, args.world_size, args)
    except KeyboardInterrupt:
        _exit(f"{name}: interrupted", status=130)
    except Exception as err:  # noqa: BLE001 - reported below, then the process ends
        peers = [worker_name(r, args.world_size) for r in range(args.world_size) if r != rank]
        lost = _unreachable(peers) if _rpc_ready.is_set() else []
        if not lost:
            traceback.print_exc()
            _exit(f"{name}: failed: {_first_line(err)}")
        _exit(f"{name}: lost contact with {', '.join(lost)} ({_first_line(err)}); stopping")


def _unreachable(peers):
    futures = {peer: rpc.rpc_async(peer, _answer, timeout=5) for peer in peers}
    lost = []
    for peer, future in futures.items():
        try:
            future.wait()
        except Exception:  # noqa: BLE001 - any error means no answer
            lost.append(peer)
    return lost


def _first_line(err):
    """The gist of an error: its first line (after the "On WorkerInfo(...):" line that starts an
    error raised on another rank), without TensorPipe's note on its source file."""
    lines = [line for line in str(err).strip().splitlines()
             if line and not line.startswith("On WorkerInfo(")]
    return re.sub(r" \(this error originated at [^)]*\)", "", (lines or [type(err).__name__])[0])


def _exit(message, status=1):
    """Print one line and end the process now. os._exit, because RPC's own threads would keep a
    normal exit waiting for peers that are gone."""
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(status)


def choose_network_interface(addr):
    """Tell TensorPipe and Gloo which network interface to listen on and advertise (unless the
    environment already does): the one that holds this machine's address towards --master_addr.
    For a local run that is loopback, so nothing is reachable from the network (RPC runs
    unauthenticated pickles). Across machines, left to themselves they advertise the address
    the hostname resolves to, often 127.0.1.1, which the other machines cannot reach."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(addr, 1, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(sockaddr)  # chooses the route; a UDP connect sends nothing
            local_address = probe.getsockname()[0]
    except OSError:
        return
    name = next((name for _, name in socket.if_nameindex()
                 if _ipv4_address(name) == local_address), None)
    if name is None and ipaddress.ip_address(local_address).is_loopback:
        name = "lo0" if sys.platform == "darwin" else "lo"
    if name:
        os.environ.setdefault("TP_SOCKET_IFNAME", name)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", name)


def _ipv4_address(interface):
    """The IPv4 address of a network interface (Linux), or None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            request = struct.pack("256s", interface.encode()[:15])
            reply = fcntl.ioctl(sock.fileno(), 0x8915, request)  # SIOCGIFADDR
    except OSError:
        return None
    return socket.inet_ntoa(reply[20:24])


def spawn_all(args):
    """Start every rank on this machine and wait; if one fails, stop the others and exit 1."""
    try:
        mp.spawn(_spawned_rank, args=(args, os.getpid()), nprocs=args.world_size, join=True)
    except mp.ProcessExitedException as err:
        how = (f"was killed by {err.signal_name}" if err.signal_name
               else f"exited with status {err.exit_code}")
        _exit(f"{worker_name(err.error_index, args.world_size)} (rank {err.error_index}) {how}; "
              f"stopped the other ranks")
    except KeyboardInterrupt:
        _exit("interrupted", status=130)


def _spawned_rank(rank, args, launcher_pid):
    """A rank started by spawn_all. It ends with its launcher, even one killed with SIGKILL,
    so that no rank is left running unseen (Linux; elsewhere it finishes its run)."""
    _print_whole_lines()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
        if os.getppid() != launcher_pid:  # the launcher was gone before prctl
            os._exit(1)
    run_rank(rank, args)


def _print_whole_lines():
    """Have print() write each line at once. The ranks share one terminal or log, where lines
    written in pieces (as under python -u or PYTHONUNBUFFERED) run into each other's; and each
    line then shows when it is printed, even through a pipe (| tee run.log)."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True, write_through=False)


# --------- Command line --------------------

class ArgumentParser(argparse.ArgumentParser):
    """Reports bad input as one line (no usage block) and exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def int_at_least(low):
    def parse(text):
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    parse.__name__ = f"integer (>= {low})"  # argparse names the type in its error message
    return parse


def positive_float(text):
    value = float(text)
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be greater than 0, got {text}")
    return value


def port_number(text):
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number from 1 to 65535, got {value}")
    return value


positive_float.__name__ = "number (> 0)"
port_number.__name__ = "port"


def add_launch_arguments(parser, world_size, min_world_size, roles, rpc_transport):
    add = parser.add_argument
    add("--world_size", "--world-size", type=int_at_least(min_world_size), default=world_size,
        metavar="N", help=f"total number of processes: {roles}")
    add("--rank", type=int_at_least(0), default=None, metavar="R",
        help="run only this rank and start the others in other terminals or on other "
             "machines (same --world_size, --master_addr, --master_port, any order). "
             "Default: every rank on this machine, or the RANK that torchrun sets")
    add("--master_addr", "--master-addr", default="localhost", metavar="ADDR",
        help="address of rank 0, reachable by every rank; keep localhost unless the ranks "
             "run on several machines of a trusted network")
    add("--master_port", "--master-port", type=port_number, default=29500, metavar="PORT",
        help="port of rank 0's rendezvous")
    add("--init_timeout", "--init-timeout", type=positive_float, default=60.0,
        metavar="SECONDS", help="seconds to wait for every rank to join before giving up")
    add("--rpc_timeout", "--rpc-timeout", type=positive_float, default=60.0,
        metavar="SECONDS", help="seconds before an RPC without an answer fails and stops the run")
    add("--rpc_transport", "--rpc-transport", choices=("auto", "tcp"), default=rpc_transport,
        help="how RPC carries messages between processes of one machine: auto lets TensorPipe "
             "use shared memory, the quickest for small messages, but each process then keeps "
             "a thread polling it without pause, which on a small machine takes CPU time from "
             "the work; tcp uses loopback sockets, which wait idle. Between machines, TCP")
    add("--seed", type=int_at_least(0), default=1, metavar="N", help="random seed")
    add("--summary_json", "--summary-json", default=None, metavar="PATH",
        help="write the run's figures to this JSON file at the end")


def resolve_launch(parser, args, min_world_size):
    """Fill in rank and rendezvous from torchrun's environment when torchrun started us, and
    check that the rank fits the world and that rank 0 can listen where it must."""
    args.torchrun = args.rank is None and "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if args.torchrun:
        try:
            args.rank = int(os.environ["RANK"])
            args.world_size = int(os.environ["WORLD_SIZE"])
            args.master_addr = os.environ["MASTER_ADDR"]
            args.master_port = int(os.environ["MASTER_PORT"])
        except (KeyError, ValueError) as err:
            parser.error(f"torchrun's environment is incomplete: {err}")
        if args.world_size < min_world_size:
            parser.error(f"this example needs at least {min_world_size} processes, "
                         f"torchrun started {args.world_size}")
    if args.rank is not None and args.rank >= args.world_size:
        parser.error(f"--rank {args.rank} is outside a world of {args.world_size} "
                     f"(ranks 0 to {args.world_size - 1})")
    if not args.torchrun and args.rank in (None, 0):
        try:  # rank 0 will listen here: find out now if it cannot
            _listen(args.master_addr, args.master_port).close()
        except OSError as err:
            parser.error(f"cannot listen on {args.master_addr}:{args.master_port} "
                         f"({err.strerror or err}); if the port is in use, choose another "
                         f"with --master_port")


def probability(text):
    value = float(text)
    if not 0 <= value < 1:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be from 0 to less than 1, got {text}")
    return value


probability.__name__ = "probability"


def parse_args(argv=None):
    """Parse and check the command line; bad input ends here with one line and status 2,
    before any process starts."""
    parser = ArgumentParser(
        description="Distributed RNN with model parallelism: rank 0 (ps) holds the embedding "
                    "table and the decoder, the trainer holds the LSTM and trains all three "
                    "through RPC, distributed autograd and DistributedOptimizer. With a world "
                    "size above 2, each extra trainer trains a model of its own against the same "
                    "ps (trainers then named trainer1, trainer2, ...). Without --corpus: a "
                    f"synthetic task of {SYNTHETIC_NTOKEN} tokens (sequences counting up, "
                    "restarting at random), on the tutorial's tiny model. With --corpus: a "
                    "word-level language model of a text file; sizes that work there: "
                    "--emsize 64 --nhid 64 --bptt 35 --batch_size 20 --epochs 5.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    # auto (shared memory): the tiny model's iterations are small messages, latency-bound.
    add_launch_arguments(parser, world_size=2, min_world_size=2,
                         roles="ps (rank 0) and the trainers", rpc_transport="auto")
    add = parser.add_argument
    add("--corpus", default=None, metavar="PATH",
        help="train a word-level language model on this plain-text file (UTF-8; vocabulary "
             "from the file, <eos> at line ends) instead of the synthetic task")
    add("--epochs", type=int_at_least(1), default=10, metavar="N",
        help="passes over the training data")
    add("--max_batches", "--max-batches", type=int_at_least(1), default=None, metavar="N",
        help="end each epoch after this many batches (for short runs)")
    add("--bptt", type=int_at_least(1), default=5, metavar="N",
        help="time steps per batch (the tutorial's `batch`)")
    add("--batch_size", "--batch-size", type=int_at_least(1), default=3, metavar="N",
        help="sequences per batch (the tutorial's `nindices`)")
    add("--emsize", type=int_at_least(1), default=2, metavar="N",
        help="size of the word embeddings (the tutorial's `ninp`)")
    add("--nhid", type=int_at_least(1), default=3, metavar="N",
        help="hidden units per LSTM layer")
    add("--nlayers", type=int_at_least(1), default=1, metavar="N",
        help="LSTM layers (the tutorial has 4, which SGD cannot train at this size)")
    add("--dropout", type=probability, default=0.0, metavar="P",
        help="dropout of the embeddings, between LSTM layers and before the decoder (the "
             "tutorial has 0.5, which leaves too little of 2 or 3 units to learn from)")
    add("--lr", type=positive_float, default=1.0, metavar="RATE",
        help="SGD learning rate (the tutorial's 0.05 moves this model too slowly to see)")
    args = parser.parse_args(argv)
    resolve_launch(parser, args, min_world_size=2)
    if args.corpus is not None and args.rank != 0:  # ps needs no data
        try:
            _, tokens = load_corpus(args.corpus)
        except ValueError as err:
            parser.error(str(err))
        if len(tokens) < 2 * args.batch_size:
            parser.error(f"--corpus {args.corpus}: {len(tokens)} words (counting <eos>) are too "
                         f"few for --batch_size {args.batch_size}; need at least "
                         f"{2 * args.batch_size}")
    return args


def main(argv=None):
    args = parse_args(argv)
    _print_whole_lines()
    os.environ["MASTER_ADDR"] = args.master_addr  # where init_rpc's env:// rendezvous looks
    os.environ["MASTER_PORT"] = str(args.master_port)
    choose_network_interface(args.master_addr)
    if args.rank is None:
        spawn_all(args)
    else:
        run_rank(args.rank, args)


if __name__ == "__main__":
    main()
