"""The harness every example imports, so that its main.py holds the tutorial's code, calls
included, and runs all ranks from one command, one rank per terminal, under torchrun or across
machines, with every wait bounded. Imported first: it sets what torch reads when it loads.

cli.py: the command line. launch.py: spawn(), the tutorials' mp.spawn. rendezvous.py: how
init_rpc and init_process_group meet the other ranks (options(), INIT_METHOD), the watch for lost
peers, the end. profiling.py: --profile. compat.py: what torch 2.4 lacks."""

import os
import signal
import sys
import warnings
from pathlib import Path

# Expected failures (a lost peer, Ctrl-C) get one line of ours, but torch's C++ code logs them
# too, some with a C++ stack trace; every error that matters also reaches Python. FATAL keeps a
# crash's logs only, unless the user chose a level. Kineto (the profiler) logs each start and
# stop, and without a GPU an "ERROR" about it: 6 is above its highest level.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

# Two harmless deprecation warnings from inside PyTorch's RPC stack, about its own internals:
# the RPC agent's process group, built through an API deprecated since 2.0, and
# DistributedOptimizer's TorchScript functional optimizers. A filter drops the first; the second
# is raised under simplefilter("always"), which overrides filters, so the hook that shows
# warnings drops it and passes every other warning on.
warnings.filterwarnings("ignore", message=r".*as a ProcessGroup\. This usage is deprecated")
_show_warning = warnings.showwarning


def _show_warning_unless_torchscript_optimizer(message, *args, **kwargs):
    if not str(message).startswith("`TorchScript` support for functional optimizers is deprec"):
        _show_warning(message, *args, **kwargs)


warnings.showwarning = _show_warning_unless_torchscript_optimizer


def _interrupted_while_loading(number, frame):
    print("interrupted" + ("" if number == signal.SIGINT else " (SIGTERM)"), file=sys.stderr)
    os._exit(128 + number)


# Ctrl-C while torch loads (seconds) ends an example's command in one line, as later; not in
# other processes that import this (the tests), nor in the ranks of spawn(), which ignore it.
if (Path(getattr(sys.modules["__main__"], "__file__", "/")).resolve().parent.parent
        == Path(__file__).resolve().parent.parent
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
    for _number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(_number, _interrupted_while_loading)

from .cli import (  # noqa: E402 - after the settings above
    ArgumentParser,
    add_arguments,
    check_folder,
    int_at_least,
    parse_args,
    positive_float,
    probability,
    unit_interval,
)
from .launch import spawn  # noqa: E402
from .profiling import step as profile_step  # noqa: E402
from .rendezvous import INIT_METHOD, options, report  # noqa: E402

__all__ = ["ArgumentParser", "INIT_METHOD", "add_arguments", "check_folder", "int_at_least",
           "options", "parse_args", "positive_float", "probability", "profile_step", "report",
           "spawn", "unit_interval"]
