"""What every example shares, so that its main.py shows only its tutorial's code and calls.

cli: the command line (the parser, argument types, the flags this project adds, check_args).
command: the command that starts the ranks (supervise, exit_status). rank: a rank's life
(@watched, report, profile_step). rendezvous: how the ranks meet (options() for init_rpc,
init_method() for init_process_group). ending: how a process ends when something goes wrong.
state: what the harness holds for a process. profiling: --profile. summary: the run's summary.
compat: what torch 2.4 lacks. monarch_runs: what the Monarch programs add.

Importing it changes nothing in the process: each change comes with the call that makes it. A
name's module is imported when the name is first used (`rpc_harness.watched`), so that the
Monarch programs, which use monarch_runs alone, never load torch's RPC."""

import importlib

# The names that the RPC programs use, and the module that holds each.
_MODULE_OF = {
    "ArgumentParser": "cli", "add_arguments": "cli", "check_args": "cli",
    "check_folder": "cli", "int_at_least": "cli", "port_number": "cli",
    "positive_float": "cli", "probability": "cli", "share_of_the_cores": "cli",
    "unit_interval": "cli",
    "exit_status": "command", "supervise": "command",
    "profile_step": "rank", "report": "rank", "watched": "rank",
    "init_method": "rendezvous", "options": "rendezvous",
}
__all__ = list(_MODULE_OF)


def __getattr__(name):
    """rpc_harness.NAME: NAME from its module, imported on first use (Python's module
    __getattr__, PEP 562)."""
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
