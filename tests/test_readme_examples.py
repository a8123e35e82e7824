"""Every `expertcache ...` example in README.md, docs/*.md and the reference traces' README names a command that
exists and only flags that command accepts (checked against the generated `--help`), so an example cannot rot
silently. Running each one for real needs the trained base or a GPU for some; what this checks is what goes stale
first: names."""

import re
import shlex
from pathlib import Path

import pytest

from expertcache.recipes.cli import COMMANDS, main

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "telemetry" / "reference" / "README.md"]


def examples() -> list[tuple[str, int, list[str]]]:
    """(file, line, tokens) of each `expertcache` command line inside a fenced code block (continuations joined,
    comments dropped)."""
    out = []
    for path in DOCS:
        in_code, buf, start = False, "", 0
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip().startswith("```"):
                in_code, buf = not in_code, ""
                continue
            if not in_code:
                continue
            if not buf:
                start = i
            buf += line.rstrip().removesuffix("\\") + " "
            if line.rstrip().endswith("\\"):
                continue
            text, buf = buf.strip(), ""
            if not text.startswith("expertcache "):
                continue
            try:
                toks = shlex.split(text, comments=True)
            except ValueError:
                toks = text.split("#")[0].split()
            out.append((path.name, start, toks))
    return out


EXAMPLES = examples()


def _help(argv: list[str], capsys) -> str:
    try:
        main([*argv, "--help"])
    except SystemExit:
        pass
    return capsys.readouterr().out


def test_there_are_examples_to_check():
    assert len(EXAMPLES) >= 20, len(EXAMPLES)


@pytest.mark.parametrize("where,line,toks", EXAMPLES, ids=[f"{w}:{n}" for w, n, _ in EXAMPLES])
def test_each_example_names_a_real_command_and_real_flags(where, line, toks, capsys):
    rest = toks[1:]
    if not rest or rest[0] in ("--help", "-h"):
        return
    cmd = rest[0]
    assert cmd in COMMANDS, f"{where}:{line}: no command {cmd!r}"
    argv = [cmd]
    if isinstance(COMMANDS[cmd], dict):
        assert len(rest) > 1 and rest[1] in COMMANDS[cmd], f"{where}:{line}: {cmd} has no action {rest[1:2]}"
        argv.append(rest[1])
    helptext = _help(argv, capsys)
    assert helptext, f"{where}:{line}: no --help for {argv}"
    for t in rest[len(argv):]:
        name = t.strip("[]")
        if not name.startswith("--") or name in ("--help", "--"):
            continue
        flag = name.split("=")[0]
        assert re.search(re.escape(flag) + r"\b", helptext), f"{where}:{line}: {' '.join(argv)} has no {flag}"
