"""The run's summary, the same for the RPC and the Monarch programs: one line, "Summary: ...",
and with --summary_json the run's figures, each process's peak memory and the wall seconds."""

import json
import resource
import sys
import time
from pathlib import Path

import torch

from .cli import STARTED


def peak_memory_mb():
    """This process's most resident memory so far (ru_maxrss: kB on Linux, bytes on macOS), and
    its GPU's where it used one, in MB."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = {"rss": rss // (2**20 if sys.platform == "darwin" else 2**10)}
    if torch.cuda.is_initialized():
        peak["cuda"] = torch.cuda.max_memory_allocated() // 2**20
    return peak


class NotWritten(Exception):
    """--summary_json could not be written at the end, though its folder took a file at the
    start (the disk filled, the folder went away). The message is the line that says so."""


def write_summary(args, figures, line, memory):
    """Print the summary line and write --summary_json: the run's figures, each process's peak
    memory (`memory`: its name -> peak_memory_mb()) and the wall seconds since the command
    started (an RPC program's args.harness knows when; a Monarch program is that command). The
    line comes first, so that a file that cannot be written (NotWritten) loses no figure."""
    harness = getattr(args, "harness", None)
    started = STARTED if harness is None else harness.started
    figures["peak_memory_mb"] = memory
    figures["wall_seconds"] = round(time.time() - started, 3)
    print(f"Summary: {line}; {figures['wall_seconds']:.1f} s in all")
    if args.summary_json:
        try:
            Path(args.summary_json).write_text(json.dumps(figures, indent=2) + "\n")
        except OSError as error:
            raise NotWritten(f"--summary_json {args.summary_json}: not written "
                             f"({error.strerror or error}); the Summary line has the run's "
                             "figures") from error
