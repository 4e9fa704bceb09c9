"""The programs as the pages show them, for tests/test_docs.py: each program's own parser, taken
from a run of its `--help` in this process; the code that a program runs (its script and the
modules beside it that it imports); the names of the flags that this code reads; the lines that
it can print, as patterns (and rpcrun's, where rpcrun runs it); and the commands that a Markdown
page shows (`python SCRIPT ...`, `torchrun ... SCRIPT ...`, `rpcrun ... SCRIPT ...`)."""

import argparse
import ast
import contextlib
import functools
import io
import logging
import os
import re
import runpy
import shlex
import string
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

from example_modules import example_modules

ROOT = Path(__file__).resolve().parent.parent
SUPERVISOR = tuple(sorted((ROOT / "rpc_harness").glob("*.py")))


# --------- A program's parser, through its --help --------------------

@dataclass
class Parsed:
    """A program's parser and what its --help printed."""

    parser: argparse.ArgumentParser
    help: str

    @property
    def dests(self):
        """The names its flags' values take (argparse's dest), from a parse of no arguments."""
        return set(vars(self.parser.parse_args([])))

    def options(self):
        """Every spelling of every flag, as its --help lists them (`--world_size N,
        --world-size N`)."""
        return set(re.findall(r"(?:^\s*|, )(--?[\w-]+)", self.help, re.M)) - {"-h"}

    def error(self, argv):
        """None where the parser takes argv; otherwise its one-line error."""
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                self.parser.parse_args(argv)
        except SystemExit:
            return err.getvalue().strip() or "refused"
        return None


@functools.cache
def parsed(script):
    """The parser of a program (a path from the repository's root), as `python script --help`
    runs it: the script runs in this process as __main__, its folder first on sys.path, with
    argv ["--help"]; the parser that parses that argv is kept, and --help's text. Wide columns,
    so that argparse wraps no flag's name. The script's changes to logging and warnings are
    undone."""
    path = ROOT / script
    seen = []
    parse_args = argparse.ArgumentParser.parse_args

    def recording(self, *args, **kwargs):
        seen.append(self)
        return parse_args(self, *args, **kwargs)

    out = io.StringIO()
    saved_argv, saved_columns = sys.argv, os.environ.get("COLUMNS")
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    argparse.ArgumentParser.parse_args = recording
    sys.argv = [str(path), "--help"]
    os.environ["COLUMNS"] = "1000"
    try:
        with (example_modules(str(path.parent.relative_to(ROOT))), warnings.catch_warnings(),
              contextlib.redirect_stdout(out)):
            try:
                runpy.run_path(str(path), run_name="__main__")
            except SystemExit as end:
                status = end.code
            else:
                status = 0
    finally:
        argparse.ArgumentParser.parse_args = parse_args
        sys.argv = saved_argv
        if saved_columns is None:
            os.environ.pop("COLUMNS")
        else:
            os.environ["COLUMNS"] = saved_columns
        root.handlers[:] = handlers
        root.setLevel(level)
    assert seen and status in (0, None), f"`{script} --help` parsed nothing (status {status})"
    return Parsed(seen[0], out.getvalue())


@functools.cache
def rpcrun():
    """rpcrun's own parser (its flags before the script)."""
    from rpc_harness.command import parser

    made = parser()
    return Parsed(made, made.format_help())


@functools.cache
def torchrun():
    """torchrun's own parser (torch.distributed.run, which the torchrun command runs)."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    return Parsed(parser, parser.format_help())


# --------- The code a program runs --------------------

@functools.cache
def sources(script):
    """The files of Python that a program runs from its folder: the script and the modules
    beside it that it imports (by their plain names, as `from main import Net`), theirs in
    turn."""
    found, todo = [], [ROOT / script]
    while todo:
        path = todo.pop()
        if path in found:
            continue
        found.append(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            todo += [path.parent / f"{name}.py" for name in names
                     if (path.parent / f"{name}.py").exists()]
    return tuple(found)


def _imported_names(tree):
    """The names that a module binds by importing another package (torch, and what was taken
    from it); not this package's own modules (`from . import state`), whose names a function
    may reuse for a variable."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) or (isinstance(node, ast.ImportFrom) and node.level == 0):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    return names


def _root_name(node):
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


@functools.cache
def reads(files):
    """The attribute names that the code reads from an object of its own (`args.epochs`,
    `self.args.seed`, `getattr(args, "profile", None)`), not from an imported module
    (`torch.profiler`)."""
    found = set()
    for path in files:
        tree = ast.parse(path.read_text())
        modules = _imported_names(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)
                    and _root_name(node.value) not in modules):
                found.add(node.attr)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id == "getattr" and len(node.args) > 1
                  and isinstance(node.args[1], ast.Constant)):
                found.add(node.args[1].value)
    return found


# --------- The lines a program prints --------------------

FIELD = "\0"  # where a formatted value goes, in a format's parts


def _formats(tree):
    """Every string of a module as a format: its text with FIELD where a value goes (an f-string's
    {...}, str.format's {...}, %'s %s)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            yield "".join(part.value if isinstance(part, ast.Constant) else FIELD
                          for part in node.values)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
            with contextlib.suppress(ValueError):
                text = "".join(literal + (FIELD if name is not None else "")
                               for literal, name, _, _ in string.Formatter().parse(text))
            yield re.sub(r"%(?:\([^)]*\))?[-#0 +]*[\d*]*(?:\.\d+)?[sdifgeEr%]", FIELD, text)


def _pattern(line):
    """A line of a format as a regular expression: its text as it is, a group for each FIELD."""
    return "".join("(.*?)" if part == FIELD else re.escape(part)
                   for part in re.split(f"({FIELD})", line))


@functools.cache
def line_patterns(files):
    """The lines that the code can print, each as a pattern built from its format: its words as
    they are, any value where the format has a field. A format with no letter, or with fewer
    than three characters besides its fields and spaces (`f"{name}: {line}"`), would match
    almost any line, and so is left out."""
    patterns = set()
    for path in files:
        for text in _formats(ast.parse(path.read_text())):
            for line in text.split("\n"):
                words = re.sub(r"\s", "", line.replace(FIELD, ""))
                if len(words) >= 3 and re.search(r"[A-Za-z]", words):
                    patterns.add(_pattern(line))
    return [re.compile(pattern) for pattern in sorted(patterns)]


# A value that a field holds: a word (a number, a name, a path), or a list of them (", ").
VALUE = re.compile(r"[^\s,]*(?:, [^\s,]+)*")


def prints(patterns, line, depth=3):
    """Whether the line has the shape of a line that the patterns print: one of them matches it
    whole, its words where they are. A format that starts with a value must not take the
    words of another line for it: that value is a word, or a part that another pattern prints
    (as `f"{name}: joined the other ..."` holds the start of a line whose end is
    `f"{threads} thread, as it computes little ..."`), to depth. A line may start with a
    capital where its format starts in lower case."""
    texts = {line, line[:1].lower() + line[1:]}
    for pattern in patterns:
        for text in texts:
            match = pattern.fullmatch(text)
            if not match:
                continue
            if not pattern.pattern.startswith("(.*?)") or match.start(1) != 0:
                return True
            first = match.group(1)
            if VALUE.fullmatch(first) or (depth > 1 and prints(patterns, first, depth - 1)):
                return True
    return False


# logging's own format (logging.BASIC_FORMAT, "LEVEL:logger:message"), which a program that
# logs through logging.basicConfig() prints before each message (rpc_profiling's recipe): what
# comes before the message, each field a word.
LOG_PREFIX = re.compile("".join(
    r"[\w.]+" if part.startswith("%(") else re.escape(part)
    for part in re.split(r"(%\(\w+\)s)", logging.BASIC_FORMAT.split("%(message)s")[0]) if part))


# --------- The commands a page shows --------------------

@dataclass
class Command:
    """One command that a page shows: the program it runs, and the words after it."""

    page: Path
    text: str
    script: str | None  # the program, from the repository's root (None: not found)
    argv: list
    torchrun_argv: list  # torchrun's own flags, before the program
    rpcrun_argv: list | None = None  # rpcrun's own flags, before the program; None: no rpcrun


def code_on_page(text):
    """The code a page shows: its fenced blocks (but the sample outputs of a ```text block),
    its indented blocks, and its inline code, each a piece of text."""
    pieces = []
    for match in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        if match.group(1) != "text":
            pieces += match.group(2).splitlines()
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    pieces += [line[4:] for line in text.splitlines() if line.startswith("    ")]
    pieces += re.findall(r"(?<!`)`([^`\n]+)`(?!`)", text)
    return pieces


def commands(page, pieces):
    """The commands in pieces of a page's code that run a program of this repository (`python
    param_server/main.py ...`, `torchrun ... main.py ...`, `bench.py --threads`)."""
    found = []
    for piece in pieces:
        for part in re.split(r"\s(?:&&|&|\|\||\||;)\s", piece):
            try:
                words = shlex.split(part, comments=True)
            except ValueError:
                continue
            at = next((i for i, word in enumerate(words) if word.endswith(".py")), None)
            if at is None or not words[at].replace("/", "").replace("_", "").replace(
                    ".", "").replace("-", "").isalnum():
                continue
            launcher, argv = words[:at], words[at + 1:]
            if launcher and not re.fullmatch(r"(?:\S*/)?(?:python3?|torchrun|rpcrun)",
                                             launcher[0]):
                continue
            supervised = None
            if launcher and launcher[0].endswith("rpcrun"):
                supervised = launcher[1:]
            elif launcher[1:3] == ["-m", "rpc_harness"]:
                supervised = launcher[3:]
            elif launcher[1:3] == ["-m", "torch.distributed.run"]:
                launcher = ["torchrun", *launcher[3:]]
            elif launcher[1:2] == ["-m"]:  # another module's command
                continue
            if not launcher and not argv:  # a file's name (`main.py`), not a command
                continue
            script = None
            for base in (ROOT, page.parent):
                if (base / words[at]).is_file():
                    script = str((base / words[at]).resolve().relative_to(ROOT))
                    break
            is_torchrun = bool(launcher) and launcher[0].endswith("torchrun")
            found.append(Command(page, part.strip(), script, argv,
                                 launcher[1:] if is_torchrun else [], supervised))
    return found


def uses_monarch(script):
    """Whether the program's own code imports Monarch."""
    for path in sources(script):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("monarch"):
                return True
    return False


def entry_points(folder):
    """The programs of a folder: its scripts that run something as __main__."""
    found = []
    for path in sorted((ROOT / folder).glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                    and isinstance(node.test.left, ast.Name)
                    and node.test.left.id == "__name__"):
                found.append(str(path.relative_to(ROOT)))
    return found
