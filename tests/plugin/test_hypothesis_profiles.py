"""The hypothesis profile a run takes: ``ci`` for the acceptance tier (``-m gpu`` without
``--nightly``), unless one was chosen; ``dev`` elsewhere (dsconform.plugin.hypothesis_profiles).
Each case is a pytest process of its own: the profile is global to a process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

DEMO = '''
from hypothesis import settings


def test_profile():
    print("PROFILE", settings._current_profile, settings().max_examples)
'''


@pytest.mark.parametrize("args, env, want", [
    (["-m", "gpu or not gpu"], {}, "ci 5"),
    (["-m", "gpu or not gpu", "--nightly"], {}, "dev 10"),
    (["-m", "not gpu"], {}, "dev 10"),
    ([], {}, "dev 10"),
    (["-m", "gpu or not gpu"], {"HYPOTHESIS_PROFILE": "soak"}, "soak 200"),
    (["-m", "gpu or not gpu", "--hypothesis-profile", "dev"], {}, "dev 10"),
], ids=["acceptance", "nightly", "not-gpu", "no-mark", "env-chosen", "option-chosen"])
def test_the_acceptance_tier_takes_ci_unless_a_profile_was_chosen(tmp_path, args, env, want):
    (tmp_path / "test_profile_demo.py").write_text(DEMO)
    base = {k: v for k, v in os.environ.items() if k not in ("CI", "HYPOTHESIS_PROFILE")}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "test_profile_demo.py", "-s", "-p", "fixtures.plugin",
         "-p", "no:cacheprovider", "--rootdir", str(tmp_path), *args],
        cwd=tmp_path, env={**base, **env, "PYTHONPATH": str(ROOT)}, capture_output=True,
        text=True, timeout=300)
    assert f"PROFILE {want}" in proc.stdout, proc.stdout + proc.stderr
