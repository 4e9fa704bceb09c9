"""Distributed reinforcement learning over torch.distributed.rpc: one agent, several observers.

The runnable companion to the RL part of the PyTorch tutorial "Getting Started with Distributed
RPC Framework". Rank 0 is the agent, which holds the policy and trains it; ranks 1..N-1 are
observers, each with its own CartPole-v1 environment (Gymnasium). The agent starts an episode on
every observer with an RPC; during the episode each observer calls back into the agent (a nested
RPC) to choose every action and report every reward. `--batch` is the next step, from the
tutorial "Implementing Batch RPC Processing Using Asynchronous Executions": the agent answers all
observers' requests for an action with one forward pass of the policy.

    python rl_cartpole/main.py                              # every rank on this machine
    python rl_cartpole/main.py --world_size 5 --batch       # 4 observers, batched actions
    python rl_cartpole/main.py --world_size 2 --rank 1      # one rank per terminal
    torchrun --nproc_per_node 3 rl_cartpole/main.py         # under torchrun

See README.md beside this file for what differs from the tutorial, and `--help` for the flags.
"""

import argparse
import ctypes
import fcntl
import io
import ipaddress
import json
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
from functools import partial
from itertools import count
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.distributed.rpc import RRef, remote, rpc_async, rpc_sync
from torch.distributions import Categorical

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

AGENT_NAME = "agent"
# One name per observer: the tutorial's "obs" has no {}, so every observer got the same name.
OBSERVER_NAME = "observer{}"
# The most steps one observer takes in an episode: CartPole-v1's own limit, 500. The tutorial
# shares 100 steps among the observers, so no episode could reach the 475 that "Solved!" needs.
TOTAL_EPISODE_STEP = gym.spec("CartPole-v1").max_episode_steps


def choose_device(batch, gpu_count):
    """Where the agent keeps its policy. The tutorial runs it on the CPU; the batch tutorial
    puts it on the GPU, where one forward pass for all observers saves the most. `gpu_count` is
    passed in (normally torch.cuda.device_count()) so that this can be tested without GPUs."""
    return torch.device("cuda:0" if batch and gpu_count > 0 else "cpu")


class Policy(nn.Module):

    def __init__(self):
        super().__init__()
        self.affine1 = nn.Linear(4, 128)
        self.dropout = nn.Dropout(p=0.6)
        self.affine2 = nn.Linear(128, 2)

    def forward(self, x):
        x = self.affine1(x)
        x = self.dropout(x)
        x = F.relu(x)
        action_scores = self.affine2(x)
        return F.softmax(action_scores, dim=1)


# --------- Helper Methods --------------------

# On the worker that owns the RRef, call a method with the object it holds as `self`.
def _call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


# Run `method` on the object an RRef holds, on the worker that owns it, and return the result:
# _remote_method(Foo.bar, rref, arg) runs <foo instance>.bar(arg) there.
def _remote_method(method, rref, *args, **kwargs):
    args = [method, rref] + list(args)
    return rpc_sync(rref.owner(), _call_method, args=args, kwargs=kwargs)


# --------- Observer --------------------

class Observer:
    """Owns one environment. It waits for the agent to start an episode, then, step after step,
    asks the agent for an action and applies it."""

    def __init__(self, seed):
        self.id = rpc.get_worker_info().id
        self.env = gym.make("CartPole-v1")
        # Gymnasium seeds an environment through its first reset (there is no env.seed). Each
        # observer gets its own seed, so observers play different episodes, and a run repeats.
        self.next_seed = seed + self.id

    def reset(self):
        state, _ = self.env.reset(seed=self.next_seed)
        self.next_seed = None  # later resets go on from the seeded random generator
        return state

    def run_episode(self, agent_rref, n_steps):
        state = self.reset()
        for _ in range(n_steps):
            # send the state to the agent to get an action
            action = _remote_method(Agent.select_action, agent_rref, self.id, state)

            # apply the action to the environment, and get the reward
            state, reward, terminated, truncated, _ = self.env.step(action)

            # report the reward to the agent for training purpose
            _remote_method(Agent.report_reward, agent_rref, self.id, reward)

            if terminated or truncated:
                break

    def run_episode_batch(self, agent_rref, n_steps):
        """--batch: one RPC a step instead of two. The agent answers it once every observer still
        playing has sent its state; the rewards go back all at once, as this call's result."""
        state, rewards = self.reset(), []
        for _ in range(n_steps):
            # The batch tutorial sends agent_rref along every time; the agent's worker is enough
            # (see select_action_batch).
            action = rpc_sync(agent_rref.owner(), Agent.select_action_batch,
                              args=(self.id, state))
            state, reward, terminated, truncated, _ = self.env.step(action)
            rewards.append(reward)
            if terminated or truncated:
                break
        return rewards


# --------- Agent --------------------

def discounted_returns(rewards_per_observer, gamma, eps):
    """The return of every step, R_t = r_t + gamma * R_(t+1), each observer's episode discounted
    back from its own end, then all of them normalised together to mean 0 and deviation 1."""
    returns = []
    for rewards in rewards_per_observer:
        R, observer_returns = 0, []
        for r in rewards[::-1]:
            R = r + gamma * R
            observer_returns.insert(0, R)
        returns.extend(observer_returns)
    returns = torch.tensor(returns)
    return (returns - returns.mean()) / (returns.std() + eps)


def log_probs_by_observer(saved_batches):
    """--batch: the log-probabilities of all the forward passes of an episode, saved as
    (observer ids, log-probabilities) per pass, in one tensor ordered as discounted_returns
    orders the returns: observer after observer by id (a stable sort keeps each one's steps in
    order). Cut into one tensor per observer and step instead, as tutorial mode keeps them, the
    update's backward pass took 1.7 times as long (150 against 87 ms for 500 passes of 4)."""
    row_ob_ids = [ob_id for ob_ids, _ in saved_batches for ob_id in ob_ids]
    order = sorted(range(len(row_ob_ids)), key=row_ob_ids.__getitem__)
    return torch.cat([log_probs for _, log_probs in saved_batches])[order]


# The Agent object of this process (rank 0's), which select_action_batch works for.
local_agent = None


class Agent:
    def __init__(self, world_size, seed, gamma, batch=False):
        global local_agent
        local_agent = self
        self.ob_rrefs = []
        self.agent_rref = RRef(self)
        self.rewards = {}
        self.saved_log_probs = {}
        self.device = choose_device(batch, torch.cuda.device_count())
        self.policy = Policy().to(self.device)
        self.optimizer = optim.Adam(self.policy.parameters(), lr=1e-2)
        self.eps = np.finfo(np.float32).eps.item()
        self.running_reward = 0
        self.reward_threshold = gym.make("CartPole-v1").spec.reward_threshold
        self.gamma = gamma
        self.env_steps = 0
        self.batch = batch
        # --batch: the states waiting for the next forward pass, one per observer id; the future
        # that the next forward pass completes with every observer's action; how many observers
        # are still in the episode (the others will send no more states); and, as in the batch
        # tutorial, one entry per forward pass: its observer ids and their log-probabilities.
        self.lock = threading.Lock()
        self.states = {}
        self.future_actions = torch.futures.Future()
        self.playing = 0
        self.saved_batches = []
        for ob_rank in range(1, world_size):
            ob_info = rpc.get_worker_info(OBSERVER_NAME.format(ob_rank))
            self.ob_rrefs.append(remote(ob_info, Observer, args=(seed,)))
            self.rewards[ob_info.id] = []
            self.saved_log_probs[ob_info.id] = []

    def select_action(self, ob_id, state):
        state = torch.from_numpy(state).float().unsqueeze(0)
        probs = self.policy(state)
        m = Categorical(probs)
        action = m.sample()
        self.saved_log_probs[ob_id].append(m.log_prob(action))
        return action.item()

    def report_reward(self, ob_id, reward):
        self.rewards[ob_id].append(reward)

    @staticmethod
    @rpc.functions.async_execution
    def select_action_batch(ob_id, state):
        """--batch: instead of an action, return a future of one. The RPC framework sends the
        answer when the future completes, and meanwhile frees this thread for other requests.

        Unlike the batch tutorial's, this takes no agent_rref: an RRef sent to its owner costs
        both sides extra work on every call (here about a quarter of the CPU time of a step),
        and there is one agent, in this process."""
        self = local_agent
        with self.lock:
            self.states[ob_id] = state
            future_action = self.future_actions.then(lambda future: future.wait()[ob_id])
            self._act_if_all_states_are_in()
        return future_action

    def _act_if_all_states_are_in(self):
        """One forward pass for the states of all observers still playing, once each has sent
        one. Called with self.lock held."""
        if not self.states or len(self.states) < self.playing:
            return
        ob_ids = sorted(self.states)
        states = torch.from_numpy(np.stack([self.states[ob_id] for ob_id in ob_ids])).float()
        probs = self.policy(states.to(self.device))
        m = Categorical(probs)
        actions = m.sample()
        self.saved_batches.append((ob_ids, m.log_prob(actions)))
        future_actions, self.future_actions = self.future_actions, torch.futures.Future()
        self.states = {}
        future_actions.set_result(dict(zip(ob_ids, actions.tolist(), strict=True)))

    def _observer_finished(self, ob_id, future_rewards):
        """--batch: an observer's episode is over, so stop waiting for its states; take its
        rewards (or raise its error)."""
        with self.lock:
            self.playing -= 1
            self._act_if_all_states_are_in()
        self.rewards[ob_id] = future_rewards.wait()

    def run_episode(self, n_steps=0):
        futs = []
        self.playing = len(self.ob_rrefs)
        for ob_rref in self.ob_rrefs:
            # make async RPC to kick off an episode on all observers; while it runs, each
            # observer calls back into the agent (nested RPC) through the agent's RRef
            if self.batch:
                fut = rpc_async(ob_rref.owner(), _call_method,
                                args=(Observer.run_episode_batch, ob_rref, self.agent_rref,
                                      n_steps))
                fut = fut.then(partial(self._observer_finished, ob_rref.owner().id))
            else:
                fut = rpc_async(ob_rref.owner(), _call_method,
                                args=(Observer.run_episode, ob_rref, self.agent_rref, n_steps))
            futs.append(fut)

        # wait until all observers have finished this episode
        for fut in futs:
            fut.wait()

    def finish_episode(self):
        ob_ids = sorted(self.rewards)
        returns = discounted_returns([self.rewards[ob_id] for ob_id in ob_ids], self.gamma,
                                     self.eps).to(self.device)
        self.env_steps += len(returns)

        # use the minimum observer reward to calculate the running reward
        min_reward = min([sum(self.rewards[ob_id]) for ob_id in ob_ids])
        self.running_reward = 0.05 * min_reward + (1 - 0.05) * self.running_reward

        if self.batch:
            policy_loss = (-log_probs_by_observer(self.saved_batches) * returns).sum()
        else:
            # joins probs from different observers into a list
            probs = []
            for ob_id in ob_ids:
                probs.extend(self.saved_log_probs[ob_id])
            policy_loss = []
            for log_prob, R in zip(probs, returns, strict=True):
                policy_loss.append(-log_prob * R)
            policy_loss = torch.cat(policy_loss).sum()

        # clear saved probs and rewards
        for ob_id in ob_ids:
            self.rewards[ob_id] = []
            self.saved_log_probs[ob_id] = []
        self.saved_batches = []

        self.optimizer.zero_grad()
        policy_loss.backward()
        self.optimizer.step()
        return min_reward


# --------- Workers --------------------

def run_worker(rank, world_size, args):
    """Rank 0 is the agent, which trains until the running reward passes the environment's
    threshold (or --max_episodes); the other ranks are observers, which wait for its calls."""
    started = time.perf_counter()
    if rank == 0:
        init_rpc_with_timeout(AGENT_NAME, rank, world_size, args)
        torch.manual_seed(args.seed)
        # The policy is too small for a second thread to share its work: it would only spin
        # between operations, taking CPU time from the observers.
        torch.set_num_threads(1)

        agent = Agent(world_size, args.seed, args.gamma, args.batch)
        print(f"Agent: {'batched' if args.batch else 'tutorial'} actions for {world_size - 1} "
              f"observer(s), policy on {agent.device}")
        training_started = time.perf_counter()
        solved = False
        for i_episode in count(1):
            agent.run_episode(n_steps=TOTAL_EPISODE_STEP)
            last_reward = agent.finish_episode()

            if i_episode % args.log_interval == 0:
                print(f"Episode {i_episode}\tLast reward: {last_reward:.2f}\t"
                      f"Average reward: {agent.running_reward:.2f}")

            if agent.running_reward > agent.reward_threshold:
                print(f"Solved! Running reward is now {agent.running_reward}!")
                solved = True
                break
            if i_episode == args.max_episodes:
                print(f"Stopped after {i_episode} episodes (--max_episodes), unsolved: the "
                      f"running reward {agent.running_reward:.2f} has not passed "
                      f"{agent.reward_threshold}")
                break
        training_seconds = time.perf_counter() - training_started
        finish_and_shutdown(AGENT_NAME, world_size, args)
        write_summary(args, agent, i_episode, solved, last_reward, training_seconds,
                      time.perf_counter() - started)
    else:
        init_rpc_with_timeout(OBSERVER_NAME.format(rank), rank, world_size, args)
        # observers passively wait for instructions from the agent, and tell when it is gone
        finish_and_shutdown(OBSERVER_NAME.format(rank), world_size, args)


def worker_name(rank, world_size):
    return AGENT_NAME if rank == 0 else OBSERVER_NAME.format(rank)


def write_summary(args, agent, episodes, solved, last_reward, training_seconds, wall_seconds):
    summary = {
        "example": "rl_cartpole",
        "mode": "batch" if args.batch else "tutorial",
        "world_size": args.world_size,
        "observers": args.world_size - 1,
        "seed": args.seed,
        "gamma": args.gamma,
        "episodes": episodes,
        "solved": solved,
        "last_reward": last_reward,
        "running_reward": agent.running_reward,
        "reward_threshold": agent.reward_threshold,
        "env_steps": agent.env_steps,
        "training_seconds": round(training_seconds, 3),
        "steps_per_second": round(agent.env_steps / training_seconds, 1),
        "wall_seconds": round(wall_seconds, 3),
    }
    print(f"Summary: {episodes} episodes, {'solved' if solved else 'not solved'}, running reward "
          f"{agent.running_reward:.2f}, {summary['env_steps']} environment steps at "
          f"{summary['steps_per_second']} steps/s")
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


def unit_interval(text):
    value = float(text)
    if not 0 <= value <= 1:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be from 0 to 1, got {text}")
    return value


unit_interval.__name__ = "number (0 to 1)"


def parse_args(argv=None):
    """Parse and check the command line; bad input ends here with one line and status 2,
    before any process starts."""
    parser = ArgumentParser(
        description="RPC Reinforcement Learning Example: rank 0 is the agent, which trains a "
                    "policy on CartPole-v1 with the episodes that the other ranks, the "
                    "observers, play through RPC.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    # auto (shared memory): a step is two tiny messages, so their latency is what counts.
    add_launch_arguments(parser, world_size=2, min_world_size=2,
                         roles="the agent (rank 0) and the observers", rpc_transport="auto")
    add = parser.add_argument
    add("--batch", action="store_true",
        help="answer all observers' requests for an action with one forward pass of the policy "
             "(the batch RPC tutorial), instead of one forward pass per request")
    add("--gamma", type=unit_interval, default=0.99, metavar="G",
        help="discount factor: how much to value future rewards")
    add("--log_interval", "--log-interval", type=int_at_least(1), default=10, metavar="N",
        help="print the rewards every this many episodes")
    add("--max_episodes", "--max-episodes", type=int_at_least(1), default=2000, metavar="N",
        help="stop after this many episodes if the running reward has not passed the "
             "threshold by then")
    args = parser.parse_args(argv)
    resolve_launch(parser, args, min_world_size=2)
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
