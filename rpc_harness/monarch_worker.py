"""A Monarch worker: this host's share of the Monarch programs' processes, for a controller on
another host (`actors.py --workers tcp://THIS_HOST:PORT`).

    python -m rpc_harness.monarch_worker tcp://10.0.0.2:26600

Monarch's own `run_worker_loop_forever`: the worker waits for a controller to attach, starts
the processes it asks for, and when that controller is gone stops them and waits for the next.
monarch_runs.import_monarch() sets, as in the controller, how long the processes of a
controller that went away outlive it (5 s) and how often their health is checked.

Ctrl-C or SIGTERM ends the worker and every process it started (status 130 or 143, one line).
The processes print in this worker's terminal. The worker needs this repository at the same
path as the controller's, and the same packages: the processes import the program's modules
from there."""

from . import ending, monarch_runs
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
    if not monarch_runs.WORKER.fullmatch(args.address):
        parser.error(f"{args.address}: expected tcp://HOST:PORT, HOST this host's address "
                     "(not *), as the controller reaches it")
    return args


def main(argv=None):
    args = parse_args(argv)
    monarch_runs.import_monarch()  # one line if Monarch is missing
    from monarch.actor import run_worker_loop_forever

    def on_signal(number):
        name = ending.signal_name(number)
        monarch_runs.end(f"monarch_worker: interrupted ({name}); stopped every process",
                         128 + number)

    ending.on_signals(on_signal)
    print(f"monarch_worker: serving at {args.address}; Ctrl-C ends it", flush=True)
    run_worker_loop_forever(address=args.address, ca="trust_all_connections")


if __name__ == "__main__":
    main()
