"""Getting Started with Distributed RPC Framework, the RL part: the tutorial's code, in the
order of the pytorch/examples script distributed/rpc/rl/main.py, which holds it. Rank 0 is the
agent, which holds the policy and trains it; ranks 1.. are observers, each with its own
CartPole-v1 (Gymnasium). The agent starts every observer's episode with an RPC, and each
observer calls back (a nested RPC) for every action and to report every reward.

The tutorial is its 2020 revision, which the Japanese translation shows (README.md names the
revisions of both). Each line that is not the tutorial's ends with "# ours:" and why, also
where it is the script's. What is not the lesson (this project's flags and checks, the ranks'
names, the run's summary) is in extras.py. README.md maps the tutorial's sections to this file.

    python main.py                                  # every rank on this machine
    python main.py --world_size 2 --rank 1          # one rank per terminal
"""

import gymnasium as gym  # ours: Gymnasium, Gym's maintained successor (gym breaks on NumPy 2)
import numpy as np
import os
import sys  # ours: the command's exit status
import time  # ours: the summary's training time
from itertools import count

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.distributed.rpc import RRef, rpc_sync, rpc_async, remote  # ours: the script's line
from torch.distributions import Categorical

import rpc_harness  # ours: this project's package: `make run` installs it (or `pip install -e .`)
from extras import AGENT_NAME, OBSERVER_NAME, add_arguments, check_args  # ours: extras.py
from extras import discounted_returns, report  # ours: (above)

# ours: the script's 5000 steps an episode, shared by the observers (the tutorial's 100 keep
# every episode below CartPole's threshold of 475, so that it is never solved)
TOTAL_EPISODE_STEP = 5000  # ours: (above)

# ours: the pytorch/examples script's command line. The tutorial's flags, --world_size,
# --log_interval, --gamma and --seed, have no type= and default to 2, 1, 0.1 and 1. The
# script's have types, the spellings --world-size and --log-interval (both spellings work
# here), and the defaults 0.99, 543 and 10: 10, as in the tutorial's own sample output. The
# seed is the tutorial's, 1: with the script's 543, torch 2.4 to 2.6 sample actions that
# teach the policy to push one way only within 20 episodes, and it never learns again (found
# by make versions; README.md says more).
parser = rpc_harness.ArgumentParser(description='PyTorch RPC RL example')  # ours: the harness's
parser.add_argument('--world-size', type=int, default=2, metavar='W',  # ours: (above)
                    help='world size for RPC, rank 0 is the agent, others are observers')
parser.add_argument('--gamma', type=float, default=0.99, metavar='G',  # ours: (above)
                    help='discount factor (default: 0.99)')
parser.add_argument('--seed', type=int, default=1, metavar='N',  # ours: (above)
                    help='random seed (default: 1)')
parser.add_argument('--log-interval', type=int, default=10, metavar='N',  # ours: (above)
                    help='interval between training status logs (default: 10)')
add_arguments(parser)  # ours: this project's flags (extras.py); parsed in __main__, below


# Runs on the owner of rref: the method, called on the object that rref holds.
def _call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


# Calls the method on the object that rref holds, on its owner, and returns the result.
def _remote_method(method, rref, *args, **kwargs):
    args = [method, rref] + list(args)
    return rpc_sync(rref.owner(), _call_method, args=args, kwargs=kwargs)


class Policy(nn.Module):
    # the policy of pytorch/examples' reinforcement_learning example
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
    # Each observer has an environment of its own: it sends the agent each state, takes the
    # action that comes back, and reports the reward.
    def __init__(self, seed):  # ours: seed, as the tutorial's args exist in its command only
        self.id = rpc.get_worker_info().id
        self.env = gym.make('CartPole-v1')
        self.seed = seed + self.id  # ours: Gymnasium seeds at reset; observers differ

    def run_episode(self, agent_rref, n_steps):
        # one episode of at most n_steps steps
        state, ep_reward = self.env.reset(seed=self.seed)[0], 0  # ours: Gymnasium's reset
        self.seed = None  # ours: later resets go on from the seeded generator
        for step in range(n_steps):
            # the agent's action for this state
            action = _remote_method(Agent.select_action, agent_rref, self.id, state)

            # the action in the environment, and its reward
            state, reward, terminated, truncated, _ = self.env.step(action)  # ours: Gymnasium
            done = terminated or truncated  # ours: (above)

            # the reward to the agent, to train on
            _remote_method(Agent.report_reward, agent_rref, self.id, reward)

            if done:
                break


class Agent:
    def __init__(self, world_size, args, observer_class=Observer, device="cpu"):  # ours: batch.py
        self.ob_rrefs = []
        self.agent_rref = RRef(self)
        self.rewards = {}
        self.saved_log_probs = {}
        self.policy = Policy().to(device)  # ours: batch.py's GPU, where there is one
        self.optimizer = optim.Adam(self.policy.parameters(), lr=1e-2)
        self.eps = np.finfo(np.float32).eps.item()
        self.running_reward = 0
        self.reward_threshold = gym.make('CartPole-v1').spec.reward_threshold
        self.gamma = args.gamma  # ours: the command line, which the agent's process gets
        self.env_steps = 0  # ours: the summary's
        for ob_rank in range(1, world_size):
            ob_info = rpc.get_worker_info(OBSERVER_NAME.format(ob_rank))
            self.ob_rrefs.append(remote(ob_info, observer_class, args=(args.seed,)))  # ours
            self.rewards[ob_info.id] = []
            self.saved_log_probs[ob_info.id] = []

    def select_action(self, ob_id, state):
        # the policy's action for one observer's state; the log-probabilities are kept one list
        # an observer (no lock: the GIL runs one call at a time)
        state = torch.from_numpy(state).float().unsqueeze(0)
        probs = self.policy(state)
        m = Categorical(probs)
        action = m.sample()
        self.saved_log_probs[ob_id].append(m.log_prob(action))
        return action.item()

    def report_reward(self, ob_id, reward):
        # an observer's reward
        self.rewards[ob_id].append(reward)

    def run_episode(self, n_steps=0):
        # one episode on every observer, at once
        futs = []
        for ob_rref in self.ob_rrefs:
            # an asynchronous RPC starts each observer's episode
            futs.append(
                rpc_async(
                    ob_rref.owner(),
                    _call_method,
                    args=(Observer.run_episode, ob_rref, self.agent_rref, n_steps)
                )
            )

        # until every observer is done with it
        for fut in futs:
            fut.wait()

    def finish_episode(self):
        # the update, from every observer's episode; the running reward follows the shortest

        # the log-probabilities of every observer, and its rewards
        R, probs, rewards = 0, [], []
        for ob_id in self.rewards:
            probs.extend(self.saved_log_probs[ob_id])
            rewards.append(self.rewards[ob_id])  # ours: a list an observer (below)

        # the shortest episode makes the running reward
        min_reward = min([sum(self.rewards[ob_id]) for ob_id in self.rewards])
        self.running_reward = 0.05 * min_reward + (1 - 0.05) * self.running_reward

        # empty lists for the next episode
        for ob_id in self.rewards:
            self.rewards[ob_id] = []
            self.saved_log_probs[ob_id] = []

        # ours: each observer's episode discounted on its own, not across the others' (extras.py)
        policy_loss, returns = [], discounted_returns(rewards, self.gamma, self.eps)  # ours
        self.env_steps += len(returns)  # ours: the summary's
        for log_prob, R in zip(probs, returns):
            policy_loss.append(-log_prob * R)
        self.optimizer.zero_grad()
        policy_loss = torch.cat(policy_loss).sum()
        policy_loss.backward()
        self.optimizer.step()
        return min_reward


@rpc_harness.watched  # ours: this rank ends in one line if it fails or loses a peer
def run_worker(rank, world_size, args, agent_class=Agent):  # ours: args; batch.py's agent
    # every process runs this: rank 0 is the agent, the others are observers
    os.environ['MASTER_ADDR'] = args.master_addr  # ours: --master_addr, not 'localhost'
    os.environ['MASTER_PORT'] = str(args.master_port)  # ours: --master_port, not '29500'
    if rank == 0:
        # rank 0: the agent
        rpc.init_rpc(AGENT_NAME, rank=rank, world_size=world_size,  # ours: a comma, and below
                     rpc_backend_options=rpc_harness.options(args))  # ours: the harness's

        agent = agent_class(world_size, args)  # ours: (above)
        started = time.perf_counter()  # ours: the summary's training time
        for i_episode in count(1):
            rpc_harness.profile_step()  # ours: --profile's window; nothing without --profile
            n_steps = int(TOTAL_EPISODE_STEP / (args.world_size - 1))
            agent.run_episode(n_steps=n_steps)
            last_reward = agent.finish_episode()

            if i_episode % args.log_interval == 0:
                print('Episode {}\tLast reward: {:.2f}\tAverage reward: {:.2f}'.format(
                      i_episode, last_reward, agent.running_reward))

            if agent.running_reward > agent.reward_threshold:
                print("Solved! Running reward is now {}!".format(agent.running_reward))
                break
            if i_episode == args.max_episodes:  # ours: a bound on the run
                print(f"Stopped after {i_episode} episodes (--max_episodes), unsolved")  # ours
                break  # ours: (above)
        report(agent, i_episode, last_reward, time.perf_counter() - started)  # ours: summary
    else:
        # the other ranks: observers
        rpc.init_rpc(OBSERVER_NAME.format(rank), rank=rank, world_size=world_size,  # ours: below
                     rpc_backend_options=rpc_harness.options(args))  # ours: the harness's
        # an observer waits for the agent's calls
    rpc.shutdown()


def parse_args(argv=None):  # ours: the tutorial parsed its flags as the module loads, which
    args = parser.parse_args(argv)  # ours: spawn's processes would do again, with other argv
    check_args(parser, args)  # ours: what argparse cannot check (extras.py)
    return args  # ours: (above)


def main():  # ours: the script's main() (the tutorial calls mp.spawn at the top level)
    args = parse_args()  # ours: (above)
    rpc_harness.supervise(args)  # ours: this command ends in one line when a rank fails
    mp.set_start_method("spawn")  # ours: --rank's process starts afresh, as mp.spawn's
    if args.rank is not None:  # ours: one rank (--rank, or torchrun's), as the other tutorials
        p = mp.Process(target=run_worker, args=(args.rank, args.world_size, args))  # ours
        p.start()  # ours: (above)
        p.join()  # ours: (above)
        sys.exit(rpc_harness.exit_status(p))  # ours: the rank's status, with its line
    mp.spawn(
        run_worker,
        args=(args.world_size, args),  # ours: args
        nprocs=args.world_size,
        join=True
    )


if __name__ == '__main__':  # ours: the script's, as main() above
    main()
