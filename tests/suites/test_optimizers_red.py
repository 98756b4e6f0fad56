"""OPT-RULE-1 and CLIP-NORM-1/2 MUST go red when the thing they check is wrong. Real DeepSpeed
on 2 CPU ranks, nothing mocked; the faults are injected into the DeepSpeed side only, through
the rank functions' ``tamper`` argument:

- ``perturb_update_rule``: the first moment's decay (Adam's and Lion's beta1) DeepSpeed's
  optimizer applies is 2% off;
- ``drop_group_weight_decay``: the first parameter group reaches DeepSpeed without its own
  weight decay (0.1), so the config's 0 applies;
- ``wrong_norm_type``: DeepSpeed's norm helpers are handed the 2-norm whatever was asked;
- ``muon_no_momentum`` / ``muon_wrong_ns_coefficient``: DeepSpeed's Muon updates without its
  momentum, or orthogonalise with a Newton-Schulz coefficient a = 3.0 for 3.4445;
- ``muon_sgd``: DeepSpeed's Muon update is the raw gradient (SGD), as at stage 0 before 0.19.7.

OPT-MUON-1 shares OPT-RULE-1's rank function and judgement.
"""

from __future__ import annotations

import pytest

from dsconform.harness.api import run_ranks
from suites.optimizer_ranks import OptCase, train_optimizer
from suites.test_grad_clipping import check
from suites.test_optimizers import judge

# ZeRO-3 with the parameters and optimizer offloaded: DeepSpeedCPUAdam, the op the CI profile
# promises; a cell of the CPU tier that passes untampered.
CASE = OptCase("adam", 3, "param+opt", "fp32", 1, 2)


def _judge(tamper: str | None, case: OptCase = CASE, timeout_s: int = 300):
    results = run_ranks(train_optimizer, case.world_size, timeout_s=timeout_s, args=(case,),
                        kwargs={"tamper": tamper}, accelerator="cpu")
    return judge(results, case, "cpu")


def test_control_passes():
    cmp = _judge(None)
    assert cmp.ok, cmp.report()


@pytest.mark.parametrize("tamper", ["perturb_update_rule", "drop_group_weight_decay"])
def test_tampered_optimizer_fails_at_once(tamper: str):
    cmp = _judge(tamper)
    assert not cmp.ok
    first = cmp.first_divergence
    # Adam's bias correction hides beta1 at step 0 (m_hat = g), so beta1 shows at step 1
    assert first is not None and first.step <= 1, cmp.report()
    # far outside the bound, not at its edge
    assert first.max_abs > 10 * (cmp.tol.atol + cmp.tol.rtol), cmp.report()
    if tamper == "drop_group_weight_decay":  # only the first group's parameter moved otherwise
        assert {d.name for d in cmp.failures} == {"fc1.weight", "fc1.weight/exp_avg",
                                                  "fc1.weight/exp_avg_sq"}, cmp.report()


# Lion offloaded on ZeRO-3 (DeepSpeedCPULion; ZeRO 1/2 cannot read back its state, a known
# issue), whose reference is Lion's rule evaluated in fp32 (suites/optimizer_rules.py lion_step).
LION = OptCase("lion", 3, "opt", "fp32", 1, 2)


@pytest.mark.parametrize("tamper", [None, "perturb_update_rule"])
def test_perturbed_lion_fails(tamper: str | None):
    cmp = _judge(tamper, LION, timeout_s=600)
    if tamper is None:
        assert cmp.ok, cmp.report()
        return
    assert not cmp.ok
    first = cmp.first_divergence
    # beta1 2% off flips the sign of the elements whose c lies near zero: a whole lr (1e-3)
    assert first is not None and first.max_abs > 100 * (cmp.tol.atol + cmp.tol.rtol), \
        cmp.report()


# Muon on ZeRO-2 with the optimizer offloaded (its AdamW a DeepSpeedCPUAdam): the CPU tier's cell;
# and OPT-MUON-1's stage-0 cell of the CPU tier: Muon plainly configured, no ZeRO optimizer.
MUON = OptCase("muon", 2, "opt", "fp32", 1, 2)
PLAIN_MUON_Z0 = OptCase("muon", 0, "none", "fp32", 1, 2, plain=True)


@pytest.mark.parametrize("case, tamper", [
    (MUON, None), (MUON, "muon_no_momentum"), (MUON, "muon_wrong_ns_coefficient"),
    (PLAIN_MUON_Z0, None), (PLAIN_MUON_Z0, "muon_sgd"), (PLAIN_MUON_Z0, "muon_no_momentum")],
    ids=lambda v: v.id if isinstance(v, OptCase) else str(v))
def test_perturbed_muon_fails(case: OptCase, tamper: str | None):
    cmp = _judge(tamper, case, timeout_s=600)
    if tamper is None:
        assert cmp.ok, cmp.report()
        return
    assert not cmp.ok
    first = cmp.first_divergence
    # momentum shows from the second step on (the first update is the normalised gradient
    # either way); a wrong coefficient or no update at all at the first
    assert first is not None and first.step <= (tamper == "muon_no_momentum"), cmp.report()
    assert first.max_abs > 2 * (cmp.tol.atol + cmp.tol.rtol), cmp.report()
    # only the matrices Muon takes move; the biases' AdamW is untouched
    assert {d.name for d in cmp.failures} <= {"fc1.weight", "fc2.weight"}, cmp.report()


@pytest.mark.parametrize("norm", ["1", "inf"])
@pytest.mark.parametrize("world_size, sharded", [(1, False), (2, True)])
def test_wrong_norm_type_fails(norm: str, world_size: int, sharded: bool):
    problems = check("cpu", norm, world_size, sharded, tamper="wrong_norm_type")
    assert problems, f"{norm}-norm computed as the 2-norm passed"
    assert any("clip_grad_norm_ gave norm" in p for p in problems), problems


def test_two_norm_is_the_control():
    """The tamper changes nothing where the 2-norm was asked: the check stays green."""
    assert not check("cpu", "2", 2, True, tamper="wrong_norm_type")
