"""One gate for every test: ``requires(...)``.

A test states what it needs; the plugin compares that with the node. An unmet need that the
profile does not promise is a SKIP whose reason lists only the unmet conditions with the values
found (``Requires: [GPUs>=2 (found 1)]``). An unmet need that the profile PROMISES is a FAILURE
(``profile h200-x2 promises GPUs>=2: expected 2 GPUs, found 0``): a node that breaks a promise must
never look green.

The evaluation is a pure function of (conditions, node facts, profile, op-compatibility lookup),
so it is tested without GPUs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import pytest

from dsconform.base import removed, versions
from dsconform.node.detect import NodeFacts
from dsconform.profile.schema import Profile

MARK = "requires"
CONDITIONS = ("min_gpus", "bf16", "fp16", "op", "nvme", "nccl", "deepspeed", "multinode",
              "onebit", "two_ranks")
# Markers that imply a condition, so `@pytest.mark.gpu` alone already gates correctly.
IMPLIED = {"gpu": {"min_gpus": 1}, "multigpu": {"min_gpus": 2}, "nvme": {"nvme": True},
           "multinode": {"multinode": True}}


def requires(**conditions: Any) -> pytest.MarkDecorator:
    """Gate a test (decorator) or one parameter (``pytest.param(..., marks=requires(...))``).

    min_gpus=int, bf16=True, fp16=True, op="name" or ["a", "b"], nvme=True, nccl="2.21",
    deepspeed=">=0.19,<0.19.7", multinode=True, onebit="OneBitAdam" or [...] (a 1-bit optimizer
    DeepSpeed removed in 0.19.7: dsconform/base/removed.py), two_ranks="why" (what makes the
    check need two ranks by nature: its skip for too few GPUs says so).
    """
    unknown = set(conditions) - set(CONDITIONS)
    if unknown:
        raise TypeError(f"requires(): unknown condition(s) {sorted(unknown)}; "
                        f"known: {', '.join(CONDITIONS)}")
    return getattr(pytest.mark, MARK)(**conditions)


# The accelerators a device-agnostic test runs on, in the order their parameters are listed.
ACCELERATORS = ("cpu", "cuda")


# A CUDA cell's part on a node with exactly one GPU (dsconform.plugin.hooks selects by them).
ONE_GPU_MARKS = {"tier": "one_gpu_tier", "covered": "covered_on_one_gpu"}


def accel_cell(accelerator: str, *values: Any, id: str | None = None,
               world_size: int | str = 1, marks: Iterable[Any] = (),
               slow: bool = False, one_gpu: str | None = None) -> Any:
    """One accelerator x cell parameter: ``pytest.param(accelerator, *values)`` with the id
    ``<accelerator>-<id>`` (``<accelerator>`` without one). Its marks, in this order: the
    accelerator's (CUDA: ``gpu``, ``multigpu`` above one rank, ``requires(min_gpus=...)``; the
    CPU accelerator: none), then ``marks``, then the ``one_gpu`` mark, then ``slow`` where
    ``slow`` is true (a cell outside this accelerator's tier: nightly).

    world_size: the ranks the cell runs on; "all" (every GPU of the node) needs one GPU to run.
    one_gpu: on a node with exactly one GPU, "tier" (one rank only) puts the cell in the
    acceptance tier even where it is ``slow`` (``one_gpu_tier``: the one-rank tier that covers
    the matrix's other axes pairwise); "covered" (more than one rank) leaves an acceptance cell
    out there, not skipped, because one-rank cells cover its check (``covered_on_one_gpu``).
    CUDA cells only: the CPU accelerator's cells take no such mark; nodes of 2+ GPUs ignore it.
    """
    if accelerator not in ACCELERATORS:
        raise ValueError(f"accel_cell(): unknown accelerator {accelerator!r}; "
                         f"known: {', '.join(ACCELERATORS)}")
    every = [*_accelerator_marks(accelerator, world_size), *marks]
    if one_gpu is not None:
        every += _one_gpu_marks(accelerator, one_gpu, world_size, id)
    if slow:
        every.append(pytest.mark.slow)
    return pytest.param(accelerator, *values, marks=every,
                        id=accelerator if id is None else f"{accelerator}-{id}")


def _one_gpu_marks(accelerator: str, role: str, world_size: int | str,
                   id: str | None) -> list[pytest.MarkDecorator]:
    if role not in ONE_GPU_MARKS:
        raise ValueError(f"accel_cell(one_gpu={role!r}) for cell {id!r}; known: "
                         f"{', '.join(ONE_GPU_MARKS)}")
    if (role == "tier") != (world_size == 1):
        raise ValueError(f"accel_cell(one_gpu={role!r}) for cell {id!r} of world size "
                         f"{world_size!r}: 'tier' is for one-rank cells, 'covered' for cells of "
                         f"more ranks")
    return [getattr(pytest.mark, ONE_GPU_MARKS[role])] if accelerator == "cuda" else []


def _accelerator_marks(accelerator: str, world_size: int | str) -> list[pytest.MarkDecorator]:
    if accelerator == "cpu":
        return []
    marks = [pytest.mark.gpu]
    if world_size == "all" or (isinstance(world_size, int) and world_size > 1):
        marks.append(pytest.mark.multigpu)
    need = 1 if world_size == "all" else int(world_size)
    marks.append(requires(min_gpus=need))
    return marks


def accel_params(world_size: int | str = 1) -> list:
    """The two accelerators a device-agnostic test runs on: the CPU accelerator (gloo), and
    CUDA (nccl), which is marked ``gpu`` (and ``multigpu`` for more than one rank)."""
    return [accel_cell(accel, world_size=world_size) for accel in ACCELERATORS]


@dataclass(frozen=True)
class Unmet:
    condition: str
    needed: str  # "GPUs>=2"
    found: str  # "1"
    promised: bool
    promise: str = ""  # what the profile promised, e.g. "expected 2 GPUs"

    @property
    def skip_text(self) -> str:
        return f"{self.needed} (found {self.found})"

    @property
    def fail_text(self) -> str:
        return f"{self.promise or self.needed}, found {self.found}"


@dataclass(frozen=True)
class Verdict:
    unmet: tuple[Unmet, ...]
    profile_name: str

    @property
    def ok(self) -> bool:
        return not self.unmet

    @property
    def broken_promises(self) -> list[Unmet]:
        return [u for u in self.unmet if u.promised]

    @property
    def skip_reason(self) -> str:
        return "Requires: [" + " + ".join(u.skip_text for u in self.unmet) + "]"

    @property
    def fail_reason(self) -> str:
        broken = self.broken_promises
        return (f"profile {self.profile_name} promises [{' + '.join(u.needed for u in broken)}]: "
                + "; ".join(u.fail_text for u in broken))


def merge_conditions(marks: Iterable[Any], marker_names: Iterable[str]) -> dict[str, Any]:
    """Conditions of all ``requires`` marks on an item plus those implied by its markers.
    The strictest value wins (largest GPU count, union of ops)."""
    merged: dict[str, Any] = {}
    sources = [IMPLIED[n] for n in marker_names if n in IMPLIED]
    sources += [m.kwargs for m in marks]
    for cond in sources:
        for key, value in cond.items():
            if key == "min_gpus":
                merged[key] = max(merged.get(key, 0), value)
            elif key in ("op", "onebit"):
                ops = merged.setdefault(key, [])
                ops += [o for o in ([value] if isinstance(value, str) else value) if o not in ops]
            elif key == "deepspeed" and key in merged:
                merged[key] = f"{merged[key]},{value}"
            else:
                merged[key] = value
    return merged


def evaluate(conditions: Mapping[str, Any], node: NodeFacts, profile: Profile, *,
             op_compatible: Callable[[str], bool | None] = lambda op: None,
             multinode: bool = False, whole_node: NodeFacts | None = None) -> Verdict:
    """Compare a test's needs with the node; mark each unmet one promised or not.

    node is what this process may use (an xdist worker's slice of the GPUs); whole_node, when
    given, the node itself: a GPU count the node has but the worker's slice lacks is a skip
    (how the run was split), not a broken promise."""
    unmet: list[Unmet] = []
    p = profile
    n = conditions.get("min_gpus")
    if n and node.gpu_count < n:
        sliced = whole_node is not None and whole_node.gpu_count >= n
        promised = p.gpus_promised >= n and not sliced
        # On a node whose torch cannot use GPUs the hardware has, say so: "found 0" alone reads
        # like a CPU machine.
        found = (f"{node.gpu_count} usable: {node.unusable_gpus()}" if node.unusable_gpus()
                 else str(node.gpu_count))
        if sliced:
            found = (f"{node.gpu_count}: this xdist worker's share of the node's "
                     f"{whole_node.gpu_count}; run fewer workers (-n) or set "
                     "DSCONFORM_GPUS_PER_WORKER")
        if conditions.get("two_ranks") and n >= 2:
            found += f"; needs two ranks by nature: {conditions['two_ranks']}"
        unmet.append(Unmet("min_gpus", f"GPUs>={n}", found, promised,
                           f"expected {p.gpus_promised} GPUs" if promised else ""))
    for dtype in ("bf16", "fp16"):
        if conditions.get(dtype) and not getattr(node, dtype):
            found = (f"{node.gpu_model} cc {node.gpus[0].compute_capability}" if node.gpus
                     else "CPU without oneDNN support")
            promised = getattr(p, dtype) is True
            unmet.append(Unmet(dtype, dtype, found, promised, f"expected {dtype} support"))
    ops = conditions.get("op") or []
    for op in [ops] if isinstance(ops, str) else ops:
        ok = op_compatible(op)
        if not ok:
            found = "not compatible" if ok is False else "unknown"
            unmet.append(Unmet("op", f"op {op}", found, op in p.ops,
                               f"expected op {op} to load"))
    if conditions.get("nvme"):
        if not p.nvme_paths:
            unmet.append(Unmet("nvme", "NVMe path in profile", "none", False))
    want = conditions.get("nccl")
    if want:
        if not versions.at_least(node.nccl_version, want):
            promised = versions.at_least(p.nccl_min_version, want)
            unmet.append(Unmet("nccl", f"NCCL>={want}", node.nccl_version or "none", promised,
                               f"expected NCCL>={p.nccl_min_version}"))
    spec = conditions.get("deepspeed")
    if spec:
        try:
            specset = versions.specifier(spec)
        except ValueError as e:
            raise ValueError(f"requires(deepspeed=...): {e}") from None
        installed = versions.parse(node.deepspeed_version)
        if installed is None or installed not in specset:
            # A profile's deepspeed.min_version promises only lower bounds it implies.
            floor = versions.parse(p.deepspeed_min_version)
            promised = floor is not None and all(
                s.operator in (">=", ">") and floor >= versions.Version(s.version)
                for s in specset)
            unmet.append(Unmet("deepspeed", f"DeepSpeed{spec}", node.deepspeed_version or "none",
                               promised, f"expected DeepSpeed>={p.deepspeed_min_version}"))
    features = conditions.get("onebit") or []
    for feature in [features] if isinstance(features, str) else features:
        gone = removed.removal(feature, node.deepspeed_version)
        if gone is not None:
            unmet.append(Unmet("onebit", gone.text,
                               f"DeepSpeed {node.deepspeed_version or 'none'}",
                               feature in p.onebit,
                               f"expected {feature} to train (deepspeed.onebit)"))
    if conditions.get("multinode") and not multinode:
        unmet.append(Unmet("multinode", "multi-node rendezvous", "single node", False))
    return Verdict(tuple(unmet), p.name)


def item_ops(item: pytest.Item) -> list[str]:
    """The DeepSpeed ops a collected test says it loads (``requires(op=...)``)."""
    marks = list(item.iter_markers(MARK))
    ops = merge_conditions(marks, {m.name for m in item.iter_markers()}).get("op") or []
    return [ops] if isinstance(ops, str) else list(ops)


def op_compatible(op: str) -> bool | None:
    """ds_report's probe for one op on this node's accelerator (False: not provided there;
    None: DeepSpeed could not answer). Gates use the probe only; the ops suite proves that
    promised ops really load. The caller keeps the answer (the plugin caches it per run)."""
    try:
        from deepspeed.ops.op_builder.all_ops import ALL_OPS
        builder = ALL_OPS.get(op)
        return bool(builder and builder.is_compatible(verbose=False))
    except Exception:  # DeepSpeed broken: report "unknown" rather than crash every gate
        return None


def item_verdict(item: pytest.Item, *, node: NodeFacts, profile: Profile,
                 op_compatible: Callable[[str], bool | None], multinode: bool,
                 whole_node: NodeFacts) -> Verdict | None:
    """The gate's verdict for one collected test, or None when it states no condition.
    ``node`` is what this worker may use, ``whole_node`` what the profile's promises are
    checked against. The plugin applies it at setup; cell batches (dsconform.plugin.batch) use
    it to leave out cells that will skip or fail a promise."""
    marks = list(item.iter_markers(MARK))
    names = {m.name for m in item.iter_markers()}
    conditions = merge_conditions(marks, names)
    if not conditions:
        return None
    return evaluate(conditions, node, profile, op_compatible=op_compatible,
                    multinode=multinode, whole_node=whole_node)
