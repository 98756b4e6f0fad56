"""The flops suite's checks MUST go red when DeepSpeed's profiler miscounts by a factor.

Each test runs the suite's own rank code (suites/flops_ranks.py) and judgement
(suites/test_flops.py) on the real profiler (the CPU accelerator), first as it is (the control:
no problem) and then with ``scale=2``: DeepSpeed's own counting functions for torch.matmul and
F.linear (``_matmul_flops_compute``, ``_linear_flops_compute`` in its profiler module) return
twice their flops and MACs. FLOPS-COUNT-1 and FLOPS-ENGINE-1 MUST then fail, naming the count,
both values and the factor. Nothing is mocked: the profiler patches torch and counts as always.
"""

from __future__ import annotations

import pytest

from suites.test_flops import CELLS, engine_counts, run_cell, run_engine


@pytest.mark.parametrize("name", ["linear", "matmul", "bmm", "linear_twice"])
def test_count_off_by_a_factor_fails(name):
    assert run_cell(name, "cpu") == []  # the control
    problems = run_cell(name, "cpu", scale=2.0)
    counts = CELLS[name].counts
    assert f"flops {2 * counts.flops}, analytic {counts.flops} (2x)" in "\n".join(problems), \
        problems
    assert f"macs {2 * counts.macs}, analytic {counts.macs} (2x)" in "\n".join(problems)
    assert not any("params" in p for p in problems), problems  # parameters are not counted


def test_engine_count_off_by_a_factor_fails(tmp_path):
    assert run_engine(0, "cpu", str(tmp_path / "control.txt")) == []  # the control
    problems = run_engine(0, "cpu", str(tmp_path / "scaled.txt"), scale=2.0)
    text = "\n".join(problems)
    expected = engine_counts()
    assert f"the profiler during step 2: flops {2 * expected.flops}, analytic " \
           f"{expected.flops} (2x)" in text, text
    assert f"engine.flops_profiler after the step: macs {2 * expected.macs}" in text, text
