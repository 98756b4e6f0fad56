"""ZERO-CLIP-1 MUST go red when ZeRO clips by a norm over each rank's own partition: training
still works, but it clips differently from DDP. Real DeepSpeed and DDP on 2 CPU ranks; the
fault is the ZeRO optimizers' norm all_reduce skipped (tests/perturbed_ranks.py)."""

from __future__ import annotations

import pytest

from dsconform.checks.equivalence import compare_rank_results
from dsconform.checks.tolerances import tolerance
from dsconform.checks.zero_vs_ddp import ZeroCase, clip_problems, train_zero_and_ddp
from dsconform.harness.api import run_ranks
from suites.test_zero import CLIP
from tests import perturbed_ranks


def _run(fn, case: ZeroCase):
    results = run_ranks(fn, 2, timeout_s=300, args=(case,), accelerator="cpu")
    cmp = compare_rank_results(results, tolerance("zero_clip", case.dtype, case.optimizer,
                                                  accelerator="cpu"), label=case.id)
    norm = tolerance("zero_clip_norm", case.dtype, case.optimizer, accelerator="cpu")
    return cmp, clip_problems(results, case, norm.rtol)


@pytest.mark.parametrize("case", [
    ZeroCase(stage=2, dtype="fp32", optimizer="sgd", grad_accum=1, world_size=2, clip=CLIP),
    ZeroCase(stage=3, dtype="fp32", optimizer="sgd", grad_accum=1, world_size=2, clip=CLIP),
    ZeroCase(stage=2, dtype="fp32", optimizer="cpu_adam", grad_accum=1, world_size=2,
             offload_optimizer=True, clip=CLIP),
], ids=lambda c: c.id)
def test_a_norm_over_one_partition_fails_and_the_real_one_passes(case):
    cmp, (problems, clipped, worst) = _run(train_zero_and_ddp, case)
    assert cmp.ok and not problems and clipped > 0, (cmp.report(), problems)
    cmp, (problems, clipped, worst) = _run(perturbed_ranks.train_zero_and_ddp_with_local_norm,
                                          case)
    assert problems and worst > 0.1, problems  # each rank sees about 1/sqrt(2) of the norm
    assert "DeepSpeed's global gradient norm" in problems[0] and "DDP's" in problems[0]
    assert not cmp.ok  # and it clipped the steps differently


def test_data_that_never_clips_fails_the_cell():
    case = ZeroCase(stage=2, dtype="fp32", optimizer="sgd", grad_accum=1, world_size=2, clip=5.0)
    _, (problems, clipped, _) = _run(train_zero_and_ddp, case)
    assert clipped == 0 and "the cell cannot show clipping" in problems[0], problems
