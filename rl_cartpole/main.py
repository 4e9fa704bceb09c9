"""Getting Started with Distributed RPC Framework, the RL part: the tutorial's code, runnable.

Rank 0 is the agent, which holds the policy and trains it; ranks 1.. are observers, each with
its own CartPole-v1 (Gymnasium). The agent starts every observer's episode with an RPC, and each
observer calls back (a nested RPC) for every action and to report every reward. README.md says
what differs from the tutorial and why; batch.py runs the agent of the batch RPC tutorial, built
on the classes here. rpc_harness, this project's package, bounds every wait and ends every rank
in one line when one fails; each of its names is explained where main.py first uses it.

    python main.py                                  # every rank on this machine
    python main.py --world_size 2 --rank 1          # one rank per terminal
"""

import os
import sys
import time
from itertools import count

import gymnasium as gym
import numpy as np
import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.distributed.rpc import RRef, remote, rpc_async, rpc_sync
from torch.distributions import Categorical

try:
    import rpc_harness
except ModuleNotFoundError:
    raise SystemExit("rpc_harness, this project's package, is missing: install it with "
                     "`pip install -e PATH`, PATH being the repository's folder (the one that "
                     "holds pyproject.toml), or run `make run` there") from None


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


# Runs on the owner of rref: the method, called on the object that rref holds.
def _call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


# Calls the method on the object that rref holds, on its owner, and returns the result:
# _remote_method(some_func, rref, *args)
def _remote_method(method, rref, *args, **kwargs):
    args = [method, rref] + list(args)
    return rpc_sync(rref.owner(), _call_method, args=args, kwargs=kwargs)


class Observer:

    def __init__(self, seed):
        self.id = rpc.get_worker_info().id
        self.env = gym.make('CartPole-v1')
        # Gymnasium seeds through the first reset; seed + id, so that observers differ.
        self.seed = seed + self.id

    def run_episode(self, agent_rref, n_steps):
        state, _ = self.env.reset(seed=self.seed)
        self.seed = None  # later resets go on from the seeded generator
        for _ in range(n_steps):
            # ask the agent for an action for this state
            action = _remote_method(Agent.select_action, agent_rref, self.id, state)

            # take it in the environment, and get the reward
            state, reward, terminated, truncated, _ = self.env.step(action)

            # give the agent the reward, to train on
            _remote_method(Agent.report_reward, agent_rref, self.id, reward)

            if terminated or truncated:
                break


class Agent:
    def __init__(self, world_size, args, observer_class=Observer, device="cpu"):
        self.ob_rrefs = []
        self.agent_rref = RRef(self)
        self.rewards = {}
        self.saved_log_probs = {}
        self.policy = Policy().to(device)
        self.optimizer = optim.Adam(self.policy.parameters(), lr=1e-2)
        self.eps = np.finfo(np.float32).eps.item()
        self.running_reward = 0
        self.reward_threshold = gym.make('CartPole-v1').spec.reward_threshold
        self.gamma = args.gamma
        self.env_steps = 0
        for ob_rank in range(1, world_size):
            ob_info = rpc.get_worker_info(OBSERVER_NAME.format(ob_rank))
            self.ob_rrefs.append(remote(ob_info, observer_class, args=(args.seed,)))
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

    def run_episode(self, n_steps=0):
        futs = []
        for ob_rref in self.ob_rrefs:
            # start an episode on every observer, without waiting for it
            futs.append(
                rpc_async(
                    ob_rref.owner(),
                    _call_method,
                    args=(Observer.run_episode, ob_rref, self.agent_rref, n_steps)
                )
            )

        # then wait until every observer has finished its episode
        for fut in futs:
            fut.wait()

    def finish_episode(self):
        # joins probs from different observers into a list, and keeps rewards per observer
        probs, rewards = [], []
        for ob_id in self.rewards:
            probs.extend(self.saved_log_probs[ob_id])
            rewards.append(self.rewards[ob_id])

        # the running reward follows the shortest of the observers' episodes
        min_reward = min([sum(self.rewards[ob_id]) for ob_id in self.rewards])
        self.running_reward = 0.05 * min_reward + (1 - 0.05) * self.running_reward

        # start the next episode with empty lists
        for ob_id in self.rewards:
            self.rewards[ob_id] = []
            self.saved_log_probs[ob_id] = []

        policy_loss, returns = [], discounted_returns(rewards, self.gamma, self.eps)
        self.env_steps += len(returns)
        for log_prob, R in zip(probs, returns, strict=True):
            policy_loss.append(-log_prob * R)
        self.optimizer.zero_grad()
        policy_loss = torch.cat(policy_loss).sum()
        policy_loss.backward()
        self.optimizer.step()
        return min_reward


AGENT_NAME = "agent"
OBSERVER_NAME = "observer{}"  # the tutorial's "obs" gave every observer the same name
# CartPole-v1's own limit, 500, for every observer: the tutorial's 100, shared out among the
# observers, kept every episode below the 475 that "Solved!" needs.
TOTAL_EPISODE_STEP = gym.spec('CartPole-v1').max_episode_steps


# The tutorial's run_worker(rank, world_size), with the command line (args) and, for batch.py,
# the agent's class.
@rpc_harness.watched  # not in the tutorial: one line when this rank ends early
def run_worker(rank, world_size, args, agent_class=Agent):
    # The tutorial's 'localhost' and '29500', from --master_addr and --master_port.
    os.environ['MASTER_ADDR'] = args.master_addr
    os.environ['MASTER_PORT'] = str(args.master_port)
    if rank == 0:
        # rank 0 is the agent
        # rpc_harness.options(args): TensorPipe's options, meeting through rpc_harness, which joins
        # the ranks where MASTER_ADDR and MASTER_PORT say (as the default env:// would), with
        # bounded waits. The join installs in this rank the harness's loop (Ctrl-C, SIGTERM, the
        # watch over the other ranks, which ends every rank in one line when one is lost or fails),
        # its share of the cores and whole lines (README.md: "What the harness changes").
        rpc.init_rpc(AGENT_NAME, rank=rank, world_size=world_size,
                     rpc_backend_options=rpc_harness.options(args))
        torch.manual_seed(args.seed)

        agent = agent_class(world_size, args)
        started = time.perf_counter()
        for i_episode in count(1):
            # Not in the tutorial: rpc_harness.profile_step() counts the agent's steps (an
            # episode each), for the window that --profile records.
            rpc_harness.profile_step()
            agent.run_episode(n_steps=TOTAL_EPISODE_STEP)
            last_reward = agent.finish_episode()

            if i_episode % args.log_interval == 0:
                print('Episode {}\tLast reward: {:.2f}\tAverage reward: {:.2f}'.format(
                      i_episode, last_reward, agent.running_reward))

            if agent.running_reward > agent.reward_threshold:
                print("Solved! Running reward is now {}!".format(agent.running_reward))
                break
            if i_episode == args.max_episodes:
                print(f"Stopped after {i_episode} episodes (--max_episodes), unsolved")
                break
        # not in the tutorial: the summary's figures
        report(agent, i_episode, last_reward, time.perf_counter() - started)
    else:
        # other ranks are the observer
        rpc.init_rpc(OBSERVER_NAME.format(rank), rank=rank, world_size=world_size,
                     rpc_backend_options=rpc_harness.options(args))
        # observers passively waiting for instructions from the agent

    # block until all rpcs finish, and shutdown the RPC instance
    rpc.shutdown()


# --------- Not in the tutorial: returns, names, the summary -------------

def discounted_returns(rewards_per_observer, gamma, eps):
    """R_t = r_t + gamma * R_(t+1), discounted back from the end of each observer's own episode
    (the tutorial joined the episodes first), then normalised together."""
    returns = []
    for rewards in rewards_per_observer:
        R, observer_returns = 0, []
        for r in rewards[::-1]:
            R = r + gamma * R
            observer_returns.insert(0, R)
        returns.extend(observer_returns)
    returns = torch.tensor(returns)
    return (returns - returns.mean()) / (returns.std() + eps)


def worker_name(rank, world_size):
    """Each rank's name in RPC, which the harness's messages use too."""
    return AGENT_NAME if rank == 0 else OBSERVER_NAME.format(rank)


def report(agent, episodes, last_reward, seconds):
    """The run's figures: rpc_harness.report() keeps them for the summary that rank 0 writes at
    the end (write_summary)."""
    rpc_harness.report(
        mode=type(agent).__name__, episodes=episodes, last_reward=last_reward,
        running_reward=agent.running_reward, env_steps=agent.env_steps,
        solved=agent.running_reward > agent.reward_threshold, training_seconds=round(seconds, 3))


def write_summary(args, reports):
    """The run's figures and its one-line summary, from what the agent reported (report())."""
    agent = reports[AGENT_NAME]
    steps_per_second = agent["env_steps"] / agent["training_seconds"]
    return ({"example": "rl_cartpole", **agent, "observers": args.world_size - 1,
             "mode": "batch" if agent["mode"] == "BatchAgent" else "tutorial", "seed": args.seed,
             "gamma": args.gamma, "steps_per_second": round(steps_per_second, 1)},
            f"{agent['episodes']} episodes, {'solved' if agent['solved'] else 'not solved'}, "
            f"running reward {agent['running_reward']:.2f}, {agent['env_steps']} environment "
            f"steps at {steps_per_second:.1f} steps/s")


# --------- The tutorial's command line, and its __main__ --------------------

DESCRIPTION = ("RPC Reinforcement Learning Example: rank 0, the agent, trains a policy on "
               "CartPole-v1 with the episodes that the other ranks, the observers, play.")


def parse_args(argv=None):
    """The tutorial's command line, with this project's flags, checked (bad input ends the
    command here in one line, status 2). batch.py builds on make_parser() and check_args()."""
    parser = make_parser(DESCRIPTION)
    args = parser.parse_args(argv)
    check_args(parser, args)
    return args


def make_parser(description):
    """The parser of main.py's flags, which batch.py's are too."""
    # rpc_harness.ArgumentParser: argparse's, with every default in --help (the tutorial's
    # ArgumentDefaultsHelpFormatter) and errors in one line (status 2). rpc_harness.int_at_least(N),
    # unit_interval and port_number: argument types that refuse bad values, where the
    # tutorial's flags had none (a value given on the command line stayed a string).
    parser = rpc_harness.ArgumentParser(
        description=description,
    )

    parser.add_argument('--world_size', '--world-size', default=2,
                        type=rpc_harness.int_at_least(2), metavar='N',
                        help='Number of workers: the agent (rank 0) and the observers')
    # The tutorial's 1 logs every episode; 10, as its own sample output prints.
    parser.add_argument('--log_interval', '--log-interval', default=10,
                        type=rpc_harness.int_at_least(1), metavar='N',
                        help='Log every log_interval episodes')
    # The tutorial's 0.1 makes a step's return little more than its own reward, so the policy
    # learns almost nothing about what keeps the pole up; 0.99 is the upstream example's value.
    parser.add_argument('--gamma', default=0.99, type=rpc_harness.unit_interval, metavar='G',
                        help='how much to value future rewards')
    # The tutorial's --seed (default 1) is one of the flags that rpc_harness.add_arguments adds
    # below, to every example.

    # Not in the tutorial, which starts every rank on this machine: one rank a command, and
    # where rank 0 waits for the others (the tutorial's MASTER_ADDR and MASTER_PORT).
    parser.add_argument(
        "--rank",
        type=rpc_harness.int_at_least(0),
        default=None,
        help="""Global rank of this process: 0 for the agent, 1.. for the observers. Without
        it, every rank starts here (or torchrun's RANK).""")
    parser.add_argument(
        "--master_addr", "--master-addr",
        type=str,
        default=os.environ.get("MASTER_ADDR", "localhost"),
        help="""Address of the agent (rank 0), where every rank meets ($MASTER_ADDR if
        set); other than localhost, on a trusted network only.""")
    parser.add_argument(
        "--master_port", "--master-port",
        type=rpc_harness.port_number,
        default=os.environ.get("MASTER_PORT", "29500"),
        help="""Port that the agent (rank 0) listens on, where every rank meets
        ($MASTER_PORT if set).""")
    # Not in the tutorial, which trains until solved: a bound on the run.
    parser.add_argument("--max_episodes", "--max-episodes", type=rpc_harness.int_at_least(1),
                        default=2000, metavar="N", help="stop, unsolved, after this many episodes")
    # Then the flags that every example of this project has (timeouts, the transport, --seed,
    # --summary_json, --profile). auto (shared memory): a step is two tiny messages, so their
    # latency is what counts.
    rpc_harness.add_arguments(parser, rpc_transport="auto")
    return parser


def check_args(parser, args):
    """Not in the tutorial: what argparse cannot check. rpc_harness.check_args: the world, the
    rank, the address and port, --profile's folder; torchrun's RANK and WORLD_SIZE stand for
    --rank and --world_size; and args.harness records what rpc_harness needs in every rank
    (README: "What the harness changes")."""
    rpc_harness.check_args(parser, args, worker_name, computes=computes_nothing, loops=trains,
                           summary=write_summary)


def computes_nothing(rank, world_size):
    """No rank computes heavily: a policy this small gains nothing from threads, so every rank
    gets one."""
    return False


def trains(rank, world_size):
    """The rank that loops over episodes (the agent), whose steps --profile records."""
    return rank == 0


if __name__ == "__main__":
    args = parse_args()
    # Not in the tutorial: when a rank fails or is killed, or on Ctrl-C or SIGTERM, this
    # command stops the ranks it started and says why in one line.
    rpc_harness.supervise(args)
    # spawn, as mp.spawn starts its ranks: the rank that --rank names starts in a fresh
    # interpreter too, not in a fork of this one (Linux's default).
    mp.set_start_method("spawn")

    processes = []
    if args.rank is None:
        mp.spawn(
            run_worker,
            args=(args.world_size, args),
            nprocs=args.world_size,
            join=True
        )
    else:
        # Not in the tutorial: the one rank that --rank (or torchrun) names, in a process of
        # its own, as the parameter-server tutorial starts its ranks.
        p = mp.Process(target=run_worker, args=(args.rank, args.world_size, args))
        p.start()
        processes.append(p)

        for p in processes:
            p.join()
        # Not in the tutorial: the rank's exit status is the command's; rpc_harness.exit_status
        # says, in one line, when a signal killed the rank (which then could not say it).
        sys.exit(rpc_harness.exit_status(p))
