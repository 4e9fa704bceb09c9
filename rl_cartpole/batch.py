"""The RL half of the tutorial "Implementing Batch RPC Processing Using Asynchronous Executions",
runnable, in the order of the pytorch/examples script distributed/rpc/batch/reinforce.py, with
main.py's policy, observers, training and command line.

The tutorial's agent runs one forward pass of the policy per observer and step, and each step
costs two RPCs. Here the agent waits until every observer still playing has sent its state, and
answers them all with one forward pass: `select_action_batch` is an
`@rpc.functions.async_execution` function that returns a future of the action at once, which
the RPC framework completes (and answers) when the batch's forward pass is done, freeing its
thread meanwhile. The observer makes one RPC a step, and returns its rewards at the end. The
training is main.py's, so that the two can be compared. README.md says more.

Built from the page's section "Batch-Processing CartPole Solver" (README.md names the
revision). Each line that is not the page's ends with "# ours:" and why, or a block of ours has
the mark above it.

    python batch.py --world_size 5                  # an agent and 4 observers
    python batch.py --world_size 3 --rank 1         # one rank per terminal
"""

import functools  # ours: run_episode's callbacks
import os
import sys  # ours: the status of a command that runs one rank
import threading
import time
from itertools import count  # ours: main.py's loop

import gymnasium as gym  # ours: main.py's environment, for its threshold
import numpy as np  # ours: the states, stacked
import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.optim as optim
from torch.distributed.rpc import RRef, remote, rpc_async, rpc_sync  # ours: sorted (ruff)
from torch.distributions import Categorical

import extras  # ours: this project's flags and checks, --profile and the summary
from main import (  # ours: main.py's names, policy, observer, helper and command line
    AGENT_NAME,
    OBSERVER_NAME,
    TOTAL_EPISODE_STEP,
    Observer,
    Policy,
    _call_method,
    parser,
)


# ours: the device in one place, as in every example (the page's agent calls .cuda())
def choose_device(gpu_count):
    """The policy goes on cuda:0 when there is a GPU, as in the batch tutorial, where one forward
    pass for all observers saves the most. gpu_count is a parameter so that tests can fake it."""
    return torch.device("cuda:0" if gpu_count > 0 else "cpu")


# ours: main.py's Observer, with a run_episode of its own. The page's observer plays n_steps
# steps whatever happens, resetting its environment when an episode ends, discounts the rewards
# itself, and returns them with the first episode's length; this one plays one episode, as
# main.py's, and returns its rewards, which the agent discounts as main.py's does.
class BatchObserver(Observer):
    def run_episode(self, agent_rref, n_steps):
        # ours: main.py's episode: Gymnasium's reset, seeded the first time, and the rewards in
        # a list (the page: a tensor of n_steps rewards, discounted here, and a reset mid-run)
        state, _ = self.env.reset(seed=self.seed)
        rewards = []
        self.seed = None
        for _ in range(n_steps):
            # One RPC a step. The page sends agent_rref along with every call; an RRef sent to
            # its owner costs both sides extra work (about a quarter of a step's CPU time
            # here), and the agent's worker is enough to find it.
            action = rpc_sync(agent_rref.owner(), BatchAgent.select_action_batch,
                              args=(self.id, state))
            state, reward, terminated, truncated, _ = self.env.step(action)
            rewards.append(reward)
            if terminated or truncated:
                break
        return rewards


# ours: one tensor of log-probabilities, in the order of the returns (docstring)
def log_probs_by_observer(saved_batches):
    """The log-probabilities of an episode's forward passes, saved as (observer ids,
    log-probabilities) per pass, in one tensor in the order of discounted_returns: observer
    after observer by id (a stable sort keeps each one's steps in order). Cut into one tensor
    per observer and step, as the tutorial's agent keeps them, the update's backward pass took
    1.7 times as long (150 against 87 ms for 500 passes of 4)."""
    row_ob_ids = [ob_id for ob_ids, _ in saved_batches for ob_id in ob_ids]
    order = sorted(range(len(row_ob_ids)), key=row_ob_ids.__getitem__)
    return torch.cat([log_probs for _, log_probs in saved_batches])[order]


# ours: this process's agent (rank 0's), for select_action_batch, which therefore needs no
# agent_rref (BatchObserver says why)
local_agent = None


class BatchAgent:  # ours: the page's Agent, named for what it adds
    def __init__(self, world_size, args):  # ours: main.py's flags (the page: batch=True)
        # ours: this process's agent, which select_action_batch answers for
        global local_agent
        local_agent = self
        self.ob_rrefs = []
        self.agent_rref = RRef(self)
        self.rewards = {}
        self.device = choose_device(torch.cuda.device_count())  # ours: the page: .cuda()
        self.policy = Policy().to(self.device)  # ours: main.py's Policy, on that device
        self.optimizer = optim.Adam(self.policy.parameters(), lr=1e-2)
        self.running_reward = 0
        # ours: main.py's agent's: its update's epsilon, its "Solved!" threshold, its discount
        # factor, the summary's count of environment steps
        self.eps = np.finfo(np.float32).eps.item()
        self.reward_threshold = gym.make('CartPole-v1').spec.reward_threshold
        self.gamma = args.gamma
        self.env_steps = 0

        for ob_rank in range(1, world_size):
            ob_info = rpc.get_worker_info(OBSERVER_NAME.format(ob_rank))
            self.ob_rrefs.append(remote(ob_info, BatchObserver, args=(args.seed,)))  # ours
            self.rewards[ob_info.id] = []

        # ours: the states waiting for the next forward pass, by observer id (the page: a
        # tensor with a row for each); as the page's, one entry per forward pass, here its
        # observer ids with their log-probabilities; and no `batch` flag, as this agent always
        # batches
        self.states = {}
        self.saved_log_probs = []
        self.future_actions = torch.futures.Future()
        self.lock = threading.Lock()
        self.playing = 0  # ours: the observers still playing (the page: pending_states)
        print(f"Agent: batched actions for {world_size - 1} observer(s), "  # ours: the device
              f"policy on {self.device}")

    @staticmethod
    @rpc.functions.async_execution
    def select_action_batch(ob_id, state):  # ours: no agent_rref (BatchObserver says why)
        r"""
        Batching select_action: In each step, the agent waits for states from
        all observers, and process them together. This helps to reduce the
        number of CUDA kernels launched and hence speed up amortized inference
        speed.
        """
        self = local_agent  # ours: the page: agent_rref.local_value()
        with self.lock:
            # ours: the state kept by id, under the lock; the action by id, as given; the
            # forward pass in _act_if_all_states_are_in, which _observer_finished calls too (the
            # page: copy_ into its row, .item(), and the pass here)
            self.states[ob_id] = state
            future_action = self.future_actions.then(lambda future: future.wait()[ob_id])
            self._act_if_all_states_are_in()
        return future_action

    # ours: the page's forward pass for the batch, which its last observer to call runs, here
    # run by whichever call or ending completes the batch
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
        # ours: each pass's observer ids with its log-probabilities, and the actions by id (the
        # page: one row of every observer's, and pending_states set again)
        self.saved_log_probs.append((ob_ids, m.log_prob(actions)))
        future_actions, self.future_actions = self.future_actions, torch.futures.Future()
        self.states = {}
        future_actions.set_result(dict(zip(ob_ids, actions.tolist(), strict=True)))

    # ours: an observer whose episode ended no longer holds up the others' batch
    def _observer_finished(self, ob_id, future_rewards):
        """An observer's episode is over: stop waiting for its states, and take its rewards (or
        raise its error)."""
        with self.lock:
            self.playing -= 1
            self._act_if_all_states_are_in()
        self.rewards[ob_id] = future_rewards.wait()

    # ours: main.py's run_episode, with each observer's end handled as it comes (the page's
    # ob_rref.rpc_async().run_episode(...), then its update, in one function)
    def run_episode(self, n_steps=0):
        self.playing = len(self.ob_rrefs)  # ours: every observer plays (_observer_finished)
        futs = []
        for ob_rref in self.ob_rrefs:
            # ours: main.py's call, with a callback that takes each observer's rewards as its
            # episode ends (the page: ob_rref.rpc_async().run_episode, and wait_all's results)
            fut = rpc_async(ob_rref.owner(), _call_method,
                            args=(BatchObserver.run_episode, ob_rref, self.agent_rref, n_steps))
            futs.append(fut.then(functools.partial(self._observer_finished, ob_rref.owner().id)))
        torch.futures.wait_all(futs)

    # ours: main.py's update (the page's: every step's rewards times its log-probabilities,
    # and a running reward of 0.5 * mean + 0.5 * previous), from one tensor of
    # log-probabilities (log_probs_by_observer)
    def finish_episode(self):
        rewards = list(self.rewards.values())
        min_reward = min(sum(ob_rewards) for ob_rewards in rewards)
        self.running_reward = 0.05 * min_reward + (1 - 0.05) * self.running_reward
        returns = extras.discounted_returns(rewards, self.gamma, self.eps).to(self.device)
        self.env_steps += len(returns)
        policy_loss = (-log_probs_by_observer(self.saved_log_probs) * returns).sum()
        self.saved_log_probs = []
        self.optimizer.zero_grad()
        policy_loss.backward()  # ours: main.py's (the page: policy_loss.sum().backward())
        self.optimizer.step()
        return min_reward  # ours: main.py's (the page: the mean and running reward)


def run_worker(rank, world_size, args):  # ours: main.py's flags (the page: n_episode, batch)
    r"""
    This is the entry point for all processes. The rank 0 is the agent. All
    other ranks are observers.
    """
    torch.manual_seed(args.seed)  # ours: the script's seed, in each rank, so that a run repeats
    os.environ['MASTER_ADDR'] = args.master_addr  # ours: --master_addr, not 'localhost'
    os.environ['MASTER_PORT'] = args.master_port  # ours: --master_port, not '29500'
    if rank == 0:
        # rank0 is the agent
        rpc.init_rpc(AGENT_NAME, rank=rank, world_size=world_size)
        profiler = extras.profile(args, loops=True)  # ours: --profile DIR; nothing without it

        agent = BatchAgent(world_size, args)  # ours: main.py's flags
        # ours: main.py's loop (the page: --num-episode episodes of 500 steps, each logged):
        # episodes until solved, --profile's step, and the summary's figures
        started = time.perf_counter()
        for i_episode in count(1):
            agent.run_episode(n_steps=int(TOTAL_EPISODE_STEP / (world_size - 1)))
            last_reward = agent.finish_episode()
            profiler.step()

            if i_episode % args.log_interval == 0:  # ours: main.py's (the page: print_log)
                print('Episode {}\tLast reward: {:.2f}\tAverage reward: {:.2f}'.format(
                    i_episode, last_reward, agent.running_reward))  # ours: main.py's figures

            # ours: main.py's end: solved, or --max_episodes played
            if agent.running_reward > agent.reward_threshold:
                print("Solved! Running reward is now {}!".format(agent.running_reward))
                break
            if i_episode == args.max_episodes:
                print(f"Stopped after {i_episode} episodes (--max_episodes), unsolved")
                break
        # ours: the run's figures, for the summary (extras.py)
        extras.figures(agent, i_episode, last_reward, time.perf_counter() - started)
    else:
        # other ranks are the observer
        rpc.init_rpc(OBSERVER_NAME.format(rank), rank=rank, world_size=world_size)
        profiler = extras.profile(args, loops=False)  # ours: --profile DIR; nothing without it
    store = extras.hold_store(args, rank)  # ours: rank 0's store, kept for rpc.shutdown()
        # observers passively waiting for instructions from agents
    rpc.shutdown()
    extras.release_store(args, rank, store)  # ours: (extras.hold_store says why)
    extras.finish(args, profiler)  # ours: --profile's trace; the agent's summary, last


def main():
    # ours: main.py's launch (the page's main() spawns worlds of 2 to 11 ranks, each with and
    # without batching, and times them: bench/ compares the two agents): one rank (--rank, or
    # torchrun's) in a process of its own, its status the command's; or every rank
    if args.rank is not None:
        p = mp.Process(target=run_worker, args=(args.rank, args.world_size, args))
        p.start()
        p.join()
        sys.exit(p.exitcode if p.exitcode >= 0 else 128 - p.exitcode)
    mp.spawn(
        run_worker,
        args=(args.world_size, args),  # ours: main.py's flags
        nprocs=args.world_size,  # ours: --world_size (the page: each of its worlds)
        join=True
    )


if __name__ == '__main__':
    args = parser.parse_args()  # ours: main.py's command line, parsed here, once
    extras.check_args(parser, args)  # ours: what argparse cannot check; torchrun's rank
    main()
