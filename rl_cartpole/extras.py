"""What rl_cartpole's programs add beside the tutorial: this project's flags and the checks that
argparse cannot make, the returns of each observer's own episode, the ranks' names, and the
run's summary. main.py, batch.py and actors.py import it, so that each shows its tutorial's
code."""

import torch

import rpc_harness  # this project's package: `make run` installs it (or `pip install -e .`)

AGENT_NAME = "agent"
OBSERVER_NAME = "observer{}"  # the tutorial's "obs" gave every observer the same name


def add_arguments(parser):
    """The flags that this project adds to the tutorial's: one rank a command (--rank) and
    where the ranks meet, a bound on the run, then those of every RPC program
    (rpc_harness.add_arguments: timeouts, the transport, --summary_json, --profile). auto
    (shared memory) between ranks of one machine: a step is two tiny messages, so their latency
    is what counts."""
    parser.add_argument("--rank", type=int, default=None,
                        help="this process's rank: 0 for the agent, 1.. for the observers; "
                             "without it, every rank starts here (or torchrun's RANK)")
    parser.add_argument("--master_addr", default="localhost",
                        help="address of the agent (rank 0), where every rank meets; other "
                             "than localhost, on a trusted network only")
    parser.add_argument("--master_port", type=int, default=29500,
                        help="port that the agent (rank 0) listens on, where every rank meets")
    parser.add_argument("--max_episodes", type=rpc_harness.int_at_least(1), default=2000,
                        metavar="N", help="stop, unsolved, after this many episodes")
    rpc_harness.add_arguments(parser, rpc_transport="auto")


def check_args(parser, args):
    """What argparse cannot check (bad input: one line, status 2): the tutorial's flags and this
    project's (rpc_harness.check_args, which also records what the harness needs in every
    rank). No rank computes heavily: a policy this small gains nothing from threads, so every
    rank gets one. The agent's episodes are the steps that --profile records."""
    rpc_harness.check_args(parser, args, worker_name, computes=None,
                           loops=lambda rank, world_size: rank == 0, summary=write_summary)
    if not 0 <= args.gamma <= 1:
        parser.error(f"argument --gamma: must be from 0 to 1, got {args.gamma}")
    if args.seed < 0:
        parser.error(f"argument --seed: must be at least 0, got {args.seed}")
    if args.log_interval < 1:
        parser.error(f"argument --log_interval: must be at least 1, got {args.log_interval}")


def worker_name(rank, world_size):
    """Each rank's name in RPC, which the harness's lines use too."""
    return AGENT_NAME if rank == 0 else OBSERVER_NAME.format(rank)


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


def report(agent, episodes, last_reward, seconds):
    """The agent's figures, which rank 0 writes at the end (write_summary)."""
    rpc_harness.report(
        mode=type(agent).__name__, episodes=episodes, last_reward=last_reward,
        running_reward=agent.running_reward, env_steps=agent.env_steps,
        solved=agent.running_reward > agent.reward_threshold, training_seconds=round(seconds, 3))


def write_summary(args, reports):
    """The run's figures and its one-line summary, from what the agent reported."""
    agent = reports[AGENT_NAME]
    steps_per_second = agent["env_steps"] / agent["training_seconds"]
    return ({"example": "rl_cartpole", **agent, "observers": args.world_size - 1,
             "mode": "batch" if agent["mode"] == "BatchAgent" else "tutorial", "seed": args.seed,
             "gamma": args.gamma, "steps_per_second": round(steps_per_second, 1)},
            f"{agent['episodes']} episodes, {'solved' if agent['solved'] else 'not solved'}, "
            f"running reward {agent['running_reward']:.2f}, {agent['env_steps']} environment "
            f"steps at {steps_per_second:.1f} steps/s")
