"""Checkpoint throughput floors: validated in the profile, held by the recorder.

The real suite test (suites/test_checkpoint_files.py::test_save_throughput[cpu-torch]) runs in
a small pytest session (pytester) against profiles written for the purpose: with a floor no disk
meets it fails after recording every round, naming the metric, the floor and the engine; with a
floor any disk meets it passes. A floor for FastPersist on a node without GPUs is a broken promise.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsconform.profile.schema import ProfileError, load

ROOT = Path(__file__).resolve().parents[2]
CASE = str(ROOT / "suites" / "test_checkpoint_files.py")


def _profile(tmp_path: Path, floors: str) -> Path:
    path = tmp_path / "p.toml"
    path.write_text('[profile]\nname = "ckpt-floors"\n[gpus]\ncount = 0\n' + floors)
    return path


def test_profile_checkpoint_floors_are_validated(tmp_path):
    ok = load(_profile(tmp_path, '[[checkpoint.floors]]\nengine = "torch"\nsave_gbps = 0.5\n'
                                 'source = "measured"\n'))
    assert ok.checkpoint_floors[0].save_gbps == 0.5 and ok.checkpoint_floors[0].load_gbps is None
    with pytest.raises(ProfileError) as err:
        load(_profile(tmp_path, '[[checkpoint.floors]]\nengine = "nebula"\n'))
    assert [p.split(": ", 1)[1] for p in err.value.problems] == [
        "checkpoint.floors[0].engine: must be one of torch, fast (found 'nebula')",
        "checkpoint.floors[0]: needs save_gbps and/or load_gbps"]


def _run(pytester, tmp_path, floors: str, test: str = "test_save_throughput[cpu-torch]"):
    results = tmp_path / "res"
    return pytester.runpytest(f"{CASE}::{test}", "--profile", str(_profile(tmp_path, floors)),
                              "--results", str(results), "-p", "no:cacheprovider"), results


def test_a_save_floor_no_disk_meets_fails_after_recording(pytester, tmp_path):
    result, results = _run(pytester, tmp_path,
                           '[[checkpoint.floors]]\nengine = "torch"\nsave_gbps = 1e6\n'
                           'source = "impossible"\n')
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*recorded beyond its limit: checkpoint.save = * GB/s (median "
                                 "of 3 rounds: *) is below its floor 1e+06 GB/s ?engine=torch,*"
                                 "source=impossible*"])
    doc = json.loads((results / "benchmarks.json").read_text())
    (bench,) = [b for b in doc["benchmarks"] if b["extra_info"]["metric"] == "checkpoint.save"]
    assert bench["extra_info"]["rate"]["limit"] == 1e6 and bench["stats"]["rounds"] == 3


def test_a_save_floor_the_disk_meets_passes(pytester, tmp_path):
    result, _ = _run(pytester, tmp_path,
                     '[[checkpoint.floors]]\nengine = "torch"\nsave_gbps = 1e-6\n')
    result.assert_outcomes(passed=1)


def test_a_fast_floor_without_gpus_is_a_broken_promise(pytester, tmp_path):
    result, _ = _run(pytester, tmp_path,
                     '[[checkpoint.floors]]\nengine = "fast"\nsave_gbps = 1.0\n',
                     test="test_save_throughput[cpu-fast]")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*profile ckpt-floors promises checkpoint.floors engine 'fast', "
                                 "which needs a GPU*found none*"])
