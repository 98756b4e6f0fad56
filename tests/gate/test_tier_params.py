"""The declarative matrix helper: covering_cases keeps every pair and its must-cells;
tier_params marks the CPU tier, the GPU acceptance tier, the nightly rest and a one-GPU
node's tier as the suites state them."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from dsconform.base.pairwise import covering_cases, uncovered_pairs
from dsconform.gate.tiers import one_rank_twins, tier_params


@dataclass(frozen=True)
class Case:
    a: int
    b: str
    c: str
    world_size: int

    @property
    def id(self) -> str:
        return f"{self.a}-{self.b}-{self.c}-ws{self.world_size}"


def _axes(case: Case) -> dict:
    return {"a": case.a, "b": case.b, "c": case.c}


CASES = [Case(a, b, c, ws) for a, b, c, ws in
         itertools.product((0, 1, 2), ("x", "y"), ("p", "q", "r"), (2, 1))]


def test_the_covering_cases_hold_every_pair_and_the_must_cells():
    two = [c for c in CASES if c.world_size == 2]
    must = [Case(2, "y", "r", 2)]
    chosen = covering_cases(two, _axes, must=must)
    assert chosen[0] is two[two.index(must[0])]
    assert len(chosen) < len(two)
    axes = {"a": [0, 1, 2], "b": ["x", "y"], "c": ["p", "q", "r"]}
    assert not uncovered_pairs(axes, [_axes(c) for c in chosen])
    preferred = covering_cases(CASES, lambda c: {**_axes(c), "ws": c.world_size},
                               first={"ws": lambda ws: -ws})
    assert preferred[0].world_size == 2


def _marks(param) -> set[str]:
    return {m.name for m in param.marks}


def test_tier_params_mark_each_tier():
    def gpu_tier(cases):
        return covering_cases([c for c in cases if c.world_size == 2], _axes)

    def params(accel):
        return {p.id: p for p in tier_params(
            accel, CASES, cpu_tier=lambda c: c.a == 0 and c.world_size == 2, gpu_tier=gpu_tier,
            one_rank_tier=lambda cases, tier: one_rank_twins(cases, tier, _axes_key))}

    cpu = params("cpu")
    assert {i for i, p in cpu.items() if "slow" not in _marks(p)} == {
        f"cpu-{c.id}" for c in CASES if c.a == 0 and c.world_size == 2}
    cuda = params("cuda")
    tier = {f"cuda-{c.id}" for c in gpu_tier(CASES)}
    assert {i for i, p in cuda.items() if "slow" not in _marks(p)} == tier
    assert {i for i, p in cuda.items() if "covered_on_one_gpu" in _marks(p)} == tier
    assert {i for i, p in cuda.items() if "one_gpu_tier" in _marks(p)} == {
        i.replace("-ws2", "-ws1") for i in tier}
    assert all("gpu" in _marks(p) for p in cuda.values())


def _axes_key(case: Case) -> tuple:
    return (case.a, case.b, case.c)
