"""Red tests of suites/test_multinode.py, run across nodes: each check MUST go red when the real
thing is broken.

Not collected by ``pytest tests`` (the name does not start with test_): it needs a multi-node
rendezvous, and tests/harness/test_multinode_sim.py runs it inside the two simulated nodes (two
torchrun agents on localhost), in the same job as the suite. Nothing is mocked: DeepSpeed and DDP
train across the two ranks, and the collectives move real data.

- ZeRO: from step 2 on, DeepSpeed's loss is multiplied by 1.001 inside ``engine.backward`` on
  every rank (dsconform/checks/zero_vs_ddp.py ``_perturb_backward``); the comparison MUST fail
  at step 2.
- exactness: rank 1's all_reduce through deepspeed.comm returns element 7 of its 53-element
  result off by one (the collectives suite's fault injection, a wrapper around the real call);
  the check MUST name rank 1, the size and the element.
- busbw: the real measurement across the nodes, held to a floor no network reaches; the
  recorder MUST report the floor, the value and the job's size.
"""

from __future__ import annotations

import pytest

from dsconform.suite import MetricsRecorder, ZeroCase, collectives
from suites import test_multinode as suite

CAPABILITY = "multinode-red"
pytestmark = pytest.mark.multinode

PERTURB_FROM_STEP = 2


def test_zero_check_fails_on_a_perturbed_update(node, profile):
    """ZeRO across nodes with DeepSpeed's loss scaled by 1.001 MUST fail at that step."""
    case = ZeroCase(stage=2, dtype="fp32", optimizer="sgd", grad_accum=1, world_size=suite.JOB,
                    steps=4)
    cmp, ran = suite.zero_across_nodes(case, profile, node.accelerator, perturb=1.001,
                                       perturb_from_step=PERTURB_FROM_STEP)
    assert isinstance(ran.world_size, int) and ran.world_size >= 2
    assert not cmp.ok, "a 1e-3 change of DeepSpeed's update went unnoticed across nodes"
    first = cmp.first_divergence
    assert (first.step, first.quantity) == (PERTURB_FROM_STEP, "grad"), first
    with pytest.raises(AssertionError, match=f"first diverging step {PERTURB_FROM_STEP}"):
        cmp.assert_ok()


def test_exactness_check_names_the_corrupting_rank(node):
    """An all_reduce whose result is off by one on rank 1 MUST be reported, naming rank 1."""
    found = suite.mismatches("all_reduce", node.accelerator,
                             perturb={"rank": 1, "numel": 53, "index": 7})
    message = collectives.exactness_message(found)
    assert [(m.rank, m.numel, m.index) for m in found] == [(1, 53, 7)], message
    assert "all_reduce fp32 numel=53" in message and "rank 1" in message, message


def test_busbw_floor_no_network_reaches_fails(node):
    """The real busbw across nodes held to 1e9 GB/s MUST be a recorded violation."""
    transfer = suite.Transfer("all_reduce", 1 << 20, floor_gbps=1e9, source="impossible")
    recorded = []
    metrics = MetricsRecorder("red::busbw", "multinode", recorded.append)
    suite.record_busbw(metrics, transfer, suite.measure(transfer, node.accelerator))
    (violation,) = metrics.violations()
    assert "all_reduce.busbw" in violation and "is below its floor 1e+09 GB/s" in violation
    assert "nodes=2" in violation and "bytes=1048576" in violation, violation
    assert recorded[0].rate.limit == 1e9
