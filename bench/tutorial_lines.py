"""How much of each entry point is its tutorial's code, line by line.

    python bench/tutorial_lines.py UPSTREAM

UPSTREAM is a git checkout of pytorch/examples (its distributed/rpc scripts are the tutorials'
code; this repository holds no copy of them). For each entry point and the upstream script's
revision nearest its tutorial's text: the code lines of both (comments, docstrings and blank
lines left out; spaces and quotes made alike, so that `__name__=="__main__"` is
`__name__ == "__main__"`), and the longest run of lines that both hold in the same order. Two
figures: the share of our code lines that are the tutorial's, and the share of the tutorial's
code lines that are in ours, in order. Then our lines that are not the tutorial's and carry no
"# ours:" mark, which should be none. A line is marked by a mark on the line, on its statement's
first line, or in a comment above the block of our lines that holds it (read up from the line
and from its statement's first line); and every line under a section header comment whose text
says "ours:" (`# --------- ours: what the harness needs ---`) is marked, down to the next
section header. A line that is one of the tutorial's that the run in order left out (the
tutorial's line, moved) counts as not in order, but needs no mark: its text is the tutorial's."""

import argparse
import ast
import io
import re
import subprocess
import sys
import tokenize
from collections import Counter
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


# a comment that opens a section: "# ---------" then its title
SECTION_HEADER = re.compile(r"\s*# -{3,}")


def docstring_lines(text):
    """The numbers of the lines of a Python source that hold docstrings."""
    docstrings = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    return docstrings


def code_lines(text):
    """The lines of code of a Python source, each with its spaces and quotes made alike, and its
    line number: comments, docstrings and blank lines left out."""
    docstrings = docstring_lines(text)
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
        line = re.sub(r" ?([^\w ]) ?", r"\1", line)  # no spaces around operators and brackets
        if line:
            lines.append((line, number))
    return lines


def in_order(ours, theirs):
    """The indices of `ours` that both hold in the same order (a longest common subsequence)."""
    table = [[0] * (len(theirs) + 1) for _ in range(len(ours) + 1)]
    for row in range(len(ours) - 1, -1, -1):
        for column in range(len(theirs) - 1, -1, -1):
            if ours[row] == theirs[column]:
                table[row][column] = table[row + 1][column + 1] + 1
            else:
                table[row][column] = max(table[row + 1][column], table[row][column + 1])
    matched = set()
    row = column = 0
    while row < len(ours) and column < len(theirs):
        if ours[row] == theirs[column]:
            matched.add(row)
            row += 1
            column += 1
        elif table[row + 1][column] >= table[row][column + 1]:
            row += 1
        else:
            column += 1
    return matched


def unmarked(text, numbers):
    """Of the line numbers `numbers` (our lines that are not the tutorial's), those with no
    "# ours:" mark: on the line, on the first line of its statement or on the line above, or
    above it in the block of our lines that holds it (reading up from the statement's first
    line over our lines, comments and docstrings, to a blank line or a line of the
    tutorial's): a block of ours with one comment above it. The same read up from the line
    itself finds a comment inside a statement, just above the line. A section header comment
    (`# --------- ours: ...`) marks every line under it, down to the next section header."""
    source = text.splitlines()
    starts = {}
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.stmt):
            for number in range(node.lineno, node.end_lineno + 1):
                if number not in starts or node.lineno > starts[number]:
                    starts[number] = node.lineno
    comment_only = set()
    code = set()
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT and token.start[0] not in code:
            comment_only.add(token.start[0])
        elif token.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                                tokenize.ENDMARKER, tokenize.COMMENT):
            for number in range(token.start[0], token.end[0] + 1):
                code.add(number)
                comment_only.discard(number)
    ours = set(numbers) | docstring_lines(text)
    in_section_of_ours = set()
    section_of_ours = False
    for number, line in enumerate(source, start=1):
        if number in comment_only and SECTION_HEADER.match(line):
            section_of_ours = "ours:" in line
        elif section_of_ours:
            in_section_of_ours.add(number)

    def marked_above(place):
        """Whether reading up from `place` over our lines and comments finds a mark."""
        while place >= 1 and (place in comment_only or place in ours):
            if "# ours" in source[place - 1]:
                return True
            place -= 1
        return False

    found = []
    for number in numbers:
        first = starts.get(number, number)
        if any("# ours" in source[place - 1] for place in (number, first, first - 1)
               if place >= 1):
            continue
        if number in in_section_of_ours or marked_above(first - 1) or marked_above(number - 1):
            continue
        found.append(number)
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("upstream", help="a git checkout of pytorch/examples")
    args = parser.parse_args()
    print("| entry point | upstream script (revision) | our code lines | the tutorial's | "
          "of ours that are the tutorial's | of the tutorial's in ours, in order |")
    print("|---|---|---:|---:|---:|---:|")
    missing_marks = {}
    for ours_path, theirs_path, revision in PAIRS:
        theirs_text = subprocess.run(["git", "-C", args.upstream, "show",
                                      f"{revision}:{theirs_path}"], capture_output=True,
                                     text=True, check=True).stdout
        ours_text = (ROOT / ours_path).read_text()
        ours = code_lines(ours_text)
        theirs = code_lines(theirs_text)
        matched = in_order([line for line, _ in ours], [line for line, _ in theirs])
        both = len(matched)
        print(f"| {ours_path} | {theirs_path.removeprefix('distributed/rpc/')} ({revision}) | "
              f"{len(ours)} | {len(theirs)} | {both / len(ours):.0%} | "
              f"{both / len(theirs):.0%} |")
        # the tutorial's lines that the run in order left out, by text, to recognise ours moved
        left_out = Counter(line for line, _ in theirs)
        left_out.subtract(line for index, (line, _) in enumerate(ours) if index in matched)
        changed = []
        for index, (line, number) in enumerate(ours):
            if index in matched:
                continue
            if left_out[line] > 0:  # the tutorial's line, moved: no mark needed
                left_out[line] -= 1
                continue
            changed.append(number)
        missing_marks[ours_path] = unmarked(ours_text, changed)
    for path, numbers in missing_marks.items():
        if numbers:
            print(f"{path}: lines not the tutorial's without '# ours:': "
                  f"{', '.join(map(str, numbers))}")

if __name__ == "__main__":
    sys.exit(main())
