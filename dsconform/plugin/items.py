"""What the selected tests ask of the run: the order they run in (the profile's promises first,
then the cell batch's phases, dsconform.plugin.batch) and the ops it builds for them."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsconform.gate import requires as gating
from dsconform.plugin.keys import COVERED_BY
from dsconform.plugin.runstate import RunState

PROMISE_MODULE = "test_profile.py"


def is_xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def order_key(item: pytest.Item, phase: int) -> tuple[int, int, int, bool]:
    """Where an item runs: `run_first`, the profile's promises, the batch's phase (0 without a
    batch), `run_last`. Among the measurements (phase 3) those a known issue covers come last:
    their failure stops their ranks, and the measurement after one would wait for new ranks."""
    path = Path(str(item.fspath))
    if path.name == PROMISE_MODULE and path.parent.name == "suites":
        return (run_order(item), 0, 0, False)
    return (run_order(item), 1, phase, phase == 3 and COVERED_BY in item.stash)


def run_order(item: pytest.Item) -> int:
    """-1: `run_first` (before the profile's promises), 1: `soak` (the burn-in, after every
    test it could disturb), 2: `run_last`, 0: the rest."""
    if item.get_closest_marker("run_first"):
        return -1
    if item.get_closest_marker("run_last"):
        return 2
    return 1 if item.get_closest_marker("soak") else 0


def selects_ops_suite(items: list) -> bool:
    return any(Path(str(it.fspath)).name == "test_ops.py" for it in items)


def ops_to_build(items: list, state: RunState) -> list[str]:
    """The ops to build in parallel when the run starts: the profile's promised ops when an ops
    test is selected; on a GPU node also every op a selected GPU test loads in its ranks
    (``requires(op=...)``; FastPersist's ``utils`` would otherwise be built inside a measuring
    test)."""
    ops: list[str] = list(state.profile.ops) if selects_ops_suite(items) else []
    if state.node.gpu_count:
        for it in items:
            if it.get_closest_marker("gpu") and _may_load_ops(it, state):
                ops += [op for op in gating.item_ops(it) if op not in ops]
    return ops


def _may_load_ops(item: pytest.Item, state: RunState) -> bool:
    """Whether a test can get as far as loading its ops: not skipped by a static mark (NVME-GDS-2
    on a profile without NVMe paths), and no need of it unmet but its ops (an op that does
    not build is the test's to report)."""
    if item.get_closest_marker("skip") is not None:
        return False
    verdict = state.verdict(item)
    return verdict is None or all(u.condition == "op" for u in verdict.unmet)
