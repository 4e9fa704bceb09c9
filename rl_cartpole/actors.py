"""The agent and its observers of main.py and batch.py as Monarch actors: the same Policy,
gamma, seeds, episode cap and "Solved!" rule, on what PyTorch offers today beside RPC.

Monarch (PyPI: torchmonarch) is a single-controller framework: this command is the controller.
It starts the observers' processes itself, with an observer actor in each (a mesh of them), and
puts the agent in this process, as main.py's agent is rank 0. The agent steps every observer at
once: each step, one forward pass for the states of every observer still playing, as batch.py's
agent makes, and one call to the observers' mesh, which hands each observer its action and
brings back every state and reward. In main.py each observer makes two RPCs a step, and in
batch.py one.

Built from main.py and batch.py, whose training it does, written as Monarch's documentation
writes actors (https://meta-pytorch.org/monarch/, torchmonarch 0.7.0): Actor classes, async
endpoints, calls to whole meshes. Each line that is neither their work nor Monarch's way of
writing it, but this project's (bounded waits, --profile, the summary), is marked "# ours:".

    python actors.py                                # an agent and 1 observer
    python actors.py --world_size 5                 # an agent and 4 observers
"""

import sys
import time
from itertools import count
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
import torch.optim as optim
from torch.distributions import Categorical

try:  # ours: this project's package, or one line that says how to install it
    from rpc_harness import monarch_runs
except ModuleNotFoundError:  # ours: (above)
    raise SystemExit("rpc_harness, this project's package, is missing: install it with "
                     "`pip install -e PATH`, PATH being the repository's folder (the one that "
                     "holds pyproject.toml), or run `make run` there") from None

# Monarch's own names. ours: monarch_runs.import_monarch() says in one line what is missing
# (status 2) where torchmonarch is not installed.
monarch = monarch_runs.import_monarch()  # ours: (above)
import batch  # noqa: E402
from monarch.actor import (  # noqa: E402
    Actor,
    current_rank,
    endpoint,
    this_proc,
)

from main import TOTAL_EPISODE_STEP, Policy  # noqa: E402

HERE = Path(__file__).resolve().parent


class Observer(Actor):
    """An observer of main.py: its own CartPole environment. The agent steps it: each step, one
    call to the whole mesh of observers hands each observer its action and brings back every
    observer's state and reward."""

    def __init__(self, args):
        # current_rank(): this actor's place in the observers' mesh, 0..; main.py's observers
        # are ranks 1.., and their ids seed their environments.
        self.id = current_rank().rank + 1
        self.env = gym.make('CartPole-v1')
        # Gymnasium seeds through the first reset; seed + id, so that observers differ.
        self.seed = args.seed + self.id
        self.playing = False
        # ours: --profile's window (start_profile, stop_profile)
        self.recorder = monarch_runs.Recorder(args.profile, args.profile_steps, self.id,
                                              f"observer{self.id}")

    @endpoint
    async def reset(self):
        """A new episode: the first state."""
        state, _ = self.env.reset(seed=self.seed)
        self.seed = None  # later resets go on from the seeded generator
        self.playing = True
        return state

    @endpoint
    async def step(self, actions):
        """Take this observer's action, from the agent's {observer id: action}: the next state,
        the reward, and whether the episode is over. None from an observer whose episode is
        over already, which has no action."""
        if not self.playing:
            return None
        state, reward, terminated, truncated, _ = self.env.step(actions[self.id])
        self.playing = not (terminated or truncated)
        return state, reward, not self.playing

    # ours: the process's peak memory, for bench/, and --profile's window, which the
    # controller opens and closes
    @endpoint
    async def peak_memory_mb(self):
        return monarch_runs.peak_memory_mb()

    @endpoint
    async def start_profile(self):
        self.recorder.start()

    @endpoint
    async def stop_profile(self):
        self.recorder.stop()


class Agent(Actor):
    """The agent of main.py and batch.py: the same Policy, optimizer, gamma and update. It drives
    the observers itself. Each step it makes one forward pass for the states of every observer
    still playing (batch.py's; with one observer, main.py's select_action) and one call to the
    observers' mesh with their actions. main.py's observers instead each make two RPCs a step,
    and batch.py's one; this is one call for all of them."""

    def __init__(self, num_observers, args):
        torch.manual_seed(args.seed)  # the initial policy, as main.py's agent
        self.rewards = {ob_id: [] for ob_id in range(1, num_observers + 1)}
        # one entry a forward pass: its observer ids and their log-probabilities (batch.py's)
        self.saved_log_probs = []
        self.device = torch.device("cpu")  # batch.py's finish_episode moves the returns there
        self.policy = Policy()
        self.optimizer = optim.Adam(self.policy.parameters(), lr=1e-2)
        self.eps = np.finfo(np.float32).eps.item()
        self.running_reward = 0
        self.reward_threshold = gym.make('CartPole-v1').spec.reward_threshold
        self.gamma = args.gamma
        self.env_steps = 0
        self.call_timeout = args.call_timeout  # ours: the bound on each wait (answer)
        self.recorder = monarch_runs.Recorder(args.profile, args.profile_steps, 0, "agent")  # ours

    def select_actions(self, states):
        """One forward pass for {observer id: state}: {observer id: action}. The log-probabilities
        are kept for the update, as batch.py's agent keeps them."""
        ob_ids = sorted(states)
        state_batch = torch.from_numpy(np.stack([states[ob_id] for ob_id in ob_ids])).float()
        probs = self.policy(state_batch)
        m = Categorical(probs)
        actions = m.sample()
        self.saved_log_probs.append((ob_ids, m.log_prob(actions)))
        return dict(zip(ob_ids, actions.tolist(), strict=True))

    async def answer(self, call):  # ours: (above)
        """The observers' answers; --call_timeout bounds the wait."""
        return await monarch_runs.answer(call, self.call_timeout, "the observers")

    @endpoint
    async def run_episode(self, observers, n_steps):
        """One episode on every observer at once, as main.py's run_episode, stepped from here."""
        states = {}
        for point, state in (await self.answer(observers.reset.call())).items():
            states[point.rank + 1] = state
            self.rewards[point.rank + 1] = []
        for _ in range(n_steps):
            actions = self.select_actions(states)
            # One call to the observers' mesh: the actions out, every observer's step back.
            steps = await self.answer(observers.step.call(actions))
            states = {}
            for point, step in steps.items():
                if step is None:  # this observer's episode was over already
                    continue
                state, reward, done = step
                self.rewards[point.rank + 1].append(reward)
                if not done:
                    states[point.rank + 1] = state
            if not states:
                break

    @endpoint
    async def finish_episode(self):
        """batch.py's finish_episode (main.py's update, from one tensor of log-probabilities);
        the controller also gets the running reward."""
        last_reward = batch.BatchAgent.finish_episode(self)
        return last_reward, self.running_reward, self.reward_threshold

    @endpoint
    async def figures(self):
        return {"env_steps": self.env_steps, "running_reward": self.running_reward,
                "solved": self.running_reward > self.reward_threshold}

    # ours: --profile's window, which the controller opens and closes
    @endpoint
    async def start_profile(self):
        self.recorder.start()

    @endpoint
    async def stop_profile(self):
        self.recorder.stop()


# ours: profile and setup_process: --profile's window, and what each process needs
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
    torch.set_num_threads(1)  # ours: the agent, in this process, as setup_process()'s observers
    # On this host (Monarch's this_host().spawn_procs), or, ours, on the hosts of --workers.
    observer_procs = monarch_runs.spawn_procs(args, num_observers, bootstrap=setup_process)
    observers = observer_procs.spawn("observer", Observer, args)
    # this_proc(): the agent lives in this process, the controller's, as rank 0 in main.py.
    agent = this_proc().spawn("agent", Agent, num_observers, args)
    timeout = args.call_timeout
    # ours: each wait bounded, from here down (monarch_runs.get). The clock starts once every
    # actor is up, as main.py's starts once its observers exist: the processes' start is not
    # training.
    monarch_runs.get(observers.initialized, args.init_timeout, "the observers' processes",
                     "--init_timeout")
    monarch_runs.get(agent.initialized, args.init_timeout, "the agent",
                     "--init_timeout")
    started = time.perf_counter()
    for i_episode in count(1):
        # ours: --profile's window, episodes 3 to 2 + --profile_steps
        if i_episode - 1 == monarch_runs.WARMUP_STEPS:
            profile(agent, observers, "start_profile", timeout)
        if i_episode - 1 == monarch_runs.WARMUP_STEPS + args.profile_steps:
            profile(agent, observers, "stop_profile", timeout)
        # The agent plays an episode on every observer, main.py's number of steps at most.
        n_steps = int(TOTAL_EPISODE_STEP / num_observers)
        # The agent bounds each of its calls to the observers by --call_timeout, and says which
        # did not answer; the episode, reset included, makes n_steps + 1 of them at most. So
        # this bound is a backstop, which the agent's own bound always beats.
        episode_bound = timeout * (n_steps + 1)
        monarch_runs.get(agent.run_episode.call_one(observers, n_steps), episode_bound,
                         "the agent")
        finished = agent.finish_episode.call_one()
        last_reward, running_reward, reward_threshold = monarch_runs.get(finished, timeout,
                                                                         "the agent")

        if i_episode % args.log_interval == 0:
            print('Episode {}\tLast reward: {:.2f}\tAverage reward: {:.2f}'.format(
                  i_episode, last_reward, running_reward))

        if running_reward > reward_threshold:
            print("Solved! Running reward is now {}!".format(running_reward))
            break
        if i_episode == args.max_episodes:  # ours: main.py's bound on the run
            print(f"Stopped after {i_episode} episodes (--max_episodes), unsolved")
            break
    # ours: the run's summary, as main.py's, with each process's peak memory; --profile's end
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
    mode = "monarch"
    summary = {"example": "rl_cartpole", "mode": mode, "episodes": i_episode,
               "last_reward": last_reward, **figures, "training_seconds": round(seconds, 3),
               "observers": num_observers, "seed": args.seed, "gamma": args.gamma,
               "steps_per_second": round(steps_per_second, 1)}
    line = (f"{i_episode} episodes, {'solved' if figures['solved'] else 'not solved'}, "
            f"running reward {running_reward:.2f}, {figures['env_steps']} environment steps at "
            f"{steps_per_second:.1f} steps/s")
    # The observers' processes stop, within --init_timeout; then the run's last line.
    monarch_runs.get(observer_procs.stop(), args.init_timeout, "the observers' processes",
                     "--init_timeout")
    monarch_runs.write_summary(args, summary, line, memory)


# ours: the command line (main.py's flags, and Monarch's bounds on waiting)
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
    parser.add_argument('--seed', type=monarch_runs.int_at_least(0), default=1, metavar='N',
                        help="random seed (main.py's, the tutorial's)")
    parser.add_argument("--max_episodes", "--max-episodes", type=monarch_runs.int_at_least(1),
                        default=2000, metavar="N", help="stop, unsolved, after this many episodes")
    monarch_runs.add_arguments(parser)
    args = parser.parse_args(argv)
    monarch_runs.check_args(parser, args, args.world_size - 1, "observers")
    return args


if __name__ == "__main__":
    args = parse_args()
    # ours: each line this process prints written whole, as in every actor's process
    # (setup_process), so that two processes' lines never run into one
    monarch_runs.whole_lines()
    # ours: a failed or killed actor process, an endpoint's error, Ctrl-C or SIGTERM end this
    # command and every process it started, in one line (docs/harness.md)
    with monarch_runs.one_line_on_failure(role="observer"):
        main(args)
