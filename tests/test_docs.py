"""The pages a reader reads: every link to a line of code points at what it names, the front
page and each example's page stay short, and their English plain (sentences of about 18 words,
none over 35). `make docs` reruns the sample outputs and points the links again
(docs/make_docs.py). Nothing on a page is stale: every flag that a page or a program's --help
names is a flag of that program, and one that the program reads; every relative link and
picture is there, and every picture is shown; every sample output's command still parses, and
each of its lines has the shape of a line that the program prints now (tests/programs.py)."""

import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import programs
import pytest
from conftest import ROOT, needs_monarch

sys.path.insert(0, str(ROOT / "docs"))
import make_docs  # noqa: E402

MARKDOWN = [ROOT / name for name in subprocess.run(
    ["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True).stdout.split()]
# The pages written for readers (the bench/ result files are tables that a program writes).
PAGES = [path for path in MARKDOWN
         if path.name == "README.md" or path.parent.name == "docs" or path.name == "ACTORS.md"]
EXAMPLES = ["param_server", "rl_cartpole", "rnn_model_parallel", "ddp_rpc_hybrid",
            "pipeline_parallel", "rpc_profiling", "cuda_rpc"]


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


# --------- Flags --------------------

PROGRAMS = [script for example in EXAMPLES for script in programs.entry_points(example)]


def program(script):
    """The program's parser and --help (tests/programs.py), or the test skipped where the
    program needs Monarch and Monarch is missing."""
    if programs.uses_monarch(script):
        needs_monarch()
    return programs.parsed(script)


@pytest.mark.parametrize("script", PROGRAMS)
def test_every_flag_of_a_program_is_read(script):
    """A flag whose value nothing reads (nothing of the program's folder) does nothing."""
    unread = program(script).dests - programs.reads(programs.sources(script))
    assert not unread, f"{script}: nothing reads the value of {sorted(unread)}"


@pytest.mark.parametrize("script", PROGRAMS)
def test_every_flag_that_a_help_names_is_a_flag(script):
    parsed = program(script)
    named = set(re.findall(r"(?<![\w-])--[A-Za-z][\w-]*", parsed.help))
    missing = named - parsed.options()
    assert not missing, f"`{script} --help` names {sorted(missing)}, which it does not take"


def shown_commands(path):
    """The commands that a page shows, but those of its sample outputs (tested below)."""
    return programs.commands(path, programs.code_on_page(path.read_text()))


@pytest.mark.parametrize("path", MARKDOWN, ids=[str(p.relative_to(ROOT)) for p in MARKDOWN])
def test_every_command_on_a_page_parses(path):
    """Each command that a page shows runs a program that is there, with flags and values
    that its parser takes (and torchrun's, before the program)."""
    for command in shown_commands(path):
        if "..." in command.argv:  # a command's shape (`python main.py ...`): its flags, below
            continue
        assert command.script, f"`{command.text}`: no such program"
        error = program(command.script).error(command.argv)
        assert error is None, f"`{command.text}`: {error}"
        if command.torchrun_argv:
            error = programs.torchrun().error([*command.torchrun_argv, command.script])
            assert error is None, f"`{command.text}`: {error}"
        if command.rpcrun_argv:
            error = programs.rpcrun().error([*command.rpcrun_argv, command.script])
            assert error is None, f"`{command.text}`: {error}"


# The pages whose flags in inline code (`--max_batches`) name the programs of today. bench/'s
# pages also report the variants that bench.py runs from earlier commits (their flags of then).
FLAG_PAGES = [path for path in PAGES if path.parent.name != "bench"]


def page_programs(path):
    """The programs whose flags a page may name: its folder's, or on a page outside the
    examples every example's; torchrun's; and those of any program the page runs or names."""
    folder = path.parent.relative_to(ROOT)
    scripts = [script for script in PROGRAMS
               if str(folder) not in EXAMPLES or script.startswith(f"{folder}/")]
    named = {str(match.relative_to(ROOT)) for match in
             (ROOT / word for word in re.findall(r"[\w/]+\.py\b", path.read_text()))
             if match.is_file()}
    scripts += [script for script in sorted(named)
                if script in programs.entry_points(str(Path(script).parent))
                and not script.startswith(("rpc_harness/", "tests/"))]
    found = [programs.torchrun(), programs.rpcrun()]
    for script in dict.fromkeys(scripts):
        if programs.uses_monarch(script):
            try:
                needs_monarch()
            except pytest.skip.Exception:
                continue
        found.append(programs.parsed(script))
    return found


@pytest.mark.parametrize("path", FLAG_PAGES, ids=[str(p.relative_to(ROOT)) for p in FLAG_PAGES])
def test_every_flag_a_page_names_is_a_flag(path):
    named = set()
    for piece in programs.code_on_page(path.read_text()):
        named |= set(re.findall(r"^--[A-Za-z][\w-]*", piece))
    for command in shown_commands(path):
        if "..." in command.argv:
            named |= {word.split("=")[0] for word in command.argv if word.startswith("--")}
    options = set().union(*(parsed.options() for parsed in page_programs(path)))
    missing = named - options - {"--help"}
    assert not missing, f"{sorted(missing)}: no program of this page takes it"


# --------- Links and pictures --------------------

TRACKED = {ROOT / name for name in subprocess.run(
    ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()}
FOLDERS = {folder for path in TRACKED for folder in path.parents}
PICTURES = sorted(path for path in TRACKED if path.suffix in (".png", ".svg"))


def link_targets(text):
    """The targets of a page's links and pictures (`[text](target)`, `![alt](target)`,
    `[name]: target`, `<img src="target">`), outside its code."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    text = re.sub(r"(?<!`)`[^`\n]+`(?!`)", "", text)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    targets = re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text)
    targets += re.findall(r"^\s*\[[^\]]+\]:\s*(\S+)", text, re.M)
    targets += re.findall(r"<(?:img|a)\b[^>]*\b(?:src|href)=\"([^\"]+)\"", text)
    return targets


def relative_links(path):
    """(target as written, the file it names, its #fragment or None) of each relative link."""
    found = []
    for target in link_targets(path.read_text()):
        if re.match(r"[A-Za-z][\w+.-]*:|//", target):  # https:, mailto:, ...
            continue
        file, _, fragment = target.partition("#")
        named = (path.parent / unquote(file)).resolve() if file else path
        found.append((target, named, unquote(fragment) if "#" in target else None))
    return found


def github_anchors(text):
    """The anchors GitHub gives a page's headings: the heading's text without its markup, in
    lower case, with what is not a letter, digit, space, - or _ removed and spaces made -; a
    second heading of the same anchor gets -1, a third -2. And the page's own <a name=...>."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    anchors, seen = set(), {}
    for heading in re.findall(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", text, re.M):
        heading = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
        heading = re.sub(r"<[^>]+>", "", heading)
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return anchors | set(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", text))


@pytest.mark.parametrize("path", MARKDOWN, ids=[str(p.relative_to(ROOT)) for p in MARKDOWN])
def test_every_relative_link_resolves(path):
    """Each relative link names a file or folder of the repository, a heading of the page it
    names (GitHub's anchors), or a line that the file has (#L42)."""
    for target, named, fragment in relative_links(path):
        assert named in TRACKED or named in FOLDERS, f"{target}: no such file in the repository"
        if not fragment:
            continue
        if named.suffix == ".md":
            anchors = github_anchors(named.read_text())
            assert fragment in anchors, f"{target}: no such heading ({sorted(anchors)})"
        else:
            lines = re.fullmatch(r"L(\d+)(?:-L(\d+))?", fragment)
            assert lines, f"{target}: a file other than a page has only line anchors (#L42)"
            length = len(named.read_text().splitlines())
            assert max(int(n) for n in lines.groups() if n) <= length, (
                f"{target}: {named.name} has {length} lines")


def test_every_picture_is_shown():
    shown = {named for path in MARKDOWN for _, named, _ in relative_links(path)}
    unshown = [str(path.relative_to(ROOT)) for path in PICTURES if path not in shown]
    assert not unshown, f"no page shows {unshown}"


# --------- Sample outputs --------------------

SAMPLES = [(path, match) for path in MARKDOWN
           for match in make_docs.BLOCK.finditer(path.read_text())]

# Lines that a sample shows but that no program of this repository writes, each known by
# where it comes from: torch.profiler's tables (rpc_profiling prints key_averages().table(): a
# rule of dashes, the header, rows and rules, then its "Self CPU time total"), and Monarch's
# line saying where its own logs go.
TABLE_RULE = re.compile(r"-+(?:  -+)* *")
TABLE_END = re.compile(r"Self CPU time total: \S+")
MONARCH_LOGS = re.compile(r"Monarch internal logs are being written to .*")
# torch's own C++ logs, in the plain command's output: glog's "[W1128 05:41:20.93 file:line]"
# and the profiler library's (Kineto) "USDT:2026-11-28 05:41:20 pid:tid file:line]"
TORCH_LOGS = re.compile(r"\[[IWEF]\d{4} .*|(?:USDT|INFO|WARNING|ERROR):\d{4}-\d\d-\d\d .*")


def own_lines(lines):
    """The lines of a sample output that its program wrote (not empty, not torch's tables or
    logs, not Monarch's)."""
    in_table = False
    for line in lines:
        if TABLE_RULE.fullmatch(line):
            in_table = True
        elif in_table:
            in_table = not TABLE_END.fullmatch(line)
        elif line.strip() and not MONARCH_LOGS.fullmatch(line) and not TORCH_LOGS.fullmatch(line):
            yield line


def sample_lines(body):
    """The lines of a sample output's ```text block."""
    return re.search(r"```text\n(.*?)\n```", body, re.S).group(1).splitlines()


@pytest.mark.parametrize("path, match", SAMPLES,
                         ids=[f"{p.relative_to(ROOT)}:{m.group('command').split()[1]}"
                              for p, m in SAMPLES])
def test_every_sample_output_is_what_its_program_prints_now(path, match):
    """Each command of a sample still parses with its program's parser, and each line of the
    output has the shape of a line that the first program (whose output the page shows) prints
    now: a format of its code, its words as they are, any value where the format has a field."""
    commands = programs.commands(path, [match.group("command").replace("{port}", "29500")])
    assert commands, f"{match.group('command')}: no command of a program"
    for command in commands:
        error = program(command.script).error(command.argv)
        assert error is None, f"`{command.text}`: {error}"
    files = programs.sources(commands[0].script)
    if commands[0].rpcrun_argv is not None:  # rpcrun's own lines too
        files += programs.SUPERVISOR
    patterns = programs.line_patterns(files)
    for line in own_lines(sample_lines(match.group("body"))):
        logged = programs.LOG_PREFIX.match(line)
        message = line[logged.end():] if logged else line
        assert programs.prints(patterns, message), (
            f"{line!r}: {commands[0].script} prints no line of this shape now; run `make docs`")
