"""How much of each entry point is its tutorial's code, line by line.

    python bench/tutorial_lines.py UPSTREAM

UPSTREAM is a git checkout of pytorch/examples (its distributed/rpc scripts are the tutorials'
code; this repository holds no copy of them). For each entry point and the upstream script's
revision nearest its tutorial's text: the code lines of both (comments, docstrings and blank
lines left out; spaces and quotes made alike), and the longest run of lines that both hold in
the same order. Two figures: the share of our code lines that are the tutorial's, and the share
of the tutorial's code lines that are in ours, in order."""

import argparse
import ast
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (our entry point, upstream script, the upstream revision nearest the tutorial's text)
PAIRS = [
    ("param_server/main.py", "distributed/rpc/parameter_server/rpc_parameter_server.py",
     "5b38d85"),
    ("param_server/batch.py", "distributed/rpc/batch/parameter_server.py", "6fc19c7"),
    ("rl_cartpole/main.py", "distributed/rpc/rl/main.py", "0ea5405"),
    ("rl_cartpole/batch.py", "distributed/rpc/batch/reinforce.py", "0ea5405"),
    ("rnn_model_parallel/main.py", "distributed/rpc/rnn/main.py", "5751edd"),
    ("rnn_model_parallel/rnn.py", "distributed/rpc/rnn/rnn.py", "5751edd"),
    ("ddp_rpc_hybrid/main.py", "distributed/rpc/ddp_rpc/main.py", "a5de3ce"),
    ("ddp_rpc_hybrid/remote_module.py", "distributed/rpc/ddp_rpc/main.py", "5c47bb1"),
    ("pipeline_parallel/main.py", "distributed/rpc/pipeline/main.py", "af11138"),
]


def code_lines(text):
    """The lines of code of a Python source, each with its spaces and quotes made alike:
    comments, docstrings and blank lines left out."""
    docstrings = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    comments = {}
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.start[1]
    lines = []
    for number, line in enumerate(text.splitlines(), start=1):
        if number in docstrings:
            continue
        if number in comments:
            line = line[:comments[number]]
        line = re.sub(r"\s+", " ", line.replace("'", '"')).strip()
        if line:
            lines.append(line)
    return lines


def in_order(ours, theirs):
    """How many lines both hold in the same order (the longest common subsequence)."""
    previous = [0] * (len(theirs) + 1)
    for line in ours:
        current = [0]
        for column, other in enumerate(theirs, start=1):
            if line == other:
                current.append(previous[column - 1] + 1)
            else:
                current.append(max(previous[column], current[column - 1]))
        previous = current
    return previous[-1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("upstream", help="a git checkout of pytorch/examples")
    args = parser.parse_args()
    print("| entry point | upstream script (revision) | our code lines | the tutorial's | "
          "of ours that are the tutorial's | of the tutorial's in ours, in order |")
    print("|---|---|---:|---:|---:|---:|")
    for ours_path, theirs_path, revision in PAIRS:
        theirs_text = subprocess.run(["git", "-C", args.upstream, "show",
                                      f"{revision}:{theirs_path}"], capture_output=True,
                                     text=True, check=True).stdout
        ours = code_lines((ROOT / ours_path).read_text())
        theirs = code_lines(theirs_text)
        both = in_order(ours, theirs)
        print(f"| {ours_path} | {theirs_path.removeprefix('distributed/rpc/')} ({revision}) | "
              f"{len(ours)} | {len(theirs)} | {both / len(ours):.0%} | "
              f"{both / len(theirs):.0%} |")


if __name__ == "__main__":
    sys.exit(main())
