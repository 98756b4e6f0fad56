"""`dsconform --help` names every command and no partial list of them, `--version` prints the
version, and docs/options.md documents every command."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from dsconform import __version__, cli

ROOT = Path(__file__).resolve().parents[2]


def _commands() -> dict[str, str]:
    """Each command of the parser with its one-line help."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {c.dest: c.help for c in sub._choices_actions}


def test_the_parser_has_the_ten_commands():
    assert set(_commands()) == {"detect", "validate", "report", "compare", "aggregate", "health",
                                "nvme-tune", "bundle", "build-ops", "radar", "known-answers"}


def test_help_names_every_command_and_no_partial_list_of_them(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    head, _, listing = re.split(r"\n(commands|positional arguments):\n", text, maxsplit=1)
    for name, help_text in _commands().items():
        assert help_text, f"{name} has no help line"
        assert re.search(rf"^    {re.escape(name)}\b", listing, re.M), (name, listing)
    # The description between the usage and the listing names either every command or none
    # (a list of some of them reads as if that were all).
    description = head.split("\n\n", 1)[-1]
    named = [n for n in _commands() if re.search(rf"\b{re.escape(n)}\b", description)]
    assert named in ([], list(_commands())), named


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"dsconform {__version__}"


def test_options_md_documents_every_command():
    doc = (ROOT / "docs" / "options.md").read_text()
    missing = [n for n in _commands() if f"| `dsconform {n}" not in doc]
    assert not missing, f"docs/options.md's command table lacks {missing}"
    assert "`dsconform --version`" in doc
