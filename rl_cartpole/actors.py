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
writing it, but this project's (bounded waits, --profile, the summary), is marked "# ours:";
what those lines call is in monarch_extras.py. ACTORS.md says more.

    python actors.py                                # an agent and 1 observer
    python actors.py --world_size 5                 # an agent and 4 observers
"""

import argparse
import time
from itertools import count

import gymnasium as gym
import numpy as np
import torch
import torch.optim as optim
from torch.distributions import Categorical

import batch
import extras  # ours: the summary, as main.py's
import monarch_extras  # ours: bounded waits, --workers, --profile, the end in one line
from main import TOTAL_EPISODE_STEP, Policy

monarch_extras.import_monarch()  # ours: one line (status 2) where torchmonarch is missing
from monarch.actor import Actor, current_rank, endpoint, this_proc  # noqa: E402


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
        # ours: --profile: an observer serves, and records until stop_profile
        self.prof = monarch_extras.profiler(args.profile, f"observer{self.id}", self.id, False)

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

    # ours: --profile's end, and the process's peak memory, for the summary
    @endpoint
    async def stop_profile(self):
        self.prof.stop()

    @endpoint
    async def peak_memory_mb(self):
        return extras.peak_memory_mb()


class Agent(Actor):
    """The agent of main.py and batch.py: the same Policy, optimizer, gamma and update. It drives
    the observers itself. Each step it makes one forward pass for the states of every observer
    still playing (batch.py's; with one observer, main.py's select_action) and one call to the
    observers' mesh with their actions."""

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
        # ours: --profile: the agent loops, and records episodes 3 to 5
        self.prof = monarch_extras.profiler(args.profile, "agent", 0, True)

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

    async def answer(self, call):  # ours: --call_timeout bounds the wait for the observers
        return await monarch_extras.answer(call, self.call_timeout, "the observers")

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
        self.prof.step()  # ours: --profile's episodes
        return last_reward, self.running_reward, self.reward_threshold

    @endpoint
    async def figures(self):  # ours: the summary's
        self.prof.stop()  # and --profile's end, for a run of fewer than 5 episodes
        return {"env_steps": self.env_steps, "running_reward": self.running_reward,
                "solved": self.running_reward > self.reward_threshold}


def main(args):
    num_observers = args.world_size - 1
    # On this host (Monarch's this_host().spawn_procs); ours: or on the hosts of --workers, and
    # each line of every process written whole
    observer_procs = monarch_extras.spawn_procs(args, num_observers, monarch_extras.whole_lines)
    observers = observer_procs.spawn("observer", Observer, args)
    # this_proc(): the agent lives in this process, the controller's, as rank 0 in main.py.
    agent = this_proc().spawn("agent", Agent, num_observers, args)
    # The clock starts once every actor is up, as main.py's once its observers exist.
    observers.initialized.get()
    agent.initialized.get()
    started = time.perf_counter()
    for i_episode in count(1):
        # The agent plays an episode on every observer, main.py's number of steps at most. It
        # bounds each of its calls to the observers (--call_timeout).
        n_steps = int(TOTAL_EPISODE_STEP / num_observers)
        agent.run_episode.call_one(observers, n_steps).get()
        last_reward, running_reward, reward_threshold = agent.finish_episode.call_one().get()

        if i_episode % args.log_interval == 0:
            print('Episode {}\tLast reward: {:.2f}\tAverage reward: {:.2f}'.format(
                  i_episode, last_reward, running_reward))

        if running_reward > reward_threshold:
            print("Solved! Running reward is now {}!".format(running_reward))
            break
        if i_episode == args.max_episodes:  # ours: main.py's bound on the run
            print(f"Stopped after {i_episode} episodes (--max_episodes), unsolved")
            break
    # ours: the run's summary, as main.py's (extras.finish), with each process's peak memory
    seconds = time.perf_counter() - started
    figures = agent.figures.call_one().get()
    monarch_extras.get(observers.stop_profile.call(), args.call_timeout, "the observers")
    memory = {"agent (controller)": extras.peak_memory_mb()}
    observer_memory = monarch_extras.get(observers.peak_memory_mb.call(), args.call_timeout,
                                         "the observers")
    for point, megabytes in observer_memory.items():
        memory[f"observer{point.rank + 1}"] = megabytes
    extras.FIGURES.update(
        example="rl_cartpole", mode="monarch", episodes=i_episode, last_reward=last_reward,
        **figures, training_seconds=round(seconds, 3), observers=num_observers, gamma=args.gamma,
        steps_per_second=round(figures["env_steps"] / seconds, 1), peak_memory_mb=memory)
    # The observers' processes stop (ours: within --call_timeout); then the run's last line.
    monarch_extras.get(observer_procs.stop(), args.call_timeout, "the observers' processes")
    extras.finish(args, monarch_extras.NoProfile())


# ours: the command line (main.py's flags that apply, and Monarch's)
def parse_args(argv=None):
    """main.py's flags that apply (no rank, address or port: this command starts every
    process); this project's --max_episodes, --summary_json and --profile; Monarch's. Bad input
    ends the command here in one line (status 2)."""
    parser = argparse.ArgumentParser(
        description="main.py's agent and observers as Monarch actors: this command, the "
                    "controller, holds the agent and starts an observer actor in each of the "
                    "other processes.")
    parser.add_argument('--world_size', '--world-size', type=extras.at_least(2), default=2,
                        metavar='N', help='processes: the agent (this command) and the observers')
    parser.add_argument('--gamma', type=float, default=0.99, metavar='G',
                        help='discount factor')
    parser.add_argument('--seed', type=extras.at_least(0), default=1, metavar='N',
                        help="random seed (main.py's, the tutorial's)")
    parser.add_argument('--log_interval', '--log-interval', type=extras.at_least(1), default=10,
                        metavar='N', help='interval between training status logs')
    parser.add_argument("--max_episodes", "--max-episodes", type=extras.at_least(1),
                        default=2000, metavar="N", help="stop, unsolved, after this many episodes")
    parser.add_argument("--summary_json", "--summary-json", metavar="PATH",
                        help="write the run's figures to this JSON file at the end")
    parser.add_argument("--profile", metavar="DIR",
                        help="write each process's torch.profiler trace to DIR/<its name>.json: "
                             "the agent's episodes 3 to 5, an observer's whole run")
    monarch_extras.add_arguments(parser)
    args = parser.parse_args(argv)
    args.started = time.time()  # the summary's wall seconds
    monarch_extras.check_workers(parser, args, args.world_size - 1, "observers")
    if args.serve:
        return args
    if not 0 <= args.gamma <= 1:  # NaN too
        parser.error(f"argument --gamma: must be from 0 to 1, got {args.gamma}")
    if args.summary_json:
        extras.check_file(parser, "--summary_json", args.summary_json)
    if args.profile:
        extras.check_folder(parser, "--profile", args.profile)
    return args


if __name__ == "__main__":
    args = parse_args()
    monarch_extras.whole_lines()  # ours: each line written whole, as in Monarch's processes
    if args.serve:  # ours: this host's processes, for a controller elsewhere (--workers)
        monarch_extras.serve(args.serve)
    # ours: a failed, killed or hung process ends the command in one line (monarch_extras.py)
    monarch_extras.run(lambda: main(args), role="observer")
