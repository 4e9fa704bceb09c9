"""Getting Started with Distributed RPC Framework, the RL part: the tutorial's code as the
pytorch/examples script distributed/rpc/rl/main.py holds it, in its order. Rank 0 is the agent,
which holds the policy and trains it; ranks 1.. are observers, each with its own CartPole-v1
(Gymnasium). The agent starts every observer's episode with an RPC, and each observer calls back
(a nested RPC) for every action and to report every reward.

Each line that is not the script's ends with "# ours:" and why (a block of ours has the mark
above it). What is not the lesson (this project's flags and checks, --profile, the run's
summary) is in extras.py. README.md maps the tutorial's sections to this file.

    python main.py                                  # every rank on this machine
    python main.py --world_size 2 --rank 1          # one rank per terminal
    torchrun --nproc_per_node=2 main.py             # one rank per torchrun worker
"""

import argparse
import gymnasium as gym  # ours: Gymnasium, Gym's maintained successor (gym breaks on NumPy 2)
import numpy as np
import os
import sys  # ours: the status of a command that runs one rank
import time  # ours: the summary's training time
from itertools import count

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.distributed.rpc import RRef, rpc_sync, rpc_async, remote
from torch.distributions import Categorical

import extras  # ours: this project's flags and checks, --profile and the summary

TOTAL_EPISODE_STEP = 5000
AGENT_NAME = "agent"
OBSERVER_NAME = "observer{}"

parser = argparse.ArgumentParser(description='PyTorch RPC RL example')
# ours: --world_size, as the other tutorials spell it, and the script's --world-size
parser.add_argument('--world_size', '--world-size', type=int, default=2, metavar='W',
                    help='world size for RPC, rank 0 is the agent, others are observers '
                         '(default: %(default)s)')
parser.add_argument('--gamma', type=float, default=0.99, metavar='G',
                    help='discount factor (default: 0.99)')
# ours: the tutorial's seed, 1, not the script's 543: with 543, torch 2.4 to 2.6 learn to push
# one way only within 20 episodes, and never learn again (README.md says more)
parser.add_argument('--seed', type=int, default=1, metavar='N',
                    help='random seed (default: 1)')
# ours: --log_interval, and the script's --log-interval
parser.add_argument('--log_interval', '--log-interval', type=int, default=10, metavar='N',
                    help='interval between training status logs (default: 10)')
# ours: --rank, --master_addr, --max_episodes, ...; no abbreviated flags, errors in one line
extras.add_arguments(parser)


def _call_method(method, rref, *args, **kwargs):
    r"""
    a helper function to call a method on the given RRef
    """
    return method(rref.local_value(), *args, **kwargs)


def _remote_method(method, rref, *args, **kwargs):
    r"""
    a helper function to run method on the owner of rref and fetch back the
    result using RPC
    """
    args = [method, rref] + list(args)
    return rpc_sync(rref.owner(), _call_method, args=args, kwargs=kwargs)


class Policy(nn.Module):
    r"""
    Borrowing the ``Policy`` class from the Reinforcement Learning example.
    Copying the code to make these two examples independent.
    See https://github.com/pytorch/examples/tree/main/reinforcement_learning
    """
    def __init__(self):
        super(Policy, self).__init__()
        self.affine1 = nn.Linear(4, 128)
        self.dropout = nn.Dropout(p=0.6)
        self.affine2 = nn.Linear(128, 2)

        self.saved_log_probs = []
        self.rewards = []

    def forward(self, x):
        x = self.affine1(x)
        x = self.dropout(x)
        x = F.relu(x)
        action_scores = self.affine2(x)
        return F.softmax(action_scores, dim=1)

class Observer:
    r"""
    An observer has exclusive access to its own environment. Each observer
    captures the state from its environment, and send the state to the agent to
    select an action. Then, the observer applies the action to its environment
    and reports the reward to the agent.
    """
    def __init__(self, seed):  # ours: --seed, from the agent (the script reads its global args)
        self.id = rpc.get_worker_info().id
        self.env = gym.make('CartPole-v1')
        self.seed = seed + self.id  # ours: Gymnasium seeds at reset; each observer its own seed

    def run_episode(self, agent_rref, n_steps):
        r"""
        Run one episode of n_steps.

        Args:
            agent_rref (RRef): an RRef referencing the agent object.
            n_steps (int): number of steps in this episode
        """
        # ours: Gymnasium's reset, seeded the first time; later episodes go on from there
        state, ep_reward = self.env.reset(seed=self.seed)[0], 0
        self.seed = None
        for step in range(n_steps):
            # send the state to the agent to get an action
            action = _remote_method(Agent.select_action, agent_rref, self.id, state)

            # apply the action to the environment, and get the reward
            state, reward, terminated, truncated, _ = self.env.step(action)  # ours: Gymnasium's

            # report the reward to the agent for training purpose
            _remote_method(Agent.report_reward, agent_rref, self.id, reward)

            if terminated or truncated:  # ours: Gymnasium's end of an episode
                break

class Agent:
    def __init__(self, world_size, args):  # ours: the command's flags (the script: global args)
        self.ob_rrefs = []
        self.agent_rref = RRef(self)
        self.rewards = {}
        self.saved_log_probs = {}
        self.policy = Policy()
        self.optimizer = optim.Adam(self.policy.parameters(), lr=1e-2)
        self.eps = np.finfo(np.float32).eps.item()
        self.running_reward = 0
        self.reward_threshold = gym.make('CartPole-v1').spec.reward_threshold
        # ours: the discount factor, from the flags; the summary's count of environment steps
        self.gamma = args.gamma
        self.env_steps = 0
        for ob_rank in range(1, world_size):
            ob_info = rpc.get_worker_info(OBSERVER_NAME.format(ob_rank))
            self.ob_rrefs.append(remote(ob_info, Observer, args=(args.seed,)))  # ours: --seed
            self.rewards[ob_info.id] = []
            self.saved_log_probs[ob_info.id] = []

    def select_action(self, ob_id, state):
        r"""
        This function is mostly borrowed from the Reinforcement Learning example.
        See https://github.com/pytorch/examples/tree/main/reinforcement_learning
        The main difference is that instead of keeping all probs in one list,
        the agent keeps probs in a dictionary, one key per observer.

        NB: no need to enforce thread-safety here as GIL will serialize
        executions.
        """
        state = torch.from_numpy(state).float().unsqueeze(0)
        probs = self.policy(state)
        m = Categorical(probs)
        action = m.sample()
        self.saved_log_probs[ob_id].append(m.log_prob(action))
        return action.item()

    def report_reward(self, ob_id, reward):
        r"""
        Observers call this function to report rewards.
        """
        self.rewards[ob_id].append(reward)

    def run_episode(self, n_steps=0):
        r"""
        Run one episode. The agent will tell each oberser to run n_steps.
        """
        futs = []
        for ob_rref in self.ob_rrefs:
            # make async RPC to kick off an episode on all observers
            futs.append(
                rpc_async(
                    ob_rref.owner(),
                    _call_method,
                    args=(Observer.run_episode, ob_rref, self.agent_rref, n_steps)
                )
            )

        # wait until all obervers have finished this episode
        for fut in futs:
            fut.wait()

    def finish_episode(self):
        r"""
        This function is mostly borrowed from the Reinforcement Learning example.
        See https://github.com/pytorch/examples/tree/main/reinforcement_learning
        The main difference is that it joins all probs and rewards from
        different observers into one list, and uses the minimum observer rewards
        as the reward of the current episode.
        """

        # joins probs and rewards from different observers into lists
        R, probs, rewards = 0, [], []
        for ob_id in self.rewards:
            probs.extend(self.saved_log_probs[ob_id])
            rewards.append(self.rewards[ob_id])  # ours: a list an observer (below)

        # use the minimum observer reward to calculate the running reward
        min_reward = min([sum(self.rewards[ob_id]) for ob_id in self.rewards])
        self.running_reward = 0.05 * min_reward + (1 - 0.05) * self.running_reward

        # clear saved probs and rewards
        for ob_id in self.rewards:
            self.rewards[ob_id] = []
            self.saved_log_probs[ob_id] = []

        # ours: each observer's episode discounted on its own (extras.py), as the script's
        # joined list let one observer's last step take the next one's rewards; steps counted
        policy_loss, returns = [], extras.discounted_returns(rewards, self.gamma, self.eps)
        self.env_steps += len(returns)
        for log_prob, R in zip(probs, returns):
            policy_loss.append(-log_prob * R)
        self.optimizer.zero_grad()
        policy_loss = torch.cat(policy_loss).sum()
        policy_loss.backward()
        self.optimizer.step()
        return min_reward


def run_worker(rank, world_size, args):  # ours: args, parsed once by the command
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

        agent = Agent(world_size, args)  # ours: args
        started = time.perf_counter()  # ours: the summary's training time
        for i_episode in count(1):
            n_steps = int(TOTAL_EPISODE_STEP / (args.world_size - 1))
            agent.run_episode(n_steps=n_steps)
            last_reward = agent.finish_episode()
            profiler.step()  # ours: --profile records episodes 3 to 5

            if i_episode % args.log_interval == 0:
                print('Episode {}\tLast reward: {:.2f}\tAverage reward: {:.2f}'.format(
                      i_episode, last_reward, agent.running_reward))

            if agent.running_reward > agent.reward_threshold:
                print("Solved! Running reward is now {}!".format(agent.running_reward))
                break
            # ours: a bound on the run
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
    # ours: one rank (--rank, or torchrun's), in a process of its own, as the parameter-server
    # tutorial starts each rank; the rank's status is the command's (a signal N: 128 + N)
    if args.rank is not None:
        p = mp.Process(target=run_worker, args=(args.rank, args.world_size, args))
        p.start()
        p.join()
        sys.exit(p.exitcode if p.exitcode >= 0 else 128 - p.exitcode)
    mp.spawn(
        run_worker,
        args=(args.world_size, args),  # ours: args
        nprocs=args.world_size,
        join=True
    )

if __name__ == '__main__':
    args = parser.parse_args()  # ours: parsed here, once (the script: as the module loads)
    extras.check_args(parser, args)  # ours: what argparse cannot check; torchrun's rank
    main()
