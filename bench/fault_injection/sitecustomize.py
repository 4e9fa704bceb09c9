"""bench/faults.py's "a rank whose own code raises": Python imports this module as it starts
(this folder is on PYTHONPATH in that cell only), in every process of the run: the commands, the
ranks, torchrun's agent, Monarch's processes. FAULTS_RAISE says where the error goes:

    rank <function> <rank> <call>   the rank's <call>-th call of rpc_harness.<function> raises
    actor <function> <call>         the first of Monarch's processes (not the controller) to
                                    make its <call>-th call of monarch_runs.<function> raises

The error is the example's own, as far as the harness can tell: raised in the rank's code, where
it calls the harness. FAULTS_RAISED is the file where the process that raises writes the time."""

import os
import time
from pathlib import Path

_SPEC = os.environ.get("FAULTS_RAISE")


def _raise():
    Path(os.environ["FAULTS_RAISED"]).write_text(f"{time.time()} {os.getpid()}")
    raise RuntimeError("an error injected by bench/faults.py")


def _in_rank(name, victim, calls):
    import rpc_harness
    from rpc_harness import rank as rank_module

    original = getattr(rpc_harness, name)
    made = [0]

    def this_rank():
        if hasattr(rank_module, "current"):
            this = rank_module.current()
            return None if this is None else this.rank
        return rank_module._rank  # the harness before rank.Rank, for before/after figures

    def injected(*args, **kwargs):
        if this_rank() == victim:
            made[0] += 1
            if made[0] == calls:
                _raise()
        return original(*args, **kwargs)

    setattr(rpc_harness, name, injected)


def _in_actor(path, calls):
    from rpc_harness import monarch_runs

    os.environ.setdefault("FAULTS_CONTROLLER", str(os.getpid()))  # the first: the command
    owner_name, _, name = path.rpartition(".")
    owner = getattr(monarch_runs, owner_name) if owner_name else monarch_runs
    original = getattr(owner, name)
    made = [0]

    def injected(*args, **kwargs):
        if os.environ["FAULTS_CONTROLLER"] != str(os.getpid()):
            made[0] += 1
            if made[0] == calls:
                try:  # the first of the processes to get here, only
                    os.close(os.open(os.environ["FAULTS_RAISED"] + ".claim",
                                     os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                except FileExistsError:
                    return original(*args, **kwargs)
                _raise()
        return original(*args, **kwargs)

    setattr(owner, name, injected)


if _SPEC:
    _kind, *_words = _SPEC.split()
    if _kind == "rank":
        _in_rank(_words[0], int(_words[1]), int(_words[2]))
    elif _kind == "actor":
        _in_actor(_words[0], int(_words[1]))
