"""How the suite installs: constraints.txt agrees with pyproject.toml's bounds, pins no torch,
and installing the suite beside the node's torch never replaces it."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from dsconform.base import versions
from tests.harness.test_dist import REPO

PYPROJECT = tomllib.loads(Path(REPO, "pyproject.toml").read_text())["project"]


def _lock() -> dict[str, Version]:
    pins = {}
    for line in Path(REPO, "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        (spec,) = req.specifier
        assert spec.operator == "==", f"constraints.txt: {line!r} is not an exact pin"
        pins[canonicalize_name(req.name)] = Version(spec.version)
    return pins


#: The extras CI installs with the lock (.ci/run); the others are the user's choice.
LOCKED_EXTRAS = ("lint", "plot", "k8s")


def _declared() -> list[Requirement]:
    extras = PYPROJECT["optional-dependencies"]
    return [Requirement(r) for r in PYPROJECT["dependencies"]] + \
        [Requirement(r) for name in LOCKED_EXTRAS for r in extras[name]]


def test_the_lock_pins_every_declared_dependency_within_its_bounds():
    lock = _lock()
    for req in _declared():
        name = canonicalize_name(req.name)
        if name == "torch":
            continue
        assert name in lock, f"constraints.txt pins no {req.name} (pyproject.toml: {req})"
        assert req.specifier.contains(lock[name], prereleases=True), \
            f"constraints.txt: {req.name}=={lock[name]} is outside pyproject.toml's {req}"


def test_the_lock_leaves_torch_to_the_node():
    assert "torch" not in _lock(), "constraints.txt must not pin torch: the node's stays"


def test_torch_has_no_upper_bound():
    (torch,) = [r for r in _declared() if r.name == "torch"]
    assert all(s.operator in (">=", ">") for s in torch.specifier), torch
    assert versions.public(str(min(Version(s.version) for s in torch.specifier))) <= \
        Version(min(versions.TORCH_RUN_WITH, key=Version))


def test_installing_the_suite_beside_the_installed_torch_changes_no_torch(tmp_path):
    """pip's own resolve of `pip install -e .` (dry run, this environment's packages kept):
    the torch already here satisfies it, whatever its release."""
    report = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--no-index",
         "--no-build-isolation", "--report", str(report), "-e", REPO],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    planned = {i["metadata"]["name"].lower(): i["metadata"]["version"]
               for i in json.loads(report.read_text())["install"]}
    assert "torch" not in planned, \
        f"pip would replace torch {metadata.version('torch')} with {planned['torch']}"


def test_the_header_says_whether_torch_is_one_the_suite_was_run_with():
    assert "has been run with" in versions.torch_note("2.13.0+cpu")
    assert "not a release" not in versions.torch_note("2.14.1")
    assert "not a release" in versions.torch_note("2.15.0")
    assert "not a release" in versions.torch_note(None)
