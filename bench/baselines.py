"""The single-process baselines: each example's own model (imported from its folder) trained,
or played, in one process with no RPC, with the same data, batch sizes and optimizer as the
example, and the threads that one process would have: torch's default (every core), or one
where the example's rank computes with one thread whatever the cores. Prints one JSON object:
{baseline: rate}.

    python bench/baselines.py                     # every baseline
    python bench/baselines.py rl_cartpole_1 --scale 0.5
"""

import argparse
import json
import random
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.distributions import Categorical

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from example_modules import load_example  # noqa: E402 - the examples' modules, kept apart


def param_server(batches):
    """Net on the synthetic digits, batches of 32, SGD at 0.03, torch's default thread count
    (one process, every core): samples per second."""
    ps, ps_data = load_example("param_server"), load_example("param_server", "data")
    torch.manual_seed(1)
    net = ps.Net(num_gpus=0)
    opt = torch.optim.SGD(net.parameters(), lr=0.03)
    train_set = ps_data.synthetic_digits(ps_data.SYNTHETIC_TRAIN_SIZE, 1)
    loader = torch.utils.data.DataLoader(train_set, batch_size=32, shuffle=True)
    samples, started = 0, time.perf_counter()
    for i, (data, target) in enumerate(loader):
        if i >= batches:
            break
        opt.zero_grad()
        F.nll_loss(net(data), target).backward()
        opt.step()
        samples += len(data)
    return samples / (time.perf_counter() - started)


def rl_cartpole(episodes, environments):
    """The agent's policy and training, on `environments` CartPole environments stepped in this
    process: one forward pass a step for all the environments still playing (as batch.py and
    actors.py do; with one environment, as the tutorial does), one update an episode, its loss
    built as batch.py builds it (with one environment, the tutorial's sum from fewer autograd
    nodes). Seeded as rl_cartpole seeds agent and observers (--seed's default), so one
    environment plays the same episodes as a run with one observer. One thread: the policy is too
    small to gain from more. Environment steps per second."""
    import gymnasium as gym

    rl, rl_batch = load_example("rl_cartpole"), load_example("rl_cartpole", "batch")
    rl_extras = load_example("rl_cartpole", "extras")
    torch.set_num_threads(1)
    seed = rl.parser.get_default("seed")
    torch.manual_seed(seed)
    policy = rl.Policy()
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2)
    eps = np.finfo(np.float32).eps.item()
    envs = [gym.make("CartPole-v1") for _ in range(environments)]
    seeds = [seed + rank for rank in range(1, environments + 1)]  # seed + observer rank
    steps, started = 0, time.perf_counter()
    for _ in range(episodes):
        states = {i: env.reset(seed=seeds[i])[0] for i, env in enumerate(envs)}
        seeds = [None] * environments
        rewards = {i: [] for i in states}
        passes = []  # (environments, log-probabilities) of every forward pass, as batch.py keeps
        for _ in range(rl.TOTAL_EPISODE_STEP):
            playing = sorted(states)
            batch = torch.from_numpy(np.stack([states[i] for i in playing])).float()
            m = Categorical(policy(batch))
            actions = m.sample()
            passes.append((playing, m.log_prob(actions)))
            for row, i in enumerate(playing):
                state, reward, terminated, truncated, _ = envs[i].step(actions[row].item())
                rewards[i].append(reward)
                states[i] = state
                if terminated or truncated:
                    del states[i]
            if not states:
                break
        returns = rl_extras.discounted_returns([rewards[i] for i in sorted(rewards)], 0.99, eps)
        loss = (-rl_batch.log_probs_by_observer(passes) * returns).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        steps += len(returns)
    return steps / (time.perf_counter() - started)


def rnn_model_parallel(epochs):
    """The three parts of RNNModel in one process, on the synthetic task with the example's
    default sizes and SGD at its default rate: iterations per second."""
    rnn = load_example("rnn_model_parallel", "rnn")
    data = load_example("rnn_model_parallel", "data")
    torch.manual_seed(1)
    ntoken, emsize, nhid, batch_size, bptt = data.SYNTHETIC_NTOKEN, 2, 3, 3, 5
    table, lstm = rnn.EmbeddingTable(ntoken, emsize, 0.0), torch.nn.LSTM(emsize, nhid, 1)
    decoder = rnn.Decoder(ntoken, nhid, 0.0)
    params = [*table.parameters(), *lstm.parameters(), *decoder.parameters()]
    opt = torch.optim.SGD(params, lr=1.0)
    source = data.batchify(data.synthetic_tokens(data.SYNTHETIC_TOKENS, ntoken, 1), batch_size)
    hidden = (torch.randn(1, batch_size, nhid), torch.randn(1, batch_size, nhid))
    iterations, started = 0, time.perf_counter()
    for _ in range(epochs):
        for inputs, target in data.next_token_windows(source, bptt):
            hidden = (hidden[0].detach(), hidden[1].detach())
            output, hidden = lstm(table(inputs), hidden)
            loss = F.cross_entropy(decoder(output).view(-1, ntoken), target.view(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            iterations += 1
    return iterations / (time.perf_counter() - started)


def ddp_rpc_hybrid(batches):
    """EmbeddingBag(sum) and Linear(16, 8) on the example's batches, SGD at its rate:
    iterations per second."""
    hybrid = load_example("ddp_rpc_hybrid")
    extras = load_example("ddp_rpc_hybrid", "extras")  # main.py's batches, for remote_module.py
    torch.manual_seed(1)
    table = torch.nn.EmbeddingBag(hybrid.NUM_EMBEDDINGS, hybrid.EMBEDDING_DIM, mode="sum")
    dense = torch.nn.Linear(hybrid.EMBEDDING_DIM, extras.NUM_CLASSES)
    opt = torch.optim.SGD([*table.parameters(), *dense.parameters()], lr=0.05)  # the trainers'

    batches = list(extras.get_next_batch(random.Random(1), batches, torch.device("cpu")))
    started = time.perf_counter()
    for indices, offsets, target in batches:
        opt.zero_grad()
        F.cross_entropy(dense(table(indices, offsets)), target).backward()
        opt.step()
    return len(batches) / (time.perf_counter() - started)


def pipeline_parallel(batches):
    """The two ResNet-50 shards of pipeline_parallel in one process, on its batches (16 images
    of 64 x 64, the bench's size), SGD 0.05, torch's default threads: batches per second. Each
    shard takes the tutorial's device (cuda:0, cuda:1: a GPU if visible, else the CPU) and says
    which RPC worker holds it, so this builds them in an RPC world of one."""
    import os

    import torch.distributed.rpc as rpc

    pipeline = load_example("pipeline_parallel")
    data = load_example("pipeline_parallel", "data")
    os.environ.setdefault("TP_SOCKET_IFNAME", "lo")
    options = rpc.TensorPipeRpcBackendOptions(init_method="tcp://127.0.0.1:0",
                                              _transports=["uv"])
    rpc.init_rpc("worker1", rank=0, world_size=1, rpc_backend_options=options)
    try:
        torch.manual_seed(1)
        shards = [pipeline.ResNetShard1("cuda:0"), pipeline.ResNetShard2("cuda:1")]
        device = shards[0].device
        opt = torch.optim.SGD([p for shard in shards for p in shard.parameters()], lr=0.05)
        images = list(data.class_images(batches + 1, 16, 64, seed=1))
        for i, (inputs, labels) in enumerate(images):
            if i == 1:  # the first batch warms up, as in the example's figures
                started = time.perf_counter()
            outputs = shards[1].fc(torch.flatten(shards[1].seq(shards[0].seq(inputs.to(device))),
                                                 1))
            opt.zero_grad()
            F.cross_entropy(outputs, labels.to(device)).backward()
            opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return batches / (time.perf_counter() - started)
    finally:
        rpc.shutdown()


def baselines(scale):
    """{name: (function, its argument)}, each sized to last a second or two at scale 1."""
    return {
        "param_server": (param_server, max(1, round(60 * scale))),
        "rl_cartpole_1": (lambda episodes: rl_cartpole(episodes, 1), max(1, round(40 * scale))),
        "rl_cartpole_4": (lambda episodes: rl_cartpole(episodes, 4), max(1, round(30 * scale))),
        "rnn_model_parallel": (rnn_model_parallel, max(1, round(3 * scale))),
        "ddp_rpc_hybrid": (ddp_rpc_hybrid, max(1, round(300 * scale))),
        "pipeline_parallel": (pipeline_parallel, max(2, round(8 * scale))),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="baselines to run (default: all)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every length")
    args = parser.parse_args()
    chosen = baselines(args.scale)
    results = {}
    for name in args.names or chosen:
        function, length = chosen[name]
        threads = torch.get_num_threads()
        results[name] = function(length)
        torch.set_num_threads(threads)  # rl_cartpole sets 1
    # the process's peak memory, as the examples' summaries give each rank's: that of one
    # baseline when one ran
    results["peak_memory_mb"] = {"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}
    if torch.cuda.is_initialized():
        results["peak_memory_mb"]["cuda"] = torch.cuda.max_memory_allocated() // 2**20
    print(json.dumps(results))


if __name__ == "__main__":
    sys.exit(main())
