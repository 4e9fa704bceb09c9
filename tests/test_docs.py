"""The pages a reader reads: every link to a line of code points at what it names, the front
page and each example's page stay short, and their English plain (sentences of about 18 words,
none over 35). `make docs` reruns the sample outputs and points the links again
(docs/make_docs.py)."""

import re
import subprocess
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "docs"))
import make_docs  # noqa: E402

MARKDOWN = [ROOT / name for name in subprocess.run(
    ["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True).stdout.split()]
# The pages written for readers (the bench/ result files are tables that a program writes).
PAGES = [path for path in MARKDOWN
         if path.name == "README.md" or path.parent.name == "docs" or path.name == "ACTORS.md"]
EXAMPLES = ["param_server", "rl_cartpole", "rnn_model_parallel", "ddp_rpc_hybrid",
            "pipeline_parallel", "rpc_profiling"]


def prose(text):
    """The running text of a Markdown page: no code blocks, tables, headings, comments, or
    the targets of links; a code span counts as one word."""
    text = re.sub(r"```.*?```", " ", text, flags=re.S)
    text = re.sub(r"<!--.*?-->", " ", text, flags=re.S)
    lines = [line for line in text.splitlines()
             if not line.startswith("    ") and not line.lstrip().startswith(("|", "#"))]
    text = "\n".join(lines)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"`[^`]*`", "CODE", text)


def sentences(text):
    """The sentences of running text, each a list of its words."""
    parts = re.split(r"(?<=[.!?:;])\s+(?=[A-Z`*(\-])|\n\s*\n|\n\s*[-*] ", prose(text))
    found = []
    for part in parts:
        words = re.findall(r"[\w'’.,/+-]+", part)
        if len(words) >= 3:
            found.append(words)
    return found


def words(text):
    """The words of a page outside its code blocks and comments (its tables count)."""
    text = re.sub(r"```.*?```", " ", text, flags=re.S)
    text = re.sub(r"<!--.*?-->", " ", text, flags=re.S)
    return len(re.findall(r"[A-Za-z0-9][\w'’.-]*", text))


@pytest.mark.parametrize("path", MARKDOWN, ids=[str(p.relative_to(ROOT)) for p in MARKDOWN])
def test_every_link_to_a_line_points_at_what_it_names(path):
    text = path.read_text()
    for match in make_docs.LINK.finditer(text):
        target = (path.parent / match.group("file")).resolve()
        line = make_docs.definition_line(target, match.group("name"))
        assert line == int(match.group("line")), (
            f"{match.group(0)}: {match.group('name')} is at line {line}; run `make docs`")


@pytest.mark.parametrize("path", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_the_english_is_plain(path):
    found = sentences(path.read_text())
    assert found, "no sentences found"
    lengths = [len(sentence) for sentence in found]
    longest = max(found, key=len)
    assert max(lengths) <= 35, f"a sentence of {len(longest)} words: {' '.join(longest)}"
    average = sum(lengths) / len(lengths)
    assert average <= 18, f"sentences of {average:.1f} words on average"


def test_the_front_page_reads_in_three_minutes():
    assert words((ROOT / "README.md").read_text()) <= 800


@pytest.mark.parametrize("example", EXAMPLES)
def test_each_examples_page_reads_in_minutes(example):
    assert words((ROOT / example / "README.md").read_text()) <= 1500


@pytest.mark.parametrize("path", MARKDOWN, ids=[str(p.relative_to(ROOT)) for p in MARKDOWN])
def test_every_sample_output_has_been_run(path):
    for match in make_docs.BLOCK.finditer(path.read_text()):
        assert re.search(r"```text\n.+\n```\nIt took [\d.]+ s on \d+ CPU cores?\.",
                         match.group("body"), re.S), f"{match.group('command')}: run `make docs`"
