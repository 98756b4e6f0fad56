"""The ZeRO equivalence check MUST go red when DeepSpeed's update is off by a hair.

One real case of suites/test_zero.py (ZeRO-3, fp32 SGD, 2 ranks on the CPU accelerator) runs
twice: as is, where it is bit-exact, and with a fault injected into the DeepSpeed side only -
from step 5 on the loss is multiplied by 1.001 inside ``engine.backward`` (a wrapper applied in
the rank, suites/zero_ranks.py ``_perturb_backward``). The comparison must then fail and name
step 5, the gradient that diverged, and the tolerance it broke. Nothing is mocked: DeepSpeed
and DDP really train.
"""

from __future__ import annotations

import pytest

from dsconform.dist import run_ranks
from dsconform.equivalence import compare_rank_results
from dsconform.tolerances import tolerance
from suites.zero_ranks import ZeroCase, train_zero_and_ddp

CASE = ZeroCase(stage=3, dtype="fp32", optimizer="sgd", grad_accum=1, world_size=2, steps=8)
PERTURB_FROM_STEP = 5


def _compare(perturb: float):
    results = run_ranks(train_zero_and_ddp, CASE.world_size, timeout_s=180, args=(CASE,),
                        kwargs={"perturb": perturb, "perturb_from_step": PERTURB_FROM_STEP},
                        accelerator="cpu")
    tol = tolerance("zero", "fp32", "sgd", accelerator="cpu")
    return compare_rank_results(results, tol, label=CASE.id)


def test_unperturbed_case_is_bit_exact():
    """The control: without the fault the same case MUST compare equal (bit-exact)."""
    cmp = _compare(1.0)
    assert cmp.ok, cmp.report()
    assert cmp.worst_abs == 0.0


def test_perturbed_update_fails_naming_the_step():
    """With the loss scaled by 1.001 from step 5 the comparison MUST fail at step 5."""
    cmp = _compare(1.001)
    assert not cmp.ok
    first = cmp.first_divergence
    # The scaled loss changes step 5's gradient first; its loss was computed before backward.
    assert (first.step, first.quantity) == (PERTURB_FROM_STEP, "grad")
    # Everything before the fault is still identical.
    assert all(d.within for d in cmp.differences if d.step < PERTURB_FROM_STEP)
    # The gradient is off by about the factor (more where a sum cancels): 1e-3 relative.
    assert 5e-4 < first.max_rel < 1e-2
    with pytest.raises(AssertionError) as err:
        cmp.assert_ok()
    msg = str(err.value)
    assert msg.startswith(f"{CASE.id}: first diverging step {PERTURB_FROM_STEP}: "
                          f"step {PERTURB_FROM_STEP}, grad of '"), msg
    assert "max abs diff" in msg and "max rel diff" in msg
    assert f"exceeds tolerance rtol=0 atol=0 ({cmp.tol.why})" in msg
