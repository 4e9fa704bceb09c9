"""bench/faults.py's "a rank whose own code raises": Python imports this module as it starts
(this folder is on PYTHONPATH in that cell only), in every process of the run: rpcrun, the
commands, the ranks, torchrun's agent, Monarch's processes. FAULTS_RAISE says where the error
goes:

    rank <module>:<function> <rank> <call>   in the process of rank <rank> (as torch knows it:
                                             its RPC worker's id, or its rank in the default
                                             process group), the <call>-th call of the
                                             function raises (`torch.optim:Adam.step`)
    actor <module>:<function> <call>         the first of Monarch's processes (not the
                                             controller) to make its <call>-th call raises

The function is one that the example's code calls at each step, so that the error comes out of
the rank's own code, as its traceback shows. FAULTS_RAISED is the file where the process that
raises writes the time."""

import importlib.abc
import importlib.machinery
import os
import sys
import time
from pathlib import Path

_SPEC = os.environ.get("FAULTS_RAISE")


def _raise():
    # whole or not at all (a temporary file, renamed): faults.py reads it as it appears
    raised = Path(os.environ["FAULTS_RAISED"])
    part = raised.with_name(f".{raised.name}.{os.getpid()}")
    part.write_text(f"{time.time()} {os.getpid()}")
    part.replace(raised)
    raise RuntimeError("an error injected by bench/faults.py")


def _in_rank(where, victim, calls):
    module_name, _, path = where.rpartition(":")
    _after_import(module_name, lambda module: _patch(
        module, path, calls, lambda: _this_rank() == victim))


def _this_rank():
    """This process's rank, as torch knows it: its RPC worker's id, or its rank in the default
    process group (pipelining.py has no RPC); None before either."""
    import torch.distributed as dist
    import torch.distributed.rpc as rpc

    try:
        return rpc.get_worker_info().id
    except RuntimeError:  # RPC not initialized
        pass
    return dist.get_rank() if dist.is_initialized() else None


def _in_actor(where, calls):
    # Patched once the program imports the module, not sooner: importing it here would put
    # torch's import into the start of every Monarch process, which Monarch gives 30 s to be
    # ready; beside another cell on 2 cores, one run's processes took longer.
    os.environ.setdefault("FAULTS_CONTROLLER", str(os.getpid()))  # the first: the command
    module_name, _, path = where.rpartition(":")
    _after_import(module_name, lambda module: _patch(
        module, path, calls, lambda: os.environ["FAULTS_CONTROLLER"] != str(os.getpid())))


def _patch(module, path, calls, here):
    """Make the <calls>-th call of module.<path> raise in the first process where here() is
    true that gets there."""
    owner = module
    *owners, name = path.split(".")
    for part in owners:
        owner = getattr(owner, part)
    original = getattr(owner, name)
    made = [0]

    def injected(*args, **kwargs):
        if here():
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


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls then(module) as soon as the module `name` has been imported (and its code run)."""

    def __init__(self, name, then):
        self.name = name
        self.then = then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        run_the_module = spec.loader.exec_module
        then = self.then

        def exec_module(module):
            run_the_module(module)
            then(module)

        spec.loader.exec_module = exec_module
        return spec


def _after_import(name, then):
    sys.meta_path.insert(0, _AfterImport(name, then))


if _SPEC:
    _kind, *_words = _SPEC.split()
    if _kind == "rank":
        _in_rank(_words[0], int(_words[1]), int(_words[2]))
    elif _kind == "actor":
        _in_actor(_words[0], int(_words[1]))
