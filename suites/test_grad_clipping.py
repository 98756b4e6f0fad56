"""Gradient clipping helpers: DeepSpeed's gradient-norm and clipping utilities
(``deepspeed.runtime.utils``: ``clip_grad_norm_``, ``get_flattened_grad_norm``,
``get_global_norm_of_tensors``; for the 2-norm also ``get_global_norm`` and
``clip_tensors_by_global_norm``) MUST compute the norm ``torch.nn.utils.clip_grad_norm_``
computes, for norm types 1, 2 and inf, and clip to what it clips, on one rank, on replicated
ranks, and across ranks that each hold a slice of every gradient (a model-parallel unit over
the ranks: the norm over the slices is the norm over the whole).

Gradients span six decades with one element far above the rest, sizes 1, 53, 13 x 7 and 4103;
``max_norm`` is half the true norm, so every helper that clips must clip by 0.5. The bound is
``dsconform/checks/tolerances.py`` "clip_norm".

- CLIP-NORM-1 (``test_norm_matches_torch``): on one rank and on two replicated ranks, every
  helper's norm MUST equal torch's, and the clipped gradients torch's clipped gradients.
- CLIP-NORM-2 (``test_norm_across_ranks``): with each rank holding a slice of every gradient
  and a model-parallel unit spanning the ranks, ``clip_grad_norm_``,
  ``get_flattened_grad_norm`` and ``get_global_norm_of_tensors`` MUST give torch's norm of the
  whole gradients on every rank, and ``clip_grad_norm_`` MUST clip every slice by torch's
  coefficient.

Upstream: https://www.deepspeed.ai/docs/config-json/#gradient-clipping ,
https://pytorch.org/docs/stable/generated/torch.nn.utils.clip_grad_norm_.html

Stable ids: CLIP-NORM-1, CLIP-NORM-2; each case id (``cpu-inf-ws2``) names its cell.
"""

from __future__ import annotations

import math

import pytest

from dsconform.suite import (
    ACCELERATORS,
    accel_cell,
    requires,
    run_ranks,
    tensor_difference,
    tolerance,
)
from suites.grad_clipping_ranks import norms

CAPABILITY = "clipping"
TIMEOUT_S = 120
NORM_TYPES = {"1": 1.0, "2": 2.0, "inf": math.inf}
SEED = 11


def judge(results: list[dict], accelerator: str, profile=None) -> list[str]:
    """Every rank's helpers against torch: the norm, then the clipped gradients."""
    tol = tolerance("clip_norm", "fp32", "sgd", getattr(profile, "tolerances", None),
                    accelerator=accelerator)
    problems = []
    for r in results:
        want = r["torch_norm"]
        for name, got in r["helpers"].items():
            rel = abs(got - want) / want
            if not rel <= tol.rtol:
                problems.append(f"rank {r['rank']}: {name} gave norm {got:.9g}, torch "
                                f"{want:.9g} (rel diff {rel:.3g})")
        for name, got in r["clipped"].items():
            mabs, mrel, ok = tensor_difference(got, r["torch_clipped"], tol)
            if not ok:
                problems.append(f"rank {r['rank']}: {name} clipped the gradients to other "
                                f"values than torch (max abs diff {mabs:.3g}, max rel diff "
                                f"{mrel:.3g})")
    if problems:
        problems.append(f"tolerance: {tol} ({tol.why})")
    return problems


def check(accelerator: str, norm: str, world_size: int, sharded: bool, profile=None,
          tamper: str | None = None) -> list[str]:
    results = run_ranks(norms, world_size, timeout_s=TIMEOUT_S, args=(NORM_TYPES[norm], SEED),
                        kwargs={"sharded": sharded, "tamper": tamper}, accelerator=accelerator)
    return judge(results, accelerator, profile)


# The two-rank GPU cells are the acceptance tier (measured on an H200 against the table's
# bound, docs/suites.md); a node with one GPU runs their one-rank twins.
GPU_ACCEPTANCE = True


def _role(accel: str, ws: int, world_sizes: tuple[int, ...]) -> str | None:
    """GPUs: the two-rank cells are the acceptance tier; a node with one GPU runs their one-rank
    twins instead (the norm of replicated ranks is the norm of one)."""
    if accel != "cuda" or len(world_sizes) == 1 or not GPU_ACCEPTANCE:
        return None
    return "tier" if ws == 1 else "covered"


def _cells(world_sizes: tuple[int, ...]) -> list:
    return [accel_cell(accel, norm, ws, id=f"{norm}-ws{ws}", world_size=ws,
                       one_gpu=_role(accel, ws, world_sizes),
                       slow=(accel == "cuda" and not GPU_ACCEPTANCE)
                       or _role(accel, ws, world_sizes) == "tier")
            for accel in ACCELERATORS for norm in NORM_TYPES for ws in world_sizes]


@pytest.mark.parametrize("accelerator, norm, world_size", _cells((1, 2)))
def test_norm_matches_torch(accelerator: str, norm: str, world_size: int, profile):
    """CLIP-NORM-1: DeepSpeed's norm helpers MUST give torch's norm and clipped gradients."""
    problems = check(accelerator, norm, world_size, False, profile)
    assert not problems, f"{norm}-norm on {world_size} rank(s):\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("accelerator, norm, world_size", _cells((2,)))
@requires(two_ranks="each rank holds a slice of every gradient")
def test_norm_across_ranks(accelerator: str, norm: str, world_size: int, profile):
    """CLIP-NORM-2: the norm over every rank's slices MUST be torch's norm of the whole."""
    problems = check(accelerator, norm, world_size, True, profile)
    assert not problems, (f"{norm}-norm over {world_size} ranks' slices:\n  "
                          + "\n  ".join(problems))
