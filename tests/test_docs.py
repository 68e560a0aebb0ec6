"""The documentation stays true: a short README, links that resolve, and commands that run as written.

The commands are the ``bash`` blocks of README.md, docs/cli.md, docs/builtin-models.md and docs/planner.md (each
once), run on this machine's CPU; commands that need a GPU, a hub model or the user's own files belong in ``text``
blocks, which are not run. The benchmark, training and CLI commands of every page's blocks, which take minutes to
hours or need what this machine lacks, are checked as far as their own argument parsers: every flag and value parses.
The ``python -c`` programs of every page, in blocks or inline, are checked as far as they can be without running
them: their imports resolve and each call of what they import takes the arguments it is given.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import re
import runpy
import shlex
from pathlib import Path

import pytest
from cli_ranks import cli_on_ranks

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
LINKED = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "pipelines" / "README.md"]
RUN = [README, *(ROOT / "docs" / name for name in ("cli.md", "builtin-models.md", "planner.md"))]

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")


def test_the_readme_is_short_and_undated():
    text = README.read_text()
    assert len(text.splitlines()) <= 250, f"README.md has {len(text.splitlines())} lines; move detail into docs/"
    assert not DATE.findall(text), f"dated figures belong in docs/benchmarks.md: {DATE.findall(text)}"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in ``path``, outside code blocks, with GitHub's ``-1`` suffixes for repeats."""
    found, repeats = set(), {}
    for line in FENCE.sub("", path.read_text()).splitlines():
        heading = re.match(r"#{1,6} (.+)", line)
        if heading:
            base = slug(heading.group(1))
            found.add(f"{base}-{repeats[base]}" if base in repeats else base)
            repeats[base] = repeats.get(base, 0) + 1
    return found


def broken_links(path: Path) -> list[str]:
    """The relative links in ``path`` (outside code blocks) whose file or ``#anchor`` does not exist."""
    broken = []
    for target in LINK.findall(FENCE.sub("", path.read_text())):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked here
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists():
            broken.append(f"{target}: no file {linked}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {linked.name}")
    return broken


def test_slugs_follow_github():
    assert slug('Which strategy pays: `paradiff plan` and `strategy="auto"`') == (
        "which-strategy-pays-paradiff-plan-and-strategyauto"
    )
    assert slug("2026-12-01 — what the ranks' agreement costs (load 0.9)") == (
        "2026-12-01--what-the-ranks-agreement-costs-load-09"
    )


def test_a_broken_link_is_caught(tmp_path):
    (tmp_path / "other.md").write_text("# A heading\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#a-heading) [gone](missing.md) [bad](other.md#nope) [self](#top)\n# Top\n")
    assert broken_links(page) == [
        f"missing.md: no file {tmp_path / 'missing.md'}",
        "other.md#nope: no heading #nope in other.md",
    ]


@pytest.mark.parametrize("path", LINKED, ids=lambda path: str(path.relative_to(ROOT)))
def test_links_resolve(path):
    assert not broken_links(path), broken_links(path)


def block_lines(path: Path, language: str | None = None) -> list[str]:
    """The non-empty lines of ``path``'s code blocks (of ``language`` only, when given), continuations joined and
    comments dropped."""
    lines = []
    for block_language, body in FENCE.findall(path.read_text()):
        if language is None or block_language == language:
            for line in body.replace("\\\n", " ").splitlines():
                line = line.split(" #")[0].strip() if not line.lstrip().startswith("#") else ""
                lines += [line] if line else []
    return lines


def commands(path: Path) -> list[str]:
    """The commands of ``path``'s ``bash`` blocks worth running here (:func:`block_lines`), leading ``pip install
    ... &&`` segments dropped (the test environment has them), and the test command itself and launcher lines
    (``torchrun``, ``accelerate``) left out."""
    found = []
    for line in block_lines(path, "bash"):
        parts = [part.strip() for part in line.split("&&")]
        while parts and parts[0].startswith("pip install"):
            parts.pop(0)
        line = " && ".join(parts)
        if line and not re.search(r"pytest|diffusers_floor\.sh|^(torchrun|accelerate)\b", line):
            found.append(line)
    return found


#: The README's first command, the main job: tests/test_cli.py runs it as written and checks what it prints.
README_FIRST = commands(README)[0]


def cases() -> list[tuple[Path, str]]:
    """Each command once, under the first page that shows it (builtin-models.md repeats the README's video
    command), but the README's first."""
    found: dict[str, Path] = {}
    for path in RUN:
        for command in commands(path):
            found.setdefault(command, path)
    return [(path, command) for command, path in found.items() if command != README_FIRST]


CASES = cases()


def test_the_documented_commands_are_few_and_cheap():
    """Each command costs seconds to tens of seconds here; the CI budget is a handful."""
    assert 0 < len(CASES) <= 8, [command for _, command in CASES]
    assert README_FIRST.startswith('paradiff generate "'), README_FIRST
    assert all(command.startswith("paradiff") for _, command in CASES), "only paradiff commands are run"


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("path", "command"), CASES, ids=[f"{path.name}:{command[:60]}" for path, command in CASES])
def test_documented_command_runs(pool2, path, command, tmp_path):
    """Each command's command line on the two ranks of a shared pool, as under ``torchrun``: the same arguments
    through the same ``main``, without starting and importing two more workers for each. The launcher a user's
    command starts is run by the README's first command (tests/test_cli.py), as written, in a new process."""
    args = shlex.split(command)
    code, _, err = cli_on_ranks(pool2, *args[1:], cwd=str(tmp_path))
    assert code == 0, f"{path.name}: `{command}` exited {code}:\n{err[-2000:]}"


#: A command line that runs a benchmark script, a paradiff module or the CLI.
PARSED = re.compile(r"^(python (benchmarks/\S+\.py|-m paradiff\.\S+)|paradiff [a-z])")


def parsed_commands() -> list[tuple[Path, str]]:
    """Every page's command lines, in any code block (:func:`block_lines`), that :data:`PARSED` matches and no other
    test runs, each once, but usage synopses (``[--flag X]``), whose words are no command."""
    run = {README_FIRST, *(command for _, command in CASES)}
    found: dict[str, Path] = {}
    for path in LINKED:
        for line in block_lines(path):
            if PARSED.match(line) and "[" not in line and line not in run:
                found.setdefault(line, path)
    return [(path, command) for command, path in found.items()]


PARSED_CASES = parsed_commands()


class _Parsed(Exception):
    """Raised where a command's parser has accepted its arguments, before it does any work."""


def parse_as_written(command: str, monkeypatch) -> None:
    """Run ``command`` in this process up to its argument parser's ``parse_args``, and stop there."""
    parse_args = argparse.ArgumentParser.parse_args

    def parse_then_stop(parser, args=None, namespace=None):
        parse_args(parser, args, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    words = shlex.split(command)
    if words[0] == "paradiff":
        from paradiff.cli import main

        main(words[1:])
    elif words[1] == "-m":
        importlib.import_module(words[2]).main(words[3:])
    else:
        monkeypatch.setattr("sys.argv", words[1:])
        monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
        runpy.run_path(str(ROOT / words[1]), run_name="__main__")


def test_the_parsed_commands_include_every_kind():
    """The collection finds benchmark scripts, training modules and CLI lines."""
    commands = [command for _, command in PARSED_CASES]
    assert any(command.startswith("python benchmarks/") for command in commands), commands
    assert any(command.startswith("python -m paradiff.builtin.motion_train") for command in commands), commands
    assert any(command.startswith("paradiff generate") for command in commands), commands


@pytest.mark.parametrize(
    ("path", "command"), PARSED_CASES, ids=[f"{path.name}:{command[:70]}" for path, command in PARSED_CASES]
)
def test_documented_command_parses(path, command, monkeypatch, capsys):
    """Each command gets as far as its parser's ``parse_args`` and its arguments parse: a flag renamed or dropped
    since the page was written fails here. What the command then does is not run."""
    try:
        with pytest.raises(_Parsed):
            parse_as_written(command, monkeypatch)
    except SystemExit as error:
        pytest.fail(f"{path.name}: `{command}` did not parse (exit {error.code}):\n{capsys.readouterr().err[-1500:]}")


#: A ``python -c`` program, in a code block or inline: its quoted source.
PYTHON_C = re.compile(r"""python -c (["'])(.*?)\1""", re.S)

PROGRAMS = [(path, match[1]) for path in LINKED for match in PYTHON_C.findall(path.read_text())]


def imported(node: ast.Import | ast.ImportFrom) -> dict[str, object]:
    """The names an import statement binds, and what they are bound to (it imports as Python would)."""
    if isinstance(node, ast.Import):  # ``import a.b`` imports a.b and binds a; ``import a.b as c`` binds a.b
        bound = {}
        for alias in node.names:
            module = importlib.import_module(alias.name)
            root = alias.name.partition(".")[0]
            bound[alias.asname or root] = module if alias.asname else importlib.import_module(root)
        return bound
    module = importlib.import_module(node.module)
    bound = {}
    for alias in node.names:
        try:
            bound[alias.asname or alias.name] = getattr(module, alias.name)
        except AttributeError:
            bound[alias.asname or alias.name] = importlib.import_module(f"{node.module}.{alias.name}")
    return bound


def resolve(expression: ast.expr, names: dict[str, object]):
    """What a dotted name of ``names``' (``T.train_vae``) is, or None where its root is not one of them."""
    if isinstance(expression, ast.Name):
        return names.get(expression.id)
    if isinstance(expression, ast.Attribute):
        owner = resolve(expression.value, names)
        if owner is not None:
            if not hasattr(owner, expression.attr):
                raise AttributeError(f"{ast.unparse(expression.value)} has no {expression.attr!r}")
            return getattr(owner, expression.attr)
    return None


def program_problems(source: str) -> list[str]:
    """Why ``source`` would fail before doing its work: an import that does not resolve, a name its module lacks, or
    a call of what it imported whose arguments the callee's signature does not take."""
    try:
        tree = ast.parse(source)
        names = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names.update(imported(node))
    except (SyntaxError, ImportError) as error:
        return [f"{type(error).__name__}: {error}"]
    problems = []
    for call in (node for node in ast.walk(tree) if isinstance(node, ast.Call)):
        try:
            callee = resolve(call.func, names)
        except AttributeError as error:
            problems.append(str(error))
            continue
        if (
            callee is None
            or any(isinstance(arg, ast.Starred) for arg in call.args)
            or None in (keyword.arg for keyword in call.keywords)
        ):
            continue
        try:
            signature = inspect.signature(callee)
        except (TypeError, ValueError):  # a builtin without one
            continue
        try:
            signature.bind(*call.args, **{keyword.arg: keyword.value for keyword in call.keywords})
        except TypeError as error:
            problems.append(f"{ast.unparse(call)}: {error}")
    return problems


def test_the_pages_python_programs_are_found():
    """Both forms are collected: the run log's multi-line block and the inline one-liner."""
    assert any("\n" in source for _, source in PROGRAMS), PROGRAMS
    assert any("\n" not in source for _, source in PROGRAMS), PROGRAMS


def test_a_broken_python_program_is_caught():
    assert not program_problems("import json\nfrom pathlib import Path\njson.dumps({}, indent=2); Path('x')")
    assert not program_problems("import email.mime.text\nemail.mime.text.MIMEText('x')")
    assert program_problems("from paradiff.builtin import train as T\nT.train_vae(1, 2, 3, contrasts=0.1)")
    assert program_problems("from paradiff.builtin import train as T\nT.train_the_vae(1)")
    assert program_problems("from paradiff.builtin import no_such_module")
    assert program_problems("print(")


@pytest.mark.parametrize(
    ("path", "source"), PROGRAMS, ids=[f"{path.name}:{source.strip()[:50]}" for path, source in PROGRAMS]
)
def test_documented_python_program_binds(path, source):
    """A function renamed, moved or given other parameters since the page was written fails here."""
    assert not program_problems(source), f"{path.name}: {program_problems(source)}"
