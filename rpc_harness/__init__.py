"""What every example shares, so that its main.py shows only its tutorial's code and calls.

cli: the command line (argparse's parser with one-line errors, argument types, the flags this
project adds, check_args). launch: the command that starts the ranks, ended in one line
(excepthook, on_sigterm, exit_status). rendezvous: how the ranks meet (options() for init_rpc,
init_method() for init_process_group). rank: a rank's state from the join on, the one thread
that watches its peers and its signals, its end, the summary (report). profiling: --profile
(profile_step). compat: what torch 2.4 lacks. monarch_runs: what the Monarch programs share.
Importing it changes nothing in the process: each change comes with the call that makes it."""

from .cli import ArgumentParser, add_arguments, check_args, check_folder, int_at_least
from .cli import port_number, positive_float, probability, unit_interval
from .launch import excepthook, exit_status, on_sigterm
from .rank import profile_step, report
from .rendezvous import init_method, options
