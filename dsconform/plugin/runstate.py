"""The state of one suite run: the plugin sets it up and owns it; suites only read it, a
``pytest_generate_tests`` through ``run_state(config)`` (fixtures cover everything else)."""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from dsconform.gate import requires
from dsconform.node.detect import NodeFacts
from dsconform.profile.schema import Profile
from dsconform.profile.select import RunKind, Selection
from dsconform.results import records

if TYPE_CHECKING:  # imported where they start, to keep the plugin's import light
    from dsconform.node.neighbours import NeighbourWatch
    from dsconform.ops.checks import OpChecks
    from dsconform.ops.prebuild import ParallelBuilds

STATE = pytest.StashKey["RunState"]()


@dataclass
class RunState:
    selection: Selection
    scratch: Path
    scratch_is_temp: bool
    results: Path | None
    started: str
    outcomes: list[records.Outcome] = field(default_factory=list)
    metrics: list[records.Metric] = field(default_factory=list)
    op_cache: dict[str, bool | None] = field(default_factory=dict)
    multinode: bool = False
    notices: list[str] = field(default_factory=list)  # printed in the header and the summary
    known_issue_cases: dict[str, str] = field(default_factory=dict)  # nodeid -> issue id
    facts: list[records.Fact] = field(default_factory=list)  # `facts` fixture, for compare
    # The promised ops' builds, started in parallel after collection (dsconform.ops.prebuild).
    op_builds: ParallelBuilds | None = None
    # With a background cell batch: the ops suite's checks and its ds_report's text, started
    # after collection too.
    op_checks: OpChecks | None = None
    ds_report: Future[str] | None = None
    # On a GPU node: the watch of other processes computing on the GPUs while the run runs,
    # from configure to the end.
    neighbours: NeighbourWatch | None = None
    # A GPU or a CPU run, said in the header and the summary; a GPU tier where no GPU is found
    # fails (profile.select.run_kind). None: not decided (a state built outside configure).
    kind: RunKind | None = None
    # --soak MINUTES (None: no burn-in), and a line to the console from any thread (the soak's
    # progress once a minute: dsconform.plugin.console.Console.say).
    soak_minutes: float | None = None
    say: Callable[[str], None] | None = None

    @property
    def node(self) -> NodeFacts:
        return self.selection.node

    @property
    def profile(self) -> Profile:
        return self.selection.profile

    @functools.cached_property
    def gate_node(self) -> NodeFacts:
        """The node as one xdist worker sees it: only its slice of the GPUs. Promises are
        checked against the whole node; gates against what this worker can use."""
        node = self.selection.node
        if not node.gpus or "PYTEST_XDIST_WORKER" not in os.environ:
            return node
        from dsconform.harness.xdist import InsufficientGPUs, worker_gpus
        try:
            n = len(worker_gpus())
        except InsufficientGPUs as e:
            n = e.available
        return dataclasses.replace(node, gpus=node.gpus[:n])

    def op_compatible(self, op: str) -> bool | None:
        """ds_report's probe for ``op`` (dsconform.gate.requires.op_compatible), asked once per
        run and kept in ``op_cache``."""
        if op not in self.op_cache:
            self.op_cache[op] = requires.op_compatible(op)
        return self.op_cache[op]

    def verdict(self, item: pytest.Item) -> requires.Verdict | None:
        """The gate's verdict for one collected test in this run (None: it states no
        condition): this worker's GPUs for the gates, the whole node for the promises."""
        return requires.item_verdict(item, node=self.gate_node, profile=self.profile,
                                     op_compatible=self.op_compatible,
                                     multinode=self.multinode, whole_node=self.node)


def run_state(config: pytest.Config) -> RunState:
    """This run's state; a clear error when the suite runs without the dsconform plugin."""
    if (state := config.stash.get(STATE, None)) is None:
        raise RuntimeError("the dsconform plugin is not active: run the suite from its checkout "
                           "(its conftest.py loads fixtures/plugin.py)")
    return state
