"""Compare two training traces (ZeRO and its DDP reference) and say where they part.

A trace is a mapping with ``losses`` (one float per step), ``grads`` (one ``{name: tensor}`` per
step, taken at the accumulation boundary before the optimizer step), ``params`` (``{name:
tensor}`` after the last step) and, for a tolerance that bounds the whole update, ``init`` (the
parameters before the first step). Every element is compared the way ``torch.isclose`` does:
``|actual - expected| <= atol + rtol * |expected|``; a tolerance of (0, 0) means bit-exact.
Where the tolerance has ``update``/``gain`` (see ``Tol``), the run's whole update (all
parameters' ``params - init`` as one vector) is compared with the reference's too: quantities
"update" (norm-relative difference) and "gain" (the least-squares scale of one on the other).

A failure names the first diverging step, the parameter, the max abs and rel difference and the
tolerance it broke, so a red run says where to look without re-running anything.

A comparison that could compare nothing is a failure, never a pass: a trace with no losses, no
gradients or no parameters on either side, different numbers of them on the two sides, and any
NaN or inf on either side (a diverged reference proves nothing; NaN == NaN is not agreement).
Those are ``problems`` of the comparison, each naming the step and the tensor.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dsconform.checks.tolerances import Tol
from dsconform.results.format import is_number

# Within one step the gradient is computed before the update that moves the parameters. A
# "state" (compare_states: a checkpointed leaf) has no order of its own within a step.
_ORDER = {"loss": 0, "grad": 1, "param": 2, "update": 3, "gain": 4, "tensor_gain": 5,
          "state": 6}
WHOLE = "all parameters"  # the name of the whole-update quantities


@dataclass(frozen=True)
class Difference:
    """How far one compared quantity is from its reference."""
    quantity: str   # "loss", "grad", "param", "state", or the whole run's "update" / "gain"
    step: int       # training step; final parameters carry the last step
    name: str       # parameter name, "loss", or WHOLE
    where: str      # e.g. "rank 1"; "" when there is one trace
    max_abs: float  # update: |Δ - Δref|; gain: |gain - 1|
    max_rel: float  # update: |Δ - Δref| / |Δref|; gain: |gain - 1|
    within: bool
    numel: int = 1
    value: float | None = None  # gain: the gain itself

    def describe(self) -> str:
        at = f" ({self.where})" if self.where else ""
        if self.quantity == "update":
            return (f"step {self.step}, update of {self.name}{at}: |delta - delta_ref| / "
                    f"|delta_ref| = {self.max_rel:.3g} (delta: final minus initial parameters)")
        if self.quantity == "gain":
            return (f"step {self.step}, gain of {self.name}{at}: the update is {self.value:.4g}x "
                    f"the reference's (<delta, delta_ref> / |delta_ref|^2)")
        if self.quantity == "tensor_gain":
            return (f"step {self.step}, gain of '{self.name}'{at}: its update is "
                    f"{self.value:.4g}x the reference's (<delta, delta_ref> / |delta_ref|^2 over "
                    f"this tensor)")
        what = "loss" if self.quantity == "loss" else f"{self.quantity} of '{self.name}'"
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


def non_finite(t: torch.Tensor) -> str | None:
    """"3 NaN, 1 inf of 15 elements" when ``t`` has non-finite values, else None."""
    t = t.detach()
    if not (t.is_floating_point() or t.is_complex()):
        return None
    finite = torch.isfinite(t)
    if bool(finite.all()):
        return None
    nan = int(torch.isnan(t).sum())
    inf = int(t.numel() - int(finite.sum()) - nan)
    parts = [f"{nan} NaN" if nan else "", f"{inf} inf" if inf else ""]
    return f"{', '.join(p for p in parts if p)} of {t.numel()} elements"


@dataclass
class Comparison:
    """Every difference between a candidate run and its reference, under one tolerance.

    ``problems`` are reasons the comparison itself cannot vouch for equivalence (nothing to
    compare, unequal counts, non-finite values); any problem makes the comparison fail.
    ``notes`` say what a failure looks like (a diagnosis); they never decide ``ok`` and the
    report prints them in full, after the rest.
    """
    tol: Tol
    label: str = ""
    differences: list[Difference] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and bool(self.differences) and \
            all(d.within for d in self.differences)

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
        """(max abs, max rel) over one quantity: "loss", "grad", "param", "update", "gain"."""
        ds = [d for d in self.differences if d.quantity == quantity]
        return (max((d.max_abs for d in ds), default=0.0),
                max((d.max_rel for d in ds), default=0.0))

    def extend(self, other: Comparison) -> Comparison:
        if other.tol != self.tol:
            raise ValueError("cannot merge comparisons made under different tolerances")
        self.differences.extend(other.differences)
        self.problems.extend(other.problems)
        self.notes.extend(other.notes)
        return self

    def report(self, limit: int = 5) -> str:
        return "\n".join([self._report(limit), *self.notes])

    def _report(self, limit: int) -> str:
        tol = f"tolerance {self.tol} ({self.tol.why})" if self.tol.why else ""
        head = f"{self.label}: " if self.label else ""
        if self.problems or not self.differences:
            problems = self.problems or ["nothing was compared"]
            lines = [f"{head}cannot vouch for equivalence: {problems[0]}"]
            lines += [f"  {p}" for p in problems[1:limit]]
            if len(problems) > limit:
                lines.append(f"  ... {len(problems) - limit} more")
            if self.failures:
                lines.append(f"also {len(self.failures)} compared quantities out of tolerance, "
                             f"first: {self.failures[0].describe()}")
            return "\n".join(lines)
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


_SIDES = ("candidate", "reference")


def compare_traces(actual: Mapping[str, Any], expected: Mapping[str, Any], tol: Tol, *,
                   label: str = "", where: str = "") -> Comparison:
    """Compare losses per step, gradients per step and final parameters of two traces.

    Every quantity must be present and finite on both sides, in equal numbers; anything else
    is a problem of the comparison (see ``Comparison.problems``), never a silent pass.
    """
    cmp = Comparison(tol=tol, label=label)
    at = f" ({where})" if where else ""
    sides = {"candidate": actual, "reference": expected}
    losses = {k: list(v.get("losses") or []) for k, v in sides.items()}
    grads = {k: list(v.get("grads") or []) for k, v in sides.items()}
    params = {k: dict(v.get("params") or {}) for k, v in sides.items()}
    for what, per_side in (("losses", losses), ("gradients", grads), ("parameters", params)):
        for side in _SIDES:
            if not per_side[side]:
                cmp.problems.append(f"the {side} trace has no {what}{at}")
        n_a, n_b = len(per_side["candidate"]), len(per_side["reference"])
        if n_a and n_b and n_a != n_b:
            unit = "tensors" if what == "parameters" else "steps"
            cmp.problems.append(f"{what}: {n_a} {unit} in the candidate, {n_b} in the "
                                f"reference{at}")
    for side in _SIDES:
        for step, value in enumerate(losses[side]):
            if not math.isfinite(float(value)):
                cmp.problems.append(f"step {step}, loss{at}: {float(value)} in the {side}")
        for step, named in enumerate(grads[side]):
            _non_finite_problems(cmp, named, side, "grad", step, at)
        _non_finite_problems(cmp, params[side], side, "param", len(losses["reference"]) - 1, at)
    for step, (a, b) in enumerate(zip(losses["candidate"], losses["reference"])):
        mabs, mrel, ok = tensor_difference(torch.tensor(float(a)), torch.tensor(float(b)), tol)
        cmp.differences.append(Difference("loss", step, "loss", where, mabs, mrel, ok))
    for step, (ga, gb) in enumerate(zip(grads["candidate"], grads["reference"])):
        _named(cmp, ga, gb, "grad", step, where)
    if params["candidate"] and params["reference"]:
        _named(cmp, params["candidate"], params["reference"], "param",
               len(losses["reference"]) - 1, where)
    if tol.update is not None or tol.gain is not None:
        _whole_update(cmp, sides, params, len(losses["reference"]) - 1, where)
    return cmp


def _whole_update(cmp: Comparison, sides: Mapping[str, Mapping[str, Any]],
                  params: Mapping[str, Mapping[str, Any]], step: int, where: str) -> None:
    """The "update" and "gain" quantities (see the module docstring), over the parameters
    both sides have, in the reference's order."""
    at = f" ({where})" if where else ""
    inits = {k: dict(v.get("init") or {}) for k, v in sides.items()}
    for side in _SIDES:
        if not inits[side]:
            cmp.problems.append(f"the {side} trace has no initial parameters{at}: the "
                                f"tolerance bounds the whole update")
            return
        missing = sorted(set(params[side]) - set(inits[side]))
        if missing:
            cmp.problems.append(f"the {side} trace has no initial value of {missing[:5]}{at}")
            return
    names = [n for n in params["reference"] if n in params["candidate"]]
    deltas, per_tensor = {}, {}
    for side in _SIDES:
        parts = []
        for n in names:
            final, init = params[side][n], inits[side][n]
            if final is None:
                return  # a problem of the parameters already
            if init is None or tuple(final.shape) != tuple(init.shape):
                shape = None if init is None else tuple(init.shape)
                cmp.problems.append(f"update of '{n}'{at}: initial {shape}, final "
                                    f"{tuple(final.shape)} in the {side}")
                return
            parts.append((final.detach().to("cpu", torch.float64)
                          - init.detach().to("cpu", torch.float64)).flatten())
        deltas[side] = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)
        per_tensor[side] = parts
    a, b = deltas["candidate"], deltas["reference"]
    if a.shape != b.shape:
        cmp.problems.append(f"update{at}: {a.numel()} elements in the candidate, {b.numel()} in "
                            f"the reference")
        return
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
        return  # the non-finite parameters are problems already
    ref_sq = float((b * b).sum())
    if ref_sq == 0.0:
        cmp.problems.append(f"update{at}: the reference's parameters did not move, so its "
                            f"update says nothing")
        return
    diff = float((a - b).norm())
    rel = diff / math.sqrt(ref_sq)
    gain = float((a * b).sum()) / ref_sq
    tol = cmp.tol
    if tol.update is not None:
        cmp.differences.append(Difference("update", step, WHOLE, where, diff, rel,
                                          rel <= tol.update, b.numel()))
    if tol.gain is not None:
        dev = abs(gain - 1.0)
        cmp.differences.append(Difference("gain", step, WHOLE, where, dev, dev,
                                          dev <= tol.gain, b.numel(), value=gain))
    if tol.tensor_gain is not None:
        for n, ta, tb in zip(names, per_tensor["candidate"], per_tensor["reference"]):
            sq = float((tb * tb).sum())
            if sq == 0.0:
                continue  # a tensor the reference did not move: the whole update judges it
            g = float((ta * tb).sum()) / sq
            dev = abs(g - 1.0)
            cmp.differences.append(Difference("tensor_gain", step, n, where, dev, dev,
                                              dev <= tol.tensor_gain, tb.numel(), value=g))


def compare_update(before: Mapping[str, torch.Tensor], after: Mapping[str, torch.Tensor],
                   ref_before: Mapping[str, torch.Tensor], ref_after: Mapping[str, torch.Tensor],
                   tol: Tol, *, step: int, label: str = "", where: str = "") -> Comparison:
    """The whole-update quantities alone (``Tol.update``, ``Tol.gain``; element-wise bounds are
    not applied): the candidate's ``after - before`` against the reference's ``ref_after -
    ref_before``, as one vector over the reference's parameters. One step's update, or a whole
    run's. Missing, mis-shaped or non-finite tensors, a tolerance with neither bound, and a
    reference that did not move are problems of the comparison."""
    cmp = Comparison(tol=tol, label=label)
    at = f" ({where})" if where else ""
    if tol.update is None and tol.gain is None:
        cmp.problems.append(f"tolerance {tol} bounds no update{at}")
        return cmp
    sides = {"candidate": {"init": before}, "reference": {"init": ref_before}}
    params = {"candidate": dict(after), "reference": dict(ref_after)}
    for side in _SIDES:
        if not params[side]:
            cmp.problems.append(f"the {side} has no parameters{at}")
    if params["candidate"] and params["reference"]:
        only_a = sorted(set(params["candidate"]) - set(params["reference"]))
        only_b = sorted(set(params["reference"]) - set(params["candidate"]))
        if only_a or only_b:
            cmp.problems.append(f"step {step}, parameter names differ{at}: only in the candidate "
                                f"{only_a}, only in the reference {only_b}")
        for side in _SIDES:
            _non_finite_problems(cmp, params[side], side, "param", step, at)
            _non_finite_problems(cmp, sides[side]["init"], side, "param", step, at)
        if not cmp.problems:
            _whole_update(cmp, sides, params, step, where)
    return cmp


def _named(cmp: Comparison, actual: Mapping[str, torch.Tensor],
           expected: Mapping[str, torch.Tensor], quantity: str, step: int,
           where: str) -> None:
    at = f" ({where})" if where else ""
    only_a, only_b = sorted(set(actual) - set(expected)), sorted(set(expected) - set(actual))
    if only_a or only_b:
        cmp.problems.append(f"step {step}, {quantity} names differ{at}: only in the candidate "
                            f"{only_a}, only in the reference {only_b}")
    for name in expected:
        if name not in actual:
            continue
        if actual[name] is None or expected[name] is None:
            side = "candidate" if actual[name] is None else "reference"
            cmp.problems.append(f"step {step}, {quantity} of '{name}'{at}: None in the {side}")
            continue
        mabs, mrel, ok = tensor_difference(actual[name], expected[name], cmp.tol)
        cmp.differences.append(Difference(quantity, step, name, where, mabs, mrel, ok,
                                          expected[name].numel()))


def _non_finite_problems(cmp: Comparison, named: Mapping[str, Any], side: str, quantity: str,
                         step: int, at: str) -> None:
    for name, t in (named or {}).items():
        bad = non_finite(t) if isinstance(t, torch.Tensor) else None
        if bad:
            cmp.problems.append(f"step {step}, {quantity} of '{name}'{at}: {bad} in the {side}")


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
        # What the candidate's engine built, where its trace says (dsconform/checks/zero_vs_ddp.py
        # layout_problems): matching DDP proves nothing if ZeRO was not what ran.
        cmp.problems += [f"{where or 'rank 0'}: {text}"
                         for text in result[candidate].get("layout_problems", ())]
    return cmp


def compare_states(actual: Mapping[str, Any], expected: Mapping[str, Any], tol: Tol, *,
                   label: str = "", where: str = "", step: int = 0) -> Comparison:
    """Compare two flat named states (a checkpoint's content before the save and after the load):
    every name on both sides; tensors of equal shape and dtype within ``tol``; numbers within
    ``tol``; anything else (strings, bools, None) equal.

    Like ``compare_traces``, a comparison that could compare nothing is a failure: an empty side,
    a name on one side only, a shape or dtype change (bf16 saved, fp32 loaded is not the same
    checkpoint) or a NaN/inf are ``problems``. Used by the checkpoint suite with an exact
    tolerance: a checkpoint stores bytes, anything else is a lost or altered value.
    """
    cmp = Comparison(tol=tol, label=label)
    at = f" ({where})" if where else ""
    for side, named in (("candidate", actual), ("reference", expected)):
        if not named:
            cmp.problems.append(f"the {side} state is empty{at}")
    only_a, only_b = sorted(set(actual) - set(expected)), sorted(set(expected) - set(actual))
    if only_a or only_b:
        cmp.problems.append(f"state names differ{at}: only in the candidate {only_a[:5]}, only "
                            f"in the reference {only_b[:5]}"
                            + (f" ({len(only_a)} and {len(only_b)} names)"
                               if len(only_a) > 5 or len(only_b) > 5 else ""))
    for name, want in expected.items():
        if name not in actual:
            continue
        got = actual[name]
        if isinstance(want, torch.Tensor) or isinstance(got, torch.Tensor):
            if not (isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor)):
                cmp.problems.append(f"state '{name}'{at}: {type(got).__name__} in the "
                                    f"candidate, {type(want).__name__} in the reference")
                continue
            if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
                cmp.problems.append(f"state '{name}'{at}: {got.dtype} {tuple(got.shape)} in the "
                                    f"candidate, {want.dtype} {tuple(want.shape)} in the "
                                    f"reference")
                continue
            bad = [f"{non_finite(t)} in the {side}" for side, t in
                   (("candidate", got), ("reference", want)) if non_finite(t)]
            if bad:
                cmp.problems.append(f"state '{name}'{at}: {'; '.join(bad)}")
                continue
            mabs, mrel, ok = tensor_difference(got, want, tol)
            cmp.differences.append(Difference("state", step, name, where, mabs, mrel, ok,
                                              want.numel()))
        elif is_number(got) and is_number(want):
            if not (math.isfinite(float(got)) and math.isfinite(float(want))):
                if float(got) != float(want):
                    cmp.problems.append(f"state '{name}'{at}: {got!r} in the candidate, "
                                        f"{want!r} in the reference")
                continue
            mabs, mrel, ok = tensor_difference(torch.tensor(float(got), dtype=torch.float64),
                                               torch.tensor(float(want), dtype=torch.float64),
                                               tol)
            cmp.differences.append(Difference("state", step, name, where, mabs, mrel, ok))
        elif got != want:
            cmp.problems.append(f"state '{name}'{at}: {got!r} in the candidate, {want!r} in the "
                                f"reference")
    return cmp
