"""The harness every example imports, first (it sets what torch reads as it loads), so that
main.py holds the tutorial's code and calls, run in every way with every wait bounded. cli: the
command line; launch: spawn(); rendezvous: how init_rpc and init_process_group meet, lost peers,
the end; profiling: --profile; compat: what torch 2.4 lacks."""

import os
import signal
import sys
import warnings
from pathlib import Path

# Expected failures get one line of ours, but torch's C++ code logs them too, some with a C++
# stack trace (every error that matters reaches Python): FATAL keeps a crash's logs, unless the
# user chose. The profiler logs its starts and stops, and an "ERROR" without a GPU: 6 is above all.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

# Harmless deprecation warnings from inside PyTorch's RPC stack, about its own internals: its
# agent's process group, and DistributedOptimizer's TorchScript optimizers. The second comes
# under simplefilter("always"), which overrides filters: the hook that shows warnings drops it.
warnings.filterwarnings("ignore", message=r".*as a ProcessGroup\. This usage is deprecated")
_show_warning = warnings.showwarning


def _show_warning_unless_torchscript_optimizer(message, *args, **kwargs):
    if not str(message).startswith("`TorchScript` support for functional optimizers is deprec"):
        _show_warning(message, *args, **kwargs)


def _interrupted_while_loading(number, frame):
    print("interrupted" + ("" if number == signal.SIGINT else " (SIGTERM)"), file=sys.stderr)
    os._exit(128 + number)


warnings.showwarning = _show_warning_unless_torchscript_optimizer
# Ctrl-C while torch loads ends an example's command in one line, as later (not the tests, nor
# the ranks that spawn() starts, which ignore it).
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
