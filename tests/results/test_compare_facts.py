"""The facts channel: ``facts.record(name, value)`` in a test reaches benchmarks.json under
``dsconform.facts`` (and records.jsonl as the test ends), also when the test fails afterwards,
so `dsconform compare` can name what silently changed between two runs."""

from __future__ import annotations

import json
import math

import pytest

from dsconform.results import compare, records
from dsconform.results import format as results_format

FACTS_SUITE = '''
import pytest

CAPABILITY = "demo"

def test_defaults(facts):
    """DEMO-DEF-1: defaults MUST be recorded."""
    facts.record("default.clipping", 1.0)
    facts.record("default.betas", (0.9, 0.999))
    facts.record("default.dtype", None)

def test_fails_after_recording(facts):
    """DEMO-DEF-2: a failing test keeps its facts."""
    facts.record("default.name", "AdamW")
    assert False, "moved"
'''


def _run(pytester, tmp_path, results: str):
    profile = tmp_path / "p0.toml"
    profile.write_text('[profile]\nname = "p0"\n[gpus]\ncount = 0\n')
    pytester.makepyfile(test_facts=FACTS_SUITE)
    return pytester.runpytest("-p", "fixtures.plugin", "--profile", str(profile), "--results",
                              str(pytester.path / results))


def test_facts_reach_benchmarks_json_and_the_journal(pytester, tmp_path):
    result = _run(pytester, tmp_path, "res")
    result.assert_outcomes(passed=1, failed=1)
    doc = json.loads((pytester.path / "res" / "benchmarks.json").read_text())
    got = {(f["nodeid"].split("::")[-1], f["name"]): f["value"] for f in doc["dsconform"]["facts"]}
    assert got == {("test_defaults", "default.clipping"): 1.0,
                   ("test_defaults", "default.betas"): [0.9, 0.999],
                   ("test_defaults", "default.dtype"): None,
                   ("test_fails_after_recording", "default.name"): "AdamW"}
    assert {f["capability"] for f in doc["dsconform"]["facts"]} == {"demo"}
    journal = [json.loads(ln) for ln in
               (pytester.path / "res" / "records.jsonl").read_text().splitlines()]
    assert sum(1 for e in journal if "fact" in e) == 4
    # compare reads them back, keyed by the conformance id.
    run = compare.read_run(results_format.load_benchmarks(pytester.path / "res"))
    assert run.facts["DEMO-DEF-1::default.betas"] == [0.9, 0.999]
    assert run.facts["DEMO-DEF-2::default.name"] == "AdamW"


def test_facts_recorder_normalises_and_rejects():
    seen = []
    rec = records.FactsRecorder("t.py::x", "c", seen.append)
    assert rec.record("betas", (0.9, 0.999)).value == [0.9, 0.999]  # as JSON will hold it
    assert rec.record("nested", {"a": (1, 2)}).value == {"a": [1, 2]}

    class Dtype:
        def __str__(self):
            return "torch.float16"

    assert rec.record("dtype", Dtype()).value == "torch.float16"
    assert [f.name for f in seen] == ["betas", "nested", "dtype"]
    with pytest.raises(ValueError, match="fact nan: value nan cannot be recorded as JSON"):
        rec.record("nan", math.nan)
    with pytest.raises(ValueError, match="fact name must be a non-empty string"):
        rec.record("", 1)


def test_document_carries_facts():
    f = records.Fact("t.py::x", "default.clipping", 1.0, "zero")
    d = records.document([], [], machine_info={}, commit_info={}, profile={}, facts=[f])
    assert d["dsconform"]["facts"] == [{"nodeid": "t.py::x", "name": "default.clipping",
                                        "value": 1.0, "capability": "zero"}]
