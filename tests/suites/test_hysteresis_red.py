"""LOSS-SCALE-1's explicit sequences MUST catch a DeepSpeed scaler that is wrong about
hysteresis, whatever the hypothesis profile or example database.

Each sequence of suites/test_loss_scaler.py ``SCALER_SEQUENCES`` is replayed on DeepSpeed's
real DynamicLossScaler with update_scale patched in the rank (tests/perturbed_ranks.py
``faulty_scaler_trace``):

- "refill_capped_at_2": a refill restores at most 2 (DeepSpeed's default hysteresis) instead of
  the configured 3 or 4. Hysteresis 1 and 2 cannot show it; every sequence that refills a
  budget of 3 or 4 MUST fail, at the refilling step, naming both budgets;
- "consecutive_ignored": a clean step never refills (consecutive_hysteresis ignored). The
  sequences without consecutive_hysteresis cannot show it; every one with it MUST fail.
The unperturbed scaler passes every sequence (the suite's own test).
"""

from __future__ import annotations

from suites.test_loss_scaler import SCALER_SEQUENCES, ScalerMachine, replay_sequence
from tests import perturbed_ranks


def _machine(fault: str) -> type[ScalerMachine]:
    class Faulty(ScalerMachine):
        trace_fn = staticmethod(perturbed_ranks.faulty_scaler_trace)
        trace_kwargs = {"fault": fault}
    return Faulty


def _failing(fault: str) -> dict[str, list[str]]:
    machine = _machine(fault)
    return {name: problems for name, (s, pattern) in SCALER_SEQUENCES.items()
            if (problems := replay_sequence(s, pattern, machine))}


def test_a_refill_capped_at_two_fails_every_sequence_that_refills_three_or_four():
    failing = _failing("refill_capped_at_2")
    refills_above_two = {"h3c-clean-between", "h4c-clean-between", "h3-raise-refills",
                         "h4c-raise", "h3c-floor"}
    assert set(failing) == refills_above_two, sorted(failing)
    # h3c-clean-between, XX.XX...: the clean step 2 refills to 3; the faulty scaler to 2.
    first = failing["h3c-clean-between"][0]
    assert "steps XX. (X = overflow), step 2 (clean): DeepSpeed's hysteresis left 2, the " \
           "model's 3" in first, first


def test_ignoring_consecutive_hysteresis_fails_every_consecutive_sequence():
    failing = _failing("consecutive_ignored")
    consecutive = {name for name, (s, _) in SCALER_SEQUENCES.items()
                   if s.consecutive_hysteresis}
    assert set(failing) == consecutive, sorted(failing)
    first = failing["h2c-clean-between"][0]
    assert "steps X. (X = overflow), step 1 (clean): DeepSpeed's hysteresis left 1, the " \
           "model's 2" in first, first
