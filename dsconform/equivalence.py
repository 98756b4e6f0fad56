"""Compare two training traces (ZeRO and its DDP reference) and say where they part.

A trace is a mapping with ``losses`` (one float per step), ``grads`` (one ``{name: tensor}`` per
step, taken at the accumulation boundary before the optimizer step) and ``params`` (``{name:
tensor}`` after the last step). Every element is compared the way ``torch.isclose`` does:
``|actual - expected| <= atol + rtol * |expected|``; a tolerance of (0, 0) means bit-exact.

A failure names the first diverging step, the parameter, the max abs and rel difference and the
tolerance it broke, so a red run says where to look without re-running anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import torch

from dsconform.tolerances import Tol

# Within one step the gradient is computed before the update that moves the parameters.
_ORDER = {"loss": 0, "grad": 1, "param": 2}


@dataclass(frozen=True)
class Difference:
    """How far one compared quantity is from its reference."""
    quantity: str   # "loss", "grad" or "param"
    step: int       # training step; final parameters carry the last step
    name: str       # parameter name, or "loss"
    where: str      # e.g. "rank 1"; "" when there is one trace
    max_abs: float
    max_rel: float
    within: bool
    numel: int = 1

    def describe(self) -> str:
        what = "loss" if self.quantity == "loss" else f"{self.quantity} of '{self.name}'"
        at = f" ({self.where})" if self.where else ""
        return (f"step {self.step}, {what}{at}: max abs diff {self.max_abs:.3g}, "
                f"max rel diff {self.max_rel:.3g}")


def tensor_difference(actual: torch.Tensor, expected: torch.Tensor,
                      tol: Tol) -> tuple[float, float, bool]:
    """(max abs diff, max rel diff, every element within tol). Compared in float64 so the
    comparison adds no rounding of its own; rel is |a-b|/|b| (inf where b == 0 != a)."""
    if tuple(actual.shape) != tuple(expected.shape):
        raise ValueError(f"shape mismatch: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    a = actual.detach().to("cpu", torch.float64)
    b = expected.detach().to("cpu", torch.float64)
    if a.numel() == 0:
        return 0.0, 0.0, True
    both_nan = torch.isnan(a) & torch.isnan(b)
    diff = (a - b).abs()
    diff = torch.where(both_nan | (a == b), torch.zeros_like(diff), diff)  # inf == inf too
    diff = torch.nan_to_num(diff, nan=math.inf)
    rel = torch.where(diff == 0, torch.zeros_like(diff), diff / b.abs())
    within = bool(((diff == 0) | (diff <= tol.atol + tol.rtol * b.abs())).all())
    return float(diff.max()), float(rel.max()), within


@dataclass
class Comparison:
    """Every difference between a candidate run and its reference, under one tolerance."""
    tol: Tol
    label: str = ""
    differences: list[Difference] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(d.within for d in self.differences)

    @property
    def failures(self) -> list[Difference]:
        return sorted((d for d in self.differences if not d.within),
                      key=lambda d: (d.step, _ORDER[d.quantity], d.where, d.name))

    @property
    def first_divergence(self) -> Difference | None:
        failures = self.failures
        return failures[0] if failures else None

    @property
    def worst_abs(self) -> float:
        return max((d.max_abs for d in self.differences), default=0.0)

    @property
    def worst_rel(self) -> float:
        return max((d.max_rel for d in self.differences), default=0.0)

    def worst(self, quantity: str) -> tuple[float, float]:
        """(max abs, max rel) over one quantity: "loss", "grad" or "param"."""
        ds = [d for d in self.differences if d.quantity == quantity]
        return (max((d.max_abs for d in ds), default=0.0),
                max((d.max_rel for d in ds), default=0.0))

    def extend(self, other: "Comparison") -> "Comparison":
        if other.tol != self.tol:
            raise ValueError("cannot merge comparisons made under different tolerances")
        self.differences.extend(other.differences)
        return self

    def report(self, limit: int = 5) -> str:
        tol = (f"tolerance rtol={self.tol.rtol:g} atol={self.tol.atol:g}"
               f" ({self.tol.why})" if self.tol.why else "")
        head = f"{self.label}: " if self.label else ""
        first = self.first_divergence
        if first is None:
            return (f"{head}equivalent: worst abs diff {self.worst_abs:.3g}, worst rel diff "
                    f"{self.worst_rel:.3g} within {tol}")
        failures = self.failures
        lines = [f"{head}first diverging step {first.step}: {first.describe()} exceeds {tol}",
                 f"{len(failures)} of {len(self.differences)} compared quantities out of "
                 f"tolerance; worst abs diff {self.worst_abs:.3g}, worst rel diff "
                 f"{self.worst_rel:.3g}"]
        lines += [f"  {d.describe()}" for d in failures[1:limit]]
        if len(failures) > limit:
            lines.append(f"  ... {len(failures) - limit} more")
        return "\n".join(lines)

    def assert_ok(self) -> None:
        if not self.ok:
            raise AssertionError(self.report())


def compare_traces(actual: Mapping[str, Any], expected: Mapping[str, Any], tol: Tol, *,
                   label: str = "", where: str = "") -> Comparison:
    """Compare losses per step, gradients per step and final parameters of two traces."""
    cmp = Comparison(tol=tol, label=label)
    a_loss: Sequence[float] = actual["losses"]
    b_loss: Sequence[float] = expected["losses"]
    if len(a_loss) != len(b_loss):
        raise ValueError(f"{label or 'traces'}: {len(a_loss)} steps vs {len(b_loss)} in the "
                         f"reference")
    for step, (a, b) in enumerate(zip(a_loss, b_loss)):
        mabs, mrel, ok = tensor_difference(torch.tensor(float(a)), torch.tensor(float(b)), tol)
        cmp.differences.append(Difference("loss", step, "loss", where, mabs, mrel, ok))
    a_grads = actual.get("grads") or []
    b_grads = expected.get("grads") or []
    if a_grads and len(a_grads) != len(b_grads):
        raise ValueError(f"{label or 'traces'}: gradients of {len(a_grads)} steps vs "
                         f"{len(b_grads)} in the reference")
    for step, (ga, gb) in enumerate(zip(a_grads, b_grads)):
        cmp.differences.extend(_named(ga, gb, tol, "grad", step, where))
    last = len(b_loss) - 1
    cmp.differences.extend(_named(actual["params"], expected["params"], tol, "param", last,
                                  where))
    return cmp


def _named(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], tol: Tol,
           quantity: str, step: int, where: str) -> Iterable[Difference]:
    if set(actual) != set(expected):
        raise ValueError(f"{quantity} names differ at step {step}: only in candidate "
                         f"{sorted(set(actual) - set(expected))}, only in reference "
                         f"{sorted(set(expected) - set(actual))}")
    for name in expected:
        if actual[name] is None:
            raise ValueError(f"{quantity} of '{name}' at step {step} is None in the candidate")
        mabs, mrel, ok = tensor_difference(actual[name], expected[name], tol)
        yield Difference(quantity, step, name, where, mabs, mrel, ok, expected[name].numel())


def compare_rank_results(per_rank: Sequence[Mapping[str, Any]], tol: Tol, *, label: str = "",
                         candidate: str = "ds", reference: str = "ddp") -> Comparison:
    """Compare every rank's candidate trace with that rank's reference trace.

    ``per_rank`` is what run_ranks returned: one mapping per rank holding ``rank`` and the two
    traces under ``candidate`` and ``reference``. Losses differ per rank (each rank sees its own
    data); gradients and parameters are full (gathered) on every rank and compared on each.
    """
    if not per_rank:
        raise ValueError(f"{label or 'comparison'}: no rank results")
    cmp = Comparison(tol=tol, label=label)
    for i, result in enumerate(per_rank):
        where = f"rank {result.get('rank', i)}" if len(per_rank) > 1 else ""
        cmp.extend(compare_traces(result[candidate], result[reference], tol, label=label,
                                  where=where))
    return cmp
