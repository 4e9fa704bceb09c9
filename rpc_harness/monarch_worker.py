"""A Monarch worker: this host's share of the Monarch programs' processes, for a controller on
another host (`actors.py --workers tcp://THIS_HOST:PORT`).

    python -m rpc_harness.monarch_worker tcp://10.0.0.2:26600

Monarch's own `run_worker_loop_forever`: the worker waits for a controller to attach, starts
the processes it asks for, and when that controller is gone stops them and waits for the next.
Set here, before Monarch loads its configuration, unless the environment says otherwise
(monarch_runs.import_monarch(), as in the controller):

- HYPERACTOR_MESH_ORPHAN_TIMEOUT=5s: how long the processes of a controller that went away
  outlive it (monarch_runs.ORPHAN_TIMEOUT). At Monarch's
  default, a SIGKILLed controller's processes trained on for more than 160 s; at 5 s they were
  gone within 10.
- HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY=500ms (monarch_runs.SUPERVISION_POLL).

Ctrl-C or SIGTERM ends the worker and every process it started (status 130 or 143, one line).
The processes print in this worker's terminal. The worker needs this repository at the same
path as the controller's, and the same packages: the processes import the program's modules
from there.
"""

import os
import re
import signal

from . import monarch_runs
from .cli import ArgumentParser


def parse_args(argv=None):
    parser = ArgumentParser(
        prog="python -m rpc_harness.monarch_worker",
        description="Serve this host to a Monarch controller on another host: run the "
                    "processes of actors.py --workers tcp://THIS_HOST:PORT here.")
    parser.add_argument("address", metavar="tcp://HOST:PORT",
                        help="where the controller reaches this worker: this host's address "
                             "as the controller sees it, and a free port")
    args = parser.parse_args(argv)  # bad input: one line, status 2
    if not re.fullmatch(r"tcp://[^:/*]+:\d+", args.address):
        parser.error(f"{args.address}: expected tcp://HOST:PORT, HOST this host's address "
                     "(not *), as the controller reaches it")
    return args


def main(argv=None):
    args = parse_args(argv)
    # The orphan timeout and the supervision poll, unless set; one line if Monarch is missing.
    monarch_runs.import_monarch()
    from monarch.actor import run_worker_loop_forever

    def stop(number, frame):
        # The processes this worker started die with it (Monarch's PR_SET_PDEATHSIG).
        name = signal.Signals(number).name
        os.write(2, f"monarch_worker: interrupted ({name}); stopped every process\n".encode())
        os._exit(128 + number)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    print(f"monarch_worker: serving at {args.address}; Ctrl-C ends it", flush=True)
    run_worker_loop_forever(address=args.address, ca="trust_all_connections")


if __name__ == "__main__":
    main()
