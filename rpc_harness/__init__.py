"""What every example shares, so that its main.py holds the tutorial's code, calls included;
imported before torch, for what torch reads as it loads. cli: the command line; launch: spawn();
rendezvous: how the ranks meet, watch each other, end; profiling: --profile; compat: torch 2.4."""

import os
import signal
import sys
import warnings
from pathlib import Path

# Expected failures get one line of ours; torch's C++ code would log them too, with stack traces.
# The profiler (Kineto) logs its starts and stops, and an "ERROR" without a GPU: 6 is above all.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

# Harmless deprecation warnings from inside torch's RPC stack (its agent's process group, the
# TorchScript optimizers of DistributedOptimizer, shown under simplefilter("always")).
warnings.filterwarnings("ignore", message=r".*as a ProcessGroup\. This usage is deprecated")
_show_warning = warnings.showwarning

def _show_warning_unless_torchscript_optimizer(message, *args, **kwargs):
    if not str(message).startswith("`TorchScript` support for functional optimizers is deprec"):
        _show_warning(message, *args, **kwargs)

def _interrupted_while_loading(number, frame):
    print("interrupted", file=sys.stderr)
    os._exit(130)

warnings.showwarning = _show_warning_unless_torchscript_optimizer
# Ctrl-C while torch loads ends an example's command in one line, as later (not the tests, nor
# the ranks that spawn() starts, which ignore it).
if (Path(getattr(sys.modules["__main__"], "__file__", "/")).resolve().parent.parent
        == Path(__file__).resolve().parent.parent
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
    signal.signal(signal.SIGINT, _interrupted_while_loading)

# isort: off
from .cli import ArgumentParser, add_arguments, check_folder, int_at_least, parse_args  # noqa: E402
from .cli import positive_float, probability, unit_interval  # noqa: E402
from .launch import spawn  # noqa: E402
from .profiling import step as profile_step  # noqa: E402
from .rendezvous import INIT_METHOD, options, report  # noqa: E402
# isort: on
