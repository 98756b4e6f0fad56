"""The order a run takes its tests in, and when it needs which op: the batch's phases
(dsconform.plugin.batch) with the profile's promises first, the tests that wait for an op build
after the others beside the batch, the measurements a known issue covers last; the ops a run
builds (ops_to_build) and when it needs each (build_needs, for dsconform.ops.prebuild's build
order)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsconform.gate import requires as gating
from dsconform.plugin.keys import COVERED_BY
from dsconform.plugin.runstate import RunState

PROMISE_MODULE = "test_profile.py"

#: What the build order assumes a test the main thread runs takes, in seconds (a GPU node's
#: typical acceptance test; a batched cell states its own cost).
MAIN_ITEM_S = 1.0


def order_key(item: pytest.Item, phase: int, waits: bool = False,
              finish: float = 0.0) -> tuple[int, int, int, int, float]:
    """Where an item runs: `run_first`, the profile's promises, the batch's phase (0 without a
    batch), `run_last`. Among the tests beside the batch (phase 0), those that wait for an op
    this run builds (``waits``) come after the others, which run meanwhile. The batched tests
    (phase 1) come in the order their cells are expected to end (``finish``, from
    expected_finish): each takes its outcome as soon as the batch has it, and the batch's end
    leaves only the last cells' outcomes to check. Among the measurements (phase 2) the cells
    of a known issue come last: their failure stops their ranks, and while a measurement runs
    no standby ranks start, so the measurement after one would wait for new ranks (about 3 s
    on a GPU node)."""
    if Path(str(item.fspath)).name == PROMISE_MODULE and \
            Path(str(item.fspath)).parent.name == "suites":
        return (run_order(item), 0, 0, 0, 0.0)
    later = waits if phase == 0 else phase == 2 and COVERED_BY in item.stash
    return (run_order(item), 1, phase, int(later), finish if phase == 1 else 0.0)


def expected_finish(cells: list[pytest.Item], lanes: int, waits: set[int]) -> dict[int, float]:
    """When each batched cell is expected to end, by id(item), in the seconds of its @batched
    cost: the batch's own order (dsconform.plugin.batch.start: the cells that wait for an op
    build last, the costliest first), each cell taken by the lane that frees first."""
    from dsconform.plugin import batch

    free = [0.0] * max(1, lanes)
    ends: dict[int, float] = {}
    for it in sorted(cells, key=lambda c: (id(c) in waits, -batch.cost(c))):
        lane = min(range(len(free)), key=free.__getitem__)
        free[lane] += batch.cost(it)
        ends[id(it)] = free[lane]
    return ends


def item_run_ops(item: pytest.Item, state: RunState) -> list[str]:
    """The ops a test loads: its ``requires(op=...)``, and for the ops suite the profile's."""
    return gating.item_ops(item) + (list(state.profile.ops) if selects_ops_suite([item]) else [])


def waits_for_a_build(items: list, state: RunState) -> set[int]:
    """The ids of the GPU tests that load an op the extensions cache does not hold (this run
    builds it, ops_to_build), all the tests of a module sharing a module-scoped fixture when
    one of them does (they stay together). Empty off GPU nodes, where no build runs ahead."""
    if not state.node.gpu_count:
        return set()
    try:
        from dsconform.ops.cache import ensure_extensions_dir
        from dsconform.ops.prebuild import is_cached
        ext_dir = ensure_extensions_dir()
    except ImportError:
        return set()
    from dsconform.plugin import batch

    cached: dict[str, bool] = {}

    def waits(it: pytest.Item) -> bool:
        ops = item_run_ops(it, state)
        for op in ops:
            if op not in cached:
                cached[op] = is_cached(op, ext_dir)
        return it.get_closest_marker("gpu") is not None and not all(cached[op] for op in ops)

    found = {id(it) for it in items if waits(it)}
    shared = {str(it.fspath) for it in items
              if id(it) in found and batch._shares_module_fixture(it)}
    return found | {id(it) for it in items if str(it.fspath) in shared}


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
    (``requires(op=...)``; FastPersist's ``utils``, built inside a measuring test otherwise:
    16 s of a cold 2xH200 run)."""
    ops: list[str] = []
    if selects_ops_suite(items):
        ops += list(state.profile.ops)
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
    verdict = gating.item_verdict(item, state)
    return verdict is None or all(u.condition == "op" for u in verdict.unmet)


def build_needs(items: list, state: RunState, cells: list) -> list[tuple[float, list[str], float]]:
    """When the run needs each op, for build_order: (seconds from its start, the ops, the work
    waiting). The background batch runs its cells that need no op first, spread over its
    lanes, then those that do; the main thread runs the other tests in their order, about
    MAIN_ITEM_S each, those that measure after the batch (dsconform.plugin.batch)."""
    from dsconform.harness.lanes import lanes_for
    from dsconform.plugin import batch

    needs: list[tuple[float, list[str], float]] = []
    lanes = lanes_for("cuda" if state.node.gpu_count else "cpu") if cells else 1
    costs = {id(c): batch.cost(c) for c in cells}
    ops_free = sum(costs[id(c)] for c in cells if not gating.item_ops(c)) / lanes
    batch_end = sum(costs.values()) / lanes
    for c in cells:
        if gating.item_ops(c):
            needs.append((ops_free, gating.item_ops(c), costs[id(c)]))
    t = 0.0
    for it in items:
        if id(it) in costs:
            continue  # its test only reads the batch's outcome
        if cells and batch.measures(it):
            t = max(t, batch_end)
        ops = item_run_ops(it, state)
        if ops:
            needs.append((t, ops, MAIN_ITEM_S))
        t += MAIN_ITEM_S
    return needs
