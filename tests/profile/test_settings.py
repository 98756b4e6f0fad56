"""dsconform.settings: the one table of DSCONFORM_* variables MUST be the one the library reads
and the one docs/options.md shows users."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from dsconform import settings

ROOT = Path(__file__).resolve().parents[2]


def test_every_variable_the_library_reads_is_in_the_table():
    """A DSCONFORM_* name anywhere in dsconform/ or fixtures/ is a setting of the table (or the
    scripts' own variables, which the library never reads)."""
    out = subprocess.run(["git", "grep", "-ohE", r"DSCONFORM_[A-Z0-9_]+", "--", "dsconform",
                          "fixtures"], cwd=ROOT, capture_output=True, text=True, check=True)
    named = set(out.stdout.split())
    scripts_only = {"DSCONFORM_BUNDLE", "DSCONFORM_DEEPSPEED", "DSCONFORM_SITE",
                    "DSCONFORM_LIBAIO", "DSCONFORM_SUITE", "DSCONFORM_TIME_S",
                    "DSCONFORM_WORKDIR", "DSCONFORM_UPGRADE_FROM", "DSCONFORM_UPGRADE_TO"}
    missing = sorted(named - set(settings.SETTINGS) - scripts_only)
    assert not missing, f"read by the library but not in dsconform/settings.py: {missing}"


def test_no_module_reads_a_setting_from_the_environment_itself():
    """Only settings.py parses DSCONFORM_* text: a module with its own os.environ.get(...) would
    have a default and a parser of its own."""
    out = subprocess.run(["git", "grep", "-nE", r"environ(\.get)?[\[(]\"DSCONFORM_", "--",
                          "dsconform", "fixtures"], cwd=ROOT, capture_output=True, text=True)
    hits = [ln for ln in out.stdout.splitlines() if not ln.startswith("dsconform/settings.py")]
    assert not hits, "\n".join(hits)


def test_docs_list_every_setting():
    doc = (ROOT / "docs" / "options.md").read_text()
    listed = set(re.findall(r"^\| `(DSCONFORM_[A-Z0-9_]+)` \|", doc, re.M))
    missing = sorted(set(settings.SETTINGS) - listed)
    assert not missing, f"docs/options.md does not list {missing}"


def test_a_value_that_does_not_parse_names_the_variable():
    with pytest.raises(ValueError, match=r"DSCONFORM_MAX_POOLS='many': expected an integer"):
        settings.get("DSCONFORM_MAX_POOLS", {"DSCONFORM_MAX_POOLS": "many"})


@pytest.mark.parametrize(("name", "env", "value"), [
    ("DSCONFORM_STARTUP_TIMEOUT_S", {}, 300.0),
    ("DSCONFORM_SPARE_POOLS", {"DSCONFORM_SPARE_POOLS": " ON "}, "on"),
    ("DSCONFORM_RANK_WARMUP", {"DSCONFORM_RANK_WARMUP": "Off"}, False),
    ("DSCONFORM_RANK_WARMUP", {}, True),
    ("DSCONFORM_NIGHTLY", {"DSCONFORM_NIGHTLY": "0"}, False),
    ("DSCONFORM_NIGHTLY", {"DSCONFORM_NIGHTLY": "1"}, True),
    ("DSCONFORM_PORT_BASE", {"DSCONFORM_PORT_BASE": ""}, None),
    ("DSCONFORM_GPUS_PER_WORKER", {"DSCONFORM_GPUS_PER_WORKER": "2"}, 2),
])
def test_values_parse_as_the_code_uses_them(name, env, value):
    assert settings.get(name, env) == value
