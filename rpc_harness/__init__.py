"""What every example shares, so that its main.py shows only its tutorial's code and calls.

cli: the command line (the parser, argument types, the flags this project adds, check_args).
command: the command that starts the ranks (supervise, exit_status). rank: a rank's life
(@watched, report, profile_step). rendezvous: how the ranks meet (options() for init_rpc,
init_method() for init_process_group). ending: the one way every process ends. profiling:
--profile. summary: the run's summary. compat: what torch 2.4 lacks. monarch_runs: what the
Monarch programs add. Importing it changes nothing in the process: each change comes with the
call that makes it."""

from .cli import ArgumentParser, add_arguments, check_args, check_folder, int_at_least
from .cli import port_number, positive_float, probability, share_of_the_cores, unit_interval
from .command import exit_status, supervise
from .rank import profile_step, report, watched
from .rendezvous import init_method, options
