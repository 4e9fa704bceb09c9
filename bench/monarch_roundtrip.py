"""Each way Monarch offers to move a tensor between two processes, for the payloads that
rpc_roundtrip.py sends over RPC: the controller and an actor in a process of its own.

- call: the controller calls an endpoint that returns its argument (`call_one(...).get()`),
  a round trip, as rpc_roundtrip.py's `rpc_sync` (the tensor goes both ways);
- one-way: the controller sends the tensor to an endpoint that answers nothing (`broadcast`),
  many in a row, then one call, which the actor answers after them: per message, one way;
- RDMABuffer: the actor reads the controller's tensor through an `RDMABuffer`
  (`read_into`), over its TCP fallback where the machine has no RDMA hardware
  (`monarch.configure(rdma_allow_tcp_fallback=True)`): per read, one way, timed in the actor.

- the same call with the tensor as a numpy array (`tensor.numpy()`): Monarch pickles a tensor
  through torch.save, and a numpy array as its bytes (param_server/actors.py sends numpy);
- a CartPole step's messages, actor to actor, both ways that rl_cartpole/actors.py has stepped:
  before, an actor in the other process calls an endpoint of an actor in the controller's
  (`await call_one(...)`, the state) and sends it a one-way message (`broadcast`, the reward),
  as its observer did; now, an actor in the controller's process calls the other process's mesh
  (`await call(...)`, the action out, the state and reward back), as its agent does. Per step;
  the RPC programs' step is two `rpc_sync` round trips (main.py) or one (batch.py).

--transport picks Monarch's channel between processes (`enable_transport`): "ipc" (Unix
sockets, Monarch's default on one host) or "tcp". Prints nothing; writes one JSON object:
{payload: {"monarch <transport>": [s a call, one per repetition],
"monarch <transport> one-way": [...], "monarch <transport> RDMABuffer": [...],
"monarch <transport> numpy": [...]}, "step": {"monarch <transport> step": [s a step, one per
repetition], "monarch <transport> mesh step": [...]}}.
"""

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import monarch
import numpy as np
import torch
from monarch.actor import Actor, enable_transport, endpoint, this_host, this_proc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rpc_roundtrip import SIZES, calls_for, time_per_call  # noqa: E402


class Echo(Actor):
    def __init__(self):
        self.received = 0

    @endpoint
    async def echo(self, tensor):
        return tensor

    @endpoint
    async def take(self, tensor):
        self.received += 1

    @endpoint
    async def received_count(self):
        return self.received

    @endpoint
    async def read(self, buffer, size, reads):
        """Seconds a read of `buffer` into a tensor of this process, over `reads` reads, and
        the first bytes read."""
        into = torch.empty(size, dtype=torch.uint8)
        await buffer.read_into(into)  # warm up
        started = time.perf_counter()
        for _ in range(reads):
            await buffer.read_into(into)
        return (time.perf_counter() - started) / reads, into[:8].tolist()


class Stepper(Actor):
    @endpoint
    async def mesh_steps(self, observers, count):
        """Seconds a step of rl_cartpole/actors.py's agent: an awaited call to the observers'
        mesh with the actions ({id: action}), which answers a CartPole state (4 float32), a
        reward and whether the episode is over."""
        answer = (np.zeros(4, dtype=np.float32), 1.0, False)
        await observers.echo.call(answer)  # warm up
        started = time.perf_counter()
        for _ in range(count):
            await observers.echo.call(answer)
        return (time.perf_counter() - started) / count

    @endpoint
    async def steps(self, echo, count):
        """Seconds a step of rl_cartpole/actors.py's observer before: an awaited call with a
        CartPole state (4 float32), then a one-way send of a reward (a float)."""
        state = np.zeros(4, dtype=np.float32)
        await echo.echo.call_one(state)  # warm up
        started = time.perf_counter()
        for _ in range(count):
            await echo.echo.call_one(state)
            echo.take.broadcast(1.0)
        await echo.received_count.call_one()  # every one-way message handled
        return (time.perf_counter() - started) / count


def one_thread():
    torch.set_num_threads(1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--transport", choices=("ipc", "tcp"), default="ipc")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    # "tcp" alone takes the address of this host's name, and panics where that is a loopback
    # one (a container's, or this 2-core VM's): the loopback address, given.
    enable_transport("ipc" if args.transport == "ipc" else "tcp://127.0.0.1:0")
    monarch.configure(rdma_allow_tcp_fallback=True)
    warnings.simplefilter("ignore")  # the TCP fallback's warning, once a buffer
    torch.set_num_threads(1)
    procs = this_host().spawn_procs(per_host={"procs": 1}, bootstrap=one_thread)
    echo = procs.spawn("echo", Echo)
    name = f"monarch {args.transport}"
    results = {}
    for label, size in SIZES.items():
        tensor = torch.randint(0, 255, (size,), dtype=torch.uint8)
        calls = calls_for(size)

        def call(tensor=tensor):
            echo.echo.call_one(tensor).get(timeout=60)

        def one_way(tensor=tensor, calls=calls):
            started = time.perf_counter()
            before = echo.received_count.call_one().get(timeout=60)
            for _ in range(calls):
                echo.take.broadcast(tensor)
            if echo.received_count.call_one().get(timeout=60) != before + calls:
                raise AssertionError("a one-way message was lost")
            return (time.perf_counter() - started) / calls

        from monarch.rdma import RDMABuffer

        buffer = RDMABuffer(tensor)
        array = tensor.numpy()

        def call_numpy(array=array):
            echo.echo.call_one(array).get(timeout=60)

        results[label] = {name: [], f"{name} one-way": [], f"{name} RDMABuffer": [],
                          f"{name} numpy": []}
        for _ in range(args.repeats):
            results[label][name].append(time_per_call(call, calls))
            results[label][f"{name} numpy"].append(time_per_call(call_numpy, calls))
            one_way()  # warm up
            results[label][f"{name} one-way"].append(one_way())
            seconds, first_bytes = echo.read.call_one(buffer, size, calls).get(timeout=120)
            if first_bytes != tensor[:8].tolist():
                raise AssertionError("an RDMABuffer read brought other bytes")
            results[label][f"{name} RDMABuffer"].append(seconds)
    # As in rl_cartpole/actors.py: the agent in the controller's process, the observer in the
    # other. Before, the observer called the agent; now the agent calls the observers' mesh.
    agent = this_proc().spawn("agent", Echo)
    observer = procs.spawn("observer", Stepper)
    driver = this_proc().spawn("driver", Stepper)
    results["step"] = {f"{name} step": [], f"{name} mesh step": []}
    for _ in range(args.repeats):
        results["step"][f"{name} step"].append(
            observer.steps.call_one(agent, 500).get(timeout=120))
        results["step"][f"{name} mesh step"].append(
            driver.mesh_steps.call_one(echo, 500).get(timeout=120))
    procs.stop().get(timeout=60)
    Path(args.out).write_text(json.dumps(results))


if __name__ == "__main__":
    sys.exit(main())
