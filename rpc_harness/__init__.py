"""What every example shares, so that its main.py shows only its tutorial's code and calls.

cli: the command line (argparse's parser with one-line errors, argument types, the flags this
project adds, check_args). launch: the command that starts the ranks, ended in one line
(excepthook, on_sigterm). rendezvous: how the ranks meet (options() for init_rpc, init_method()
for init_process_group). rank: what a rank installs when it joins, the watch over its peers,
the summary (report). profiling: --profile (profile_step). compat: what torch 2.4 lacks.
Importing it changes nothing in the process: each change comes with the call that makes it."""

from .cli import ArgumentParser, add_arguments, check_args, check_folder, int_at_least
from .cli import port_number, positive_float, probability, unit_interval
from .launch import excepthook, on_sigterm
from .profiling import step as profile_step
from .rank import report
from .rendezvous import init_method, options
