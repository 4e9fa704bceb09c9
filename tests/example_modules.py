"""Import an example's modules in this process, as running its main.py would import them.

main.py imports the modules beside it by their plain names (`from data import ...`, and batch.py
`from main import ...`). Several folders have modules of the same name (main, data), so the
plain names may point at one example's modules at a time:
load_example() loads an example's module with its folder first on sys.path and the plain names
set to its modules, then restores sys.modules. Code that looks modules up by name later (pickle,
as in-process RPC does) runs inside example_modules(example). The tests and bench/ use this.
"""

import contextlib
import importlib.util
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_loaded = {}  # example -> {plain module name: module}


@contextlib.contextmanager
def example_modules(example):
    """While inside, the example's folder is first on sys.path and the plain names of its
    modules (main, data, ...) are the ones load_example() loaded for it."""
    folder = ROOT / example
    names = [path.stem for path in folder.glob("*.py")]
    saved = {name: sys.modules.pop(name) for name in names if name in sys.modules}
    sys.modules.update(_loaded.get(example, {}))
    sys.path.insert(0, str(folder))
    try:
        yield
    finally:
        sys.path.remove(str(folder))
        for name in names:
            sys.modules.pop(name, None)
        sys.modules.update(saved)


def load_example(example, module="main"):
    """<example>/<module>.py as a module (loaded once)."""
    loaded = _loaded.setdefault(example, {})
    if module not in loaded:
        folder = ROOT / example
        # rpc_profiling's main.py sets the root logger to DEBUG on stdout, as its recipe does:
        # right for its run, but the tests of this process keep the logging they had.
        root = logging.getLogger()
        handlers, level = root.handlers[:], root.level
        with example_modules(example):
            spec = importlib.util.spec_from_file_location(module, folder / f"{module}.py")
            sys.modules[module] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(sys.modules[module])
            for path in folder.glob("*.py"):  # what it imported from beside it, too
                if path.stem in sys.modules:
                    loaded.setdefault(path.stem, sys.modules[path.stem])
        root.handlers[:] = handlers
        root.setLevel(level)
    return loaded[module]
