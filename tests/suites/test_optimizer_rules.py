"""The written-out references of suites/optimizer_rules.py that need no DeepSpeed: ZeRO's flat
partitions of a parameter group, and LAMB with one trust ratio per partition, which
test_optimizers.judge names where a LAMB cell on ZeRO departs from LAMB."""

from __future__ import annotations

import re

import pytest
import torch

from dsconform.checks.tolerances import tolerance
from dsconform.gate.known_issues import KNOWN_ISSUES
from suites.optimizer_rules import Reference, zero_partitions
from suites.test_optimizers import _diagnose_flat_lamb

DS_490 = next(i for i in KNOWN_ISSUES if i.id == "DS-490-ZERO-LAMB-FLAT-TRUST-RATIO")
HYPER = {"betas": (0.9, 0.99), "eps": 1e-8, "max_coeff": 10.0, "min_coeff": 0.01}


def test_stage_1_2_partitions_split_the_padded_flat_group_evenly():
    assert zero_partitions([3, 5], 1, 1) == [[(0, 0, 3), (1, 0, 5)]]
    # 8 elements, padded to a multiple of 2 x 2: 4 a rank, the second tensor split
    assert zero_partitions([3, 5], 2, 2) == [[(0, 0, 3), (1, 0, 1)], [(1, 1, 5)]]
    # 9 elements padded to 12: the last rank holds the tail and the zeros
    assert zero_partitions([4, 5], 1, 2) == [[(0, 0, 4), (1, 0, 2)], [(1, 2, 5)]]


def test_stage_3_partitions_split_every_tensor():
    assert zero_partitions([3, 5], 3, 1) == [[(0, 0, 3), (1, 0, 5)]]
    assert zero_partitions([3, 5], 3, 2) == [[(0, 0, 2), (1, 0, 3)], [(0, 2, 3), (1, 3, 5)]]


def _run(groups, flat):
    torch.manual_seed(0)
    initial = {"a": torch.randn(6), "b": torch.randn(4, 3), "c": torch.randn(5)}
    ref = Reference("lamb", groups, initial, HYPER, flat_partitions=flat)
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        ref.step({n: torch.randn(t.shape, generator=g) for n, t in initial.items()})
    return ref.parameters()


ONE_EACH = [{"names": ["a"], "lr": 1e-2, "weight_decay": 0.1},
            {"names": ["b"], "lr": 5e-3, "weight_decay": 0.0},
            {"names": ["c"], "lr": 2e-2, "weight_decay": 0.01}]
SHARED = [{"names": ["a", "c"], "lr": 1e-2, "weight_decay": 0.01},
          {"names": ["b"], "lr": 5e-3, "weight_decay": 0.0}]


def test_one_tensor_a_partition_is_lamb_itself():
    per_tensor, flat = _run(ONE_EACH, None), _run(ONE_EACH, (2, 1))
    assert all(torch.equal(per_tensor[n], flat[n]) for n in per_tensor)


def test_a_group_of_several_tensors_moves_otherwise():
    per_tensor, flat = _run(SHARED, None), _run(SHARED, (2, 1))
    assert torch.equal(per_tensor["b"], flat["b"])  # alone in its group
    assert float((per_tensor["a"] - flat["a"]).abs().max()) > 1e-4
    assert float((per_tensor["c"] - flat["c"]).abs().max()) > 1e-4
    # two ranks' partitions give each its own ratio: another trajectory again
    assert float((_run(SHARED, (2, 2))["a"] - flat["a"]).abs().max()) > 1e-6


def test_the_diagnosis_names_flat_partition_lamb_only_where_it_fits():
    tol = tolerance("optimizer", "fp32", "lamb", accelerator="cuda")
    flat, per_tensor = _run(SHARED, (1, 1)), _run(SHARED, None)
    hit = _diagnose_flat_lamb([{"rank": 0, "params": [flat],
                                "flat_partition_params": flat}], tol)
    assert len(hit) == 1 and "one trust ratio per flat ZeRO partition" in hit[0]
    miss = _diagnose_flat_lamb([{"rank": 0, "params": [per_tensor],
                                 "flat_partition_params": flat}], tol)
    assert len(miss) == 1 and "match neither LAMB nor" in miss[0], miss
    assert not any(re.search(DS_490.failure, line) for line in miss)
    assert _diagnose_flat_lamb([{"rank": 0, "params": [flat],
                                 "flat_partition_params": None}], tol) == []


# DeepSpeed's ZeRO on CPU ranks with FusedLamb's CUDA kernel replaced by its rule on the host
# (optimizer_rules.lamb_step, one call per tensor FusedLamb is handed, as the kernel is): the
# real ZeRO flattening and partitioning decide what a "tensor" is.
class _HostLamb:
    @staticmethod
    def lamb(p, out_p, exp_avg, exp_avg_sq, grad, lr, beta1, beta2, max_coeff, min_coeff, eps,
             scale, step, eps_mode, bias_correction, weight_decay):
        from suites.optimizer_rules import lamb_step

        assert eps_mode == 1 and bias_correction == 1  # FusedLamb's defaults, the suite's form
        return torch.tensor(lamb_step(
            p, grad / scale, exp_avg, exp_avg_sq, step, lr=lr, betas=(beta1, beta2), eps=eps,
            weight_decay=weight_decay, max_coeff=max_coeff, min_coeff=min_coeff))


class _HostLambBuilder:
    def load(self):
        return _HostLamb()


def train_with_host_lamb(case):
    """Rank entry point: train_optimizer with FusedLamb's kernel on the host."""
    from deepspeed.ops.lamb import fused_lamb

    from suites.optimizer_ranks import train_optimizer

    real = fused_lamb.FusedLambBuilder
    fused_lamb.FusedLambBuilder = _HostLambBuilder
    try:
        return train_optimizer(case)
    finally:
        fused_lamb.FusedLambBuilder = real


def _host_lamb(stage: int, world_size: int):
    from dsconform.harness.api import run_ranks
    from suites.optimizer_ranks import OptCase
    from suites.test_optimizers import judge

    case = OptCase("lamb", stage, "none", "fp32", 1, world_size)
    results = run_ranks(train_with_host_lamb, world_size, timeout_s=300, args=(case,),
                        accelerator="cpu")
    return judge(results, case, "cpu")


def test_host_lamb_on_stage_0_is_lamb():
    cmp = _host_lamb(0, 1)
    assert cmp.ok, cmp.report()


@pytest.mark.parametrize("stage, world_size", [(1, 1), (2, 2), (3, 1)])
def test_host_lamb_on_zero_is_flat_partition_lamb(stage: int, world_size: int):
    """ZeRO hands FusedLamb each rank's flat partition of a group: the cell departs from LAMB
    (on one rank, on the group of two tensors only; on two, every group is split between the
    ranks), and the diagnosis names flat-partition LAMB on every rank
    (DS-490-ZERO-LAMB-FLAT-TRUST-RATIO's signature)."""
    cmp = _host_lamb(stage, world_size)
    assert not cmp.ok
    if world_size == 1:
        assert {d.name.split("/")[0] for d in cmp.failures} == {"fc1.bias", "fc2.bias"}, \
            cmp.report()
    hits = [p for p in cmp.notes if "one trust ratio per flat ZeRO partition" in p]
    assert len(hits) == world_size, cmp.report()
