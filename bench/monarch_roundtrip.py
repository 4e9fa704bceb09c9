"""Monarch's round trip, as rpc_roundtrip.py measures RPC's: the controller calls an endpoint of
an actor in another process with a tensor, which the endpoint returns (`call_one(...).get()`),
for the same payloads. Prints one JSON object: {size: {"monarch": [seconds per round trip, one
per repetition]}}.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
from monarch.actor import Actor, endpoint, this_host

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rpc_roundtrip import SIZES, calls_for, time_per_call  # noqa: E402


class Echo(Actor):
    @endpoint
    def echo(self, tensor):
        return tensor


def one_thread():
    torch.set_num_threads(1)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    procs = this_host().spawn_procs(per_host={"procs": 1}, bootstrap=one_thread)
    echo = procs.spawn("echo", Echo)
    results = {}
    for label, size in SIZES.items():
        tensor = torch.randint(0, 255, (size,), dtype=torch.uint8)

        def over_monarch(tensor=tensor):
            echo.echo.call_one(tensor).get(timeout=60)

        results[label] = {"monarch": []}
        for _ in range(args.repeats):
            results[label]["monarch"].append(time_per_call(over_monarch, calls_for(size)))
    procs.stop().get(timeout=60)
    with open(args.out, "w") as out:
        json.dump(results, out)


if __name__ == "__main__":
    sys.exit(main())
