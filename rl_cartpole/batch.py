"""The RL half of the tutorial "Implementing Batch RPC Processing Using Asynchronous Executions",
runnable, built on the classes of main.py.

The tutorial's agent runs one forward pass of the policy per observer and step, and each step
costs two RPCs. Here the agent waits until every observer still playing has sent its state, and
answers them all with one forward pass: `select_action_batch` is an
`@rpc.functions.async_execution` function that returns a future of the action at once, which
the RPC framework completes (and answers) when the batch's forward pass is done, freeing its
thread meanwhile. The observer makes one RPC a step, and returns its rewards at the end. The
training is the tutorial's, so that the two can be compared. README.md says more.

Built from the page's section "Batch-Processing CartPole Solver" (README.md names the
revision), on main.py's classes. Few of its lines are the page's: each block that is not ends
with, or starts with, a "# ours:" comment that says how and why it differs.

    python batch.py --world_size 5                  # an agent and 4 observers
"""

import functools  # ours: run_episode's callbacks
import os
import sys  # ours: the command's exit status
import threading

import numpy as np  # ours: the states, stacked
import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
from torch.distributed.rpc import rpc_async, rpc_sync  # ours: main.py's way of calling
from torch.distributions import Categorical

import rpc_harness  # ours: this project's package: `make run` installs it (or `pip install -e .`)

from extras import discounted_returns  # ours: main.py's returns
from main import Agent, Observer, _call_method, parse_args, run_worker  # ours: main.py's parts


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
            # ours: one RPC a step. The batch tutorial sends agent_rref along with every call;
            # an RRef sent to its owner costs both sides extra work (about a quarter of a step's
            # CPU time here), and the agent's worker is enough to find it.
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
local_agent = None  # ours: (above)


# ours: main.py's Agent, with the page's batched actions. The page's Agent takes a `batch` flag,
# keeps every observer's state in a fixed tensor and waits for all of them each step; this one
# keeps the states of the observers still playing, in a dict, and its update is main.py's.
class BatchAgent(Agent):
    def __init__(self, world_size, args):
        global local_agent
        local_agent = self
        self.device = choose_device(torch.cuda.device_count())
        super().__init__(world_size, args, observer_class=BatchObserver, device=self.device)
        print(f"Agent: batched actions for {world_size - 1} observer(s), "
              f"policy on {self.device}")
        # The states waiting for the next forward pass, by observer id; the future that the
        # next forward pass completes with every observer's action; how many observers are still
        # playing (the others will send no more states); and, as in the batch tutorial, one
        # entry per forward pass: its observer ids and their log-probabilities.
        self.lock = threading.Lock()
        self.states = {}  # ours: by observer id (the page: a tensor with a row for each)
        self.future_actions = torch.futures.Future()
        # ours: the observers still playing, not the page's pending_states; and no `batch` flag
        # (the page: `[] if batch else {...}`), as this agent always batches
        self.playing = 0
        self.saved_log_probs = []

    @staticmethod
    @rpc.functions.async_execution
    def select_action_batch(ob_id, state):  # ours: no agent_rref (above)
        self = local_agent  # ours: (above)
        with self.lock:
            # ours: the state kept by id, under the lock; the action by id, as given; the forward
            # pass in _act_if_all_states_are_in, which _observer_finished calls too (the page:
            # copy_ into its row, .item(), and the pass here)
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
            # episode ends (the page: ob_rref.rpc_async().run_episode, and the results of
            # wait_all)
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
        returns = discounted_returns(rewards, self.gamma, self.eps).to(self.device)
        self.env_steps += len(returns)
        policy_loss = (-log_probs_by_observer(self.saved_log_probs) * returns).sum()
        self.saved_log_probs = []
        self.optimizer.zero_grad()
        policy_loss.backward()  # ours: main.py's (the page: policy_loss.sum().backward())
        self.optimizer.step()
        return min_reward  # ours: main.py's (the page: the mean reward and the running reward)


# --------- ours: the __main__, with main.py's command line (parse_args) ------------

# ours: main.py's command line and launcher (the page's main() spawns worlds of 2 to 11 ranks,
# each with both agents, and times them: bench/ compares the two agents)
if __name__ == "__main__":
    args = parse_args()
    # The batch tutorial's run_worker sets these at its top, 'localhost' and '29500'. main.py's
    # run_worker, which the ranks run, sets them from the flags in each rank; here they are set
    # for this command too, as the parameter-server tutorial sets them, and the ranks inherit
    # them.
    os.environ['MASTER_ADDR'] = args.master_addr
    os.environ['MASTER_PORT'] = str(args.master_port)
    # When a rank fails or is killed, or on Ctrl-C or SIGTERM, this command stops the ranks it
    # started and says why in one line.
    rpc_harness.supervise(args)
    # spawn, as mp.spawn starts its ranks: the rank that --rank names starts in a fresh
    # interpreter too, not in a fork of this one (Linux's default).
    mp.set_start_method("spawn")

    processes = []
    if args.rank is None:
        # The page's mp.spawn, once, with this --world_size and the batching agent.
        mp.spawn(
            run_worker,
            args=(args.world_size, args, BatchAgent),
            nprocs=args.world_size,
            join=True
        )
    else:
        # The one rank that --rank (or torchrun) names, in a process of its own, as the
        # parameter-server tutorial starts its ranks.
        p = mp.Process(target=run_worker, args=(args.rank, args.world_size, args, BatchAgent))
        p.start()
        processes.append(p)

        for p in processes:
            p.join()
        # The rank's exit status is the command's; rpc_harness.exit_status says, in one line,
        # when a signal killed the rank (which then could not say it).
        sys.exit(rpc_harness.exit_status(p))
