"""The pytest11 entry point: options parse as users type them, and the entry point is inert in
any other pytest project of the same environment.

These run real pytest processes (subprocess), since what is tested is what happens before and
during argument parsing, which an in-process pytester session would share with this one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _pytest(args: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSCONFORM_")}
    env.pop("PYTEST_ADDOPTS", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
                          cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def test_entry_point_is_registered():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="pytest11")}
    assert eps.get("dsconform") == "dsconform.plugin.options"


def test_unrelated_project_sees_no_trace_of_the_plugin(tmp_path):
    """Header, summary, results directory, hypothesis profile, torch import: none of them."""
    project = tmp_path / "other"
    project.mkdir()
    (project / "test_other.py").write_text(
        "import json, sys\n"
        "def test_one():\n"
        "    from hypothesis import settings\n"
        "    from hypothesis.errors import InvalidArgument\n"
        "    try:\n"
        "        settings.get_profile('soak')\n"
        "        ours = True\n"
        "    except InvalidArgument:\n"
        "        ours = False\n"
        "    state = {'torch': 'torch' in sys.modules, 'deepspeed': 'deepspeed' in sys.modules,\n"
        "             'dsconform_plugin': 'fixtures.plugin' in sys.modules,\n"
        "             'hypothesis_profiles_registered': ours}\n"
        "    open('state.json', 'w').write(json.dumps(state))\n")
    result = _pytest(["-v"], cwd=project)
    assert result.returncode == 0, result.stdout + result.stderr
    state = json.loads((project / "state.json").read_text())
    assert state == {"torch": False, "deepspeed": False, "dsconform_plugin": False,
                     "hypothesis_profiles_registered": False}
    # pytest lists every installed plugin distribution on its "plugins:" line; nothing else of
    # ours may appear: no header, no summary, no notice.
    shown = [ln for ln in result.stdout.splitlines() if not ln.startswith("plugins:")]
    assert "dsconform" not in "\n".join(shown).lower(), result.stdout
    assert not (project / "dsconform-results").exists()
    # (pytest-benchmark makes .benchmarks in any project, with or without us)
    left = sorted(p.name for p in project.iterdir() if p.name != ".benchmarks")
    assert left == ["state.json", "test_other.py"]


def test_options_with_a_space_from_the_checkout(tmp_path):
    """`pytest -m gpu --scratch DIR --results DIR`, values after a space, both directories
    outside the checkout: results where they were asked for. On this CPU machine the GPU tier
    fails (no GPU found), after every GPU test skipped with its reason."""
    scratch, results = tmp_path / "nvme", tmp_path / "nightly" / "node7"
    scratch.mkdir()
    result = _pytest(["-m", "gpu", "--scratch", str(scratch), "--results", str(results)],
                     cwd=ROOT)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "no GPU found on this node" in result.stdout
    assert f"dsconform scratch: {scratch}" in result.stdout
    assert (results / "summary.json").exists() and (results / "benchmarks.json").exists()
    assert list(scratch.iterdir()) == []  # nothing left behind


def test_options_with_a_space_from_another_directory(tmp_path):
    """`pytest /path/to/checkout/suites -m gpu --scratch DIR` from elsewhere reads the
    checkout's tox.ini and conftest.py, and writes its results relative to where it ran."""
    scratch, elsewhere = tmp_path / "scratch", tmp_path / "cwd"
    scratch.mkdir()
    elsewhere.mkdir()
    result = _pytest([str(ROOT / "suites"), "-m", "gpu", "--scratch", str(scratch),
                      "--results", "res"], cwd=elsewhere)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "no GPU found on this node" in result.stdout
    assert f"rootdir: {ROOT}" in result.stdout and "configfile: tox.ini" in result.stdout
    assert (elsewhere / "res" / "summary.json").exists()


@pytest.mark.parametrize("option", ["--profile", "--scratch", "--results"])
def test_options_are_documented_in_help(option, tmp_path):
    result = _pytest(["--help"], cwd=tmp_path)
    assert option in result.stdout
