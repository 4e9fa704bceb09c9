"""What every example shares, so that its main.py holds the tutorial's code, calls included:
cli, the command line (and what torch reads as it loads: imported first); launch, spawn();
rendezvous, how the ranks meet, watch each other, end; profiling, --profile; compat, torch 2.4."""

from .cli import ArgumentParser, add_arguments, check_folder, int_at_least, parse_args
from .cli import positive_float, probability, unit_interval
from .launch import spawn
from .profiling import step as profile_step
from .rendezvous import INIT_METHOD, options, report
