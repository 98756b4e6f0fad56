"""A matrix's tiers as parameters: which cells run in the CPU tier, in the GPU acceptance tier
(a pairwise covering array, dsconform.base.pairwise.covering_cases) and on a node with one GPU;
every other cell is nightly (``slow``). A suite states the three and gets its parameters:

    for accel in ACCELERATORS:
        params += tier_params(accel, matrix(), cpu_tier=in_cpu_tier, gpu_tier=gpu_tier,
                              one_rank_tier=one_rank_tier, marks=needs)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from dsconform.gate.requires import accel_cell


def one_rank_twins(cases: Sequence[Any], tier: Sequence[Any],
                   key: Callable[[Any], Any]) -> list[Any]:
    """The one-rank cases whose ``key`` (a case without its world size) a tier case has: a
    one-GPU node's tier where the check needs no second rank."""
    keys = {key(c) for c in tier}
    return [c for c in cases if c.world_size == 1 and key(c) in keys]


def tier_params(accelerator: str, cases: Iterable[Any], *,
                cpu_tier: Callable[[Any], bool],
                gpu_tier: Callable[[list[Any]], Sequence[Any]],
                one_rank_tier: Callable[[list[Any], Sequence[Any]], Sequence[Any]] | None = None,
                marks: Callable[[Any], list] = lambda case: [],
                cell_id: Callable[[Any], str] = lambda case: case.id) -> list:
    """One ``accel_cell(accelerator, case)`` per case (its world size ``case.world_size``).
    CPU: ``cpu_tier(case)`` says which cells run, the rest are ``slow``. CUDA: the cases of
    ``gpu_tier(cases)`` run; on a node with one GPU the cases of ``one_rank_tier(cases,
    gpu tier)`` run in the place of the tier's cases of more ranks (``one_gpu``: "tier" and
    "covered")."""
    cases = list(cases)
    tier: set[int] = set()
    one_rank: set[int] = set()
    if accelerator == "cuda":
        chosen = list(gpu_tier(cases))
        tier = {id(c) for c in chosen}
        if one_rank_tier is not None:
            one_rank = {id(c) for c in one_rank_tier(cases, chosen)}
    out = []
    for case in cases:
        if accelerator == "cuda":
            ran = id(case) in tier
            role = ("tier" if id(case) in one_rank
                    else "covered" if ran and case.world_size != 1 else None)
        else:
            ran, role = cpu_tier(case), None
        out.append(accel_cell(accelerator, case, id=cell_id(case), world_size=case.world_size,
                              marks=marks(case), slow=not ran, one_gpu=role))
    return out
