"""`make docs`: the READMEs' sample outputs, run again, and their links to lines of code, found
again, so that what the pages show is what the code does today.

In a Markdown file, a sample output is a block between two comments:

    <!-- make docs: python param_server/main.py --dataset synthetic --world_size 3 -->
    ```text
    (what the command printed, written here)
    ```
    It took 8.1 s on 2 CPU cores.
    <!-- end -->

The command runs from the repository's root with this Python (`rpcrun` is `python -m
rpc_harness`); `&` between commands runs them at once, as terminals would, and the block shows
the first one's output. {port} stands for a
free port, shown as 29500. A link such as [`run_worker`](main.py#L42) is pointed again at the
line where `run_worker` is defined (def, class, or NAME = ...) in that file.

    python docs/make_docs.py                  # every Markdown file of the repository
    python docs/make_docs.py --links-only     # only the links (quick; runs nothing)
    python docs/make_docs.py README.md        # one file
"""

import argparse
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"(<!-- make docs: (?P<command>.*?) -->\n)(?P<body>.*?)(<!-- end -->)", re.S)
LINK = re.compile(r"\[`(?P<name>\w+)`\]\((?P<file>[\w./]+\.py)#L(?P<line>\d+)\)")
SHOWN_PORT = "29500"


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def run(command_line):
    """(the first command's output, the seconds until every command ended)."""
    port = free_port()
    commands = [part.strip() for part in command_line.split(" & ")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "100"}
    started = time.monotonic()
    processes = []
    for command in commands:
        words = shlex.split(command.replace("{port}", port))
        if words[0] == "python":
            words[0] = sys.executable
        elif words[0] == "rpcrun":  # the supervisor's command, as `make setup` installs it
            words[:1] = [sys.executable, "-m", "rpc_harness"]
        processes.append(subprocess.Popen(words, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        time.sleep(0.5)  # one terminal after another
    outputs = [process.communicate(timeout=900)[0] for process in processes]
    seconds = time.monotonic() - started
    for process, command in zip(processes, commands, strict=True):
        if process.returncode != 0:
            raise SystemExit(f"make docs: `{command}` ended with status {process.returncode}:\n"
                             f"{outputs[commands.index(command)][-2000:]}")
    return outputs[0].replace(port, SHOWN_PORT), seconds


def cores():
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{count} CPU core{'s' if count != 1 else ''}"


def refresh_outputs(text):
    """The text with every sample output run again."""

    def again(match):
        output, seconds = run(match.group("command"))
        body = (f"```text\n{output.rstrip()}\n```\n"
                f"It took {seconds:.1f} s on {cores()}.\n")
        print(f"  ran `{match.group('command')}`: {seconds:.1f} s", flush=True)
        return match.group(1) + body + match.group(4)

    return BLOCK.sub(again, text)


def definition_line(path, name):
    """The line where `name` is defined in the Python file `path` (def, class, NAME =), or
    None."""
    pattern = re.compile(rf"^\s*(?:@.*\n\s*)?(?:async def|def|class)\s+{name}\b|^{name}\s*=")
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if pattern.match(line):
            return number
    return None


def refresh_links(markdown_path, text):
    """The text with every link to a definition's line pointed at it again; a name that is no
    longer defined there ends the command, saying which."""

    def again(match):
        target = (markdown_path.parent / match.group("file")).resolve()
        line = definition_line(target, match.group("name"))
        if line is None:
            raise SystemExit(f"make docs: {markdown_path.relative_to(ROOT)}: "
                             f"`{match.group('name')}` is not defined in {match.group('file')}")
        return f"[`{match.group('name')}`]({match.group('file')}#L{line})"

    return LINK.sub(again, text)


def markdown_files(names):
    if names:
        return [Path(name).resolve() for name in names]
    tracked = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    return [ROOT / name for name in tracked]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", help="Markdown files (default: every one)")
    parser.add_argument("--links-only", action="store_true",
                        help="only point the links at their lines again; run nothing")
    args = parser.parse_args()
    for path in markdown_files(args.files):
        text = path.read_text()
        new = refresh_links(path, text)
        if not args.links_only and BLOCK.search(new):
            print(f"{path.relative_to(ROOT)}:", flush=True)
            new = refresh_outputs(new)
        if new != text:
            path.write_text(new)
            print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
