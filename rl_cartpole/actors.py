"""The agent and its observers of main.py as Monarch actors: the same Policy, gamma, seeds,
episode cap and "Solved!" rule, on what PyTorch offers today beside RPC.

Monarch (PyPI: torchmonarch) is a single-controller framework: this command is the controller.
It starts the observers' processes itself, with an observer actor in each (a mesh of them), and
puts the agent in its own process, beside the loop that drives training. One call to the
observers' mesh starts every episode, where main.py loops over rpc_async futures; each observer
asks the agent for every action and reports every reward, as in main.py.

    python actors.py                                # an agent and 1 observer
    python actors.py --world_size 5                 # an agent and 4 observers
"""

import asyncio
import sys
import time
from itertools import count
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
import torch.optim as optim
from torch.distributions import Categorical

try:
    from rpc_harness import monarch_runs
except ModuleNotFoundError:
    raise SystemExit("rpc_harness, this project's package, is missing: install it with "
                     "`pip install -e PATH`, PATH being the repository's folder (the one that "
                     "holds pyproject.toml), or run `make run` there") from None

# Monarch's own names. monarch_runs.import_monarch() says in one line what is missing (status
# 2) where torchmonarch is not installed.
monarch = monarch_runs.import_monarch()
import batch  # noqa: E402
from monarch.actor import (  # noqa: E402
    Actor,
    concurrent_endpoint,
    current_rank,
    endpoint,
    this_proc,
)

import main as tutorial  # noqa: E402
from main import TOTAL_EPISODE_STEP, Policy  # noqa: E402

HERE = Path(__file__).resolve().parent


class Observer(Actor):

    def __init__(self, args):
        # current_rank(): this actor's place in the observers' mesh, 0..; main.py's observers
        # are ranks 1.., and their ids seed their environments.
        self.id = current_rank().rank + 1
        self.env = gym.make('CartPole-v1')
        # Gymnasium seeds through the first reset; seed + id, so that observers differ.
        self.seed = args.seed + self.id
        self.call_timeout = args.call_timeout
        self.recorder = monarch_runs.Recorder(args.profile, args.profile_steps, self.id,
                                              f"observer{self.id}")

    async def answer(self, call):
        """The agent's answer; --call_timeout bounds the wait."""
        return await monarch_runs.answer(call, self.call_timeout, "the agent")

    @endpoint
    async def run_episode(self, agent, n_steps):
        state, _ = self.env.reset(seed=self.seed)
        self.seed = None  # later resets go on from the seeded generator
        for step in range(n_steps):
            # ask the agent for an action for this state
            action = await agent.select_action.call_one(self.id, state)

            # take it in the environment, and get the reward
            state, reward, terminated, truncated, _ = self.env.step(action)

            # Give the agent the reward, to train on. No answer is needed: a one-way message
            # (broadcast), where main.py waits for one. The episode's last is a call: the agent
            # answers it after every reward before it (Monarch delivers one sender's messages
            # to an actor in order), so all are in before the controller ends the episode.
            if terminated or truncated or step == n_steps - 1:
                await agent.report_reward.call_one(self.id, reward)
                break
            agent.report_reward.broadcast(self.id, reward)

    @endpoint
    async def peak_memory_mb(self):
        return monarch_runs.peak_memory_mb()

    # Not in main.py: --profile's window, which the controller opens and closes.
    @endpoint
    async def start_profile(self):
        self.recorder.start()

    @endpoint
    async def stop_profile(self):
        self.recorder.stop()


class Agent(Actor):
    """main.py's Agent, with its select_action, report_reward and finish_episode as endpoints;
    only its construction differs: no RRefs, the observers are the controller's mesh."""

    def __init__(self, num_observers, args):
        torch.manual_seed(args.seed)  # the initial policy, as main.py's agent
        self.rewards = {}
        self.saved_log_probs = {}
        self.policy = Policy()
        self.optimizer = optim.Adam(self.policy.parameters(), lr=1e-2)
        self.eps = np.finfo(np.float32).eps.item()
        self.running_reward = 0
        self.reward_threshold = gym.make('CartPole-v1').spec.reward_threshold
        self.gamma = args.gamma
        self.env_steps = 0
        for ob_id in range(1, num_observers + 1):
            self.rewards[ob_id] = []
            self.saved_log_probs[ob_id] = []
        self.recorder = monarch_runs.Recorder(args.profile, args.profile_steps, 0, "agent")

    # main.py's methods, unchanged, run by `async def` endpoints (Monarch runs an actor's
    # endpoints on one event loop, all `async def` or all plain): an actor handles one message
    # at a time, as main.py's agent handles its RPCs (it takes no lock either).
    @endpoint
    async def select_action(self, ob_id, state):
        return tutorial.Agent.select_action(self, ob_id, state)

    @endpoint
    async def report_reward(self, ob_id, reward):
        tutorial.Agent.report_reward(self, ob_id, reward)

    @endpoint
    async def finish_episode(self):
        """main.py's finish_episode; the controller also gets the running reward."""
        last_reward = tutorial.Agent.finish_episode(self)
        return last_reward, self.running_reward, self.reward_threshold

    @endpoint
    async def figures(self):
        return {"env_steps": self.env_steps, "running_reward": self.running_reward,
                "solved": self.running_reward > self.reward_threshold}

    # Not in main.py: --profile's window, which the controller opens and closes.
    @endpoint
    async def start_profile(self):
        self.recorder.start()

    @endpoint
    async def stop_profile(self):
        self.recorder.stop()


class BatchObserver(Observer):
    """--batch: batch.py's BatchObserver, one call a step; it keeps its rewards and hands them
    to the agent when its episode is over."""

    @endpoint
    async def run_episode(self, agent, n_steps):
        state, _ = self.env.reset(seed=self.seed)
        rewards = []
        self.seed = None
        for _ in range(n_steps):
            action = await agent.select_action_batch.call_one(self.id, state)
            state, reward, terminated, truncated, _ = self.env.step(action)
            rewards.append(reward)
            if terminated or truncated:
                break
        # batch.py's agent learns that an observer is done from the future of its RPC; here
        # the observer tells it, with its rewards, and the agent stops waiting for its states.
        await agent.observer_finished.call_one(self.id, rewards)


class BatchAgent(Agent):
    """--batch: batch.py's BatchAgent. select_action_batch waits until every observer still
    playing has sent its state and answers them all with one forward pass: a concurrent
    endpoint (each call a task of the actor's event loop) that awaits a future of the batch's
    actions, as batch.py's @rpc.functions.async_execution function returns one. The update is
    batch.py's finish_episode."""

    def __init__(self, num_observers, args):
        super().__init__(num_observers, args)
        self.device = torch.device("cpu")  # batch.py's finish_episode moves the returns there
        self.num_observers = num_observers
        # The states waiting for the next forward pass, by observer id; the future that the
        # next forward pass completes with every observer's action; how many observers are
        # still playing; one entry per forward pass: its observer ids and log-probabilities.
        self.states = {}
        self.future_actions = asyncio.get_running_loop().create_future()
        self.playing = num_observers
        self.saved_log_probs = []

    @concurrent_endpoint
    async def select_action_batch(self, ob_id, state):
        self.states[ob_id] = state
        future_actions = self.future_actions
        self._act_if_all_states_are_in()
        return (await future_actions)[ob_id]

    def _act_if_all_states_are_in(self):
        """One forward pass for the states of all observers still playing, once each has sent
        one (batch.py's, with an asyncio future)."""
        if not self.states or len(self.states) < self.playing:
            return
        ob_ids = sorted(self.states)
        states = torch.from_numpy(np.stack([self.states[ob_id] for ob_id in ob_ids])).float()
        probs = self.policy(states)
        m = Categorical(probs)
        actions = m.sample()
        self.saved_log_probs.append((ob_ids, m.log_prob(actions)))
        future_actions = self.future_actions
        self.future_actions = asyncio.get_running_loop().create_future()
        self.states = {}
        future_actions.set_result(dict(zip(ob_ids, actions.tolist(), strict=True)))

    @concurrent_endpoint
    async def observer_finished(self, ob_id, rewards):
        """An observer's episode is over: stop waiting for its states, and take its rewards."""
        self.playing -= 1
        self._act_if_all_states_are_in()
        self.rewards[ob_id] = rewards

    @endpoint
    async def finish_episode(self):
        """batch.py's finish_episode; the controller also gets the running reward."""
        last_reward = batch.BatchAgent.finish_episode(self)
        self.playing = self.num_observers
        return last_reward, self.running_reward, self.reward_threshold


def profile(agent, observers, endpoint_name, timeout):
    """Open or close --profile's window on the agent and every observer (nothing without
    --profile)."""
    for actors, who in ((agent, "the agent"), (observers, "the observers")):
        monarch_runs.get(getattr(actors, endpoint_name).call(), timeout, who)


def setup_process():
    """Runs first in every observer's process (spawn_procs' bootstrap): main.py importable there
    too (a child process starts in this command's working folder), one thread (a policy this
    small gains nothing from more, as in main.py), and each line it prints written whole
    (monarch_runs.whole_lines)."""
    sys.path.insert(0, str(HERE))
    torch.set_num_threads(1)
    monarch_runs.whole_lines()


def main(args):
    num_observers = args.world_size - 1
    torch.set_num_threads(1)  # the agent, in this process, as setup_process() does for observers
    # On this host, or on the hosts of --workers (monarch_runs.spawn_procs).
    observer_procs = monarch_runs.spawn_procs(args, num_observers, bootstrap=setup_process)
    # --batch: batch.py's observers and agent, main.py's otherwise.
    observer_class, agent_class = (BatchObserver, BatchAgent) if args.batch else (Observer, Agent)
    observers = observer_procs.spawn("observer", observer_class, args)
    # this_proc(): the agent lives in this process, the controller's, as rank 0 in main.py.
    agent = this_proc().spawn("agent", agent_class, num_observers, args)
    timeout = args.call_timeout
    # The clock starts once every actor is up, as main.py's starts once its observers exist:
    # the processes' start is not training.
    monarch_runs.get(observers.initialized, args.init_timeout, "the observers' processes")
    monarch_runs.get(agent.initialized, args.init_timeout, "the agent")
    started = time.perf_counter()
    for i_episode in count(1):
        # Not in main.py: --profile's window, episodes 3 to 2 + --profile_steps.
        if i_episode - 1 == monarch_runs.WARMUP_STEPS:
            profile(agent, observers, "start_profile", timeout)
        if i_episode - 1 == monarch_runs.WARMUP_STEPS + args.profile_steps:
            profile(agent, observers, "stop_profile", timeout)
        # One call to the observers' mesh runs an episode on each; get() waits for all of them.
        episodes = observers.run_episode.call(agent, TOTAL_EPISODE_STEP)
        monarch_runs.get(episodes, timeout, "the observers")
        finished = agent.finish_episode.call_one()
        last_reward, running_reward, reward_threshold = monarch_runs.get(finished, timeout,
                                                                         "the agent")

        if i_episode % args.log_interval == 0:
            print('Episode {}\tLast reward: {:.2f}\tAverage reward: {:.2f}'.format(
                  i_episode, last_reward, running_reward))

        if running_reward > reward_threshold:
            print("Solved! Running reward is now {}!".format(running_reward))
            break
        if i_episode == args.max_episodes:
            print(f"Stopped after {i_episode} episodes (--max_episodes), unsolved")
            break
    seconds = time.perf_counter() - started
    profile(agent, observers, "stop_profile", timeout)  # a run shorter than the window
    if args.profile:
        names = ["agent"] + [f"observer{i}" for i in range(1, num_observers + 1)]
        print(monarch_runs.write_timeline(args.profile, names))
    figures = monarch_runs.get(agent.figures.call_one(), timeout, "the agent")
    memory = {"agent (controller)": monarch_runs.peak_memory_mb()}
    observer_memory = monarch_runs.get(observers.peak_memory_mb.call(), timeout, "the observers")
    for point, megabytes in observer_memory.items():
        memory[f"observer{point.rank + 1}"] = megabytes
    steps_per_second = figures["env_steps"] / seconds
    mode = "monarch batch" if args.batch else "monarch"
    summary = {"example": "rl_cartpole", "mode": mode, "episodes": i_episode,
               "last_reward": last_reward, **figures, "training_seconds": round(seconds, 3),
               "observers": num_observers, "seed": args.seed, "gamma": args.gamma,
               "steps_per_second": round(steps_per_second, 1)}
    line = (f"{i_episode} episodes, {'solved' if figures['solved'] else 'not solved'}, "
            f"running reward {running_reward:.2f}, {figures['env_steps']} environment steps at "
            f"{steps_per_second:.1f} steps/s")
    # The observers' processes stop, within --init_timeout; then the run's last line.
    monarch_runs.get(observer_procs.stop(), args.init_timeout, "the observers' processes")
    monarch_runs.write_summary(args, summary, line, memory)


def parse_args(argv=None):
    """main.py's flags that apply (no rank, address or port: this command starts every
    process); this project's --seed and --summary_json; Monarch's bound on waiting. Bad input
    ends the command here in one line (status 2)."""
    parser = monarch_runs.ArgumentParser(
        description="main.py's agent and observers as Monarch actors: this command, the "
                    "controller, holds the agent and starts an observer actor in each of the "
                    "other processes.")
    parser.add_argument('--world_size', '--world-size', default=2,
                        type=monarch_runs.int_at_least(2), metavar='N',
                        help='processes: the agent (this command) and the observers')
    parser.add_argument('--log_interval', '--log-interval', default=10,
                        type=monarch_runs.int_at_least(1), metavar='N',
                        help='Log every log_interval episodes')
    parser.add_argument('--gamma', default=0.99, type=monarch_runs.unit_interval, metavar='G',
                        help='how much to value future rewards')
    parser.add_argument('--seed', type=monarch_runs.int_at_least(0), default=543, metavar='N',
                        help="random seed (main.py's, the tutorial's)")
    parser.add_argument("--batch", action="store_true",
                        help="batch.py's agent and observers: one forward pass for the states of "
                             "every observer still playing, one call a step")
    parser.add_argument("--max_episodes", "--max-episodes", type=monarch_runs.int_at_least(1),
                        default=2000, metavar="N", help="stop, unsolved, after this many episodes")
    monarch_runs.add_arguments(parser)
    args = parser.parse_args(argv)
    monarch_runs.check_args(parser, args, args.world_size - 1, "observers")
    return args


if __name__ == "__main__":
    args = parse_args()
    # Not in Monarch's examples: each line this process prints written whole, as in every
    # actor's process (setup_process), so that two processes' lines never run into one.
    monarch_runs.whole_lines()
    # Not in Monarch's examples: a failed or killed actor process, an endpoint's error, Ctrl-C
    # or SIGTERM end this command and every process it started, in one line (README.md: "What
    # the harness changes").
    with monarch_runs.one_line_on_failure(role="observer"):
        main(args)
