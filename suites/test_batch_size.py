"""Batch size: ``train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps
* world_size``. Given any two, DeepSpeed MUST infer the third by this rule; three that break
it, or two from which no whole third follows, MUST be refused by an error that names the values
given.

Cases are drawn by hypothesis in the parent (micro-batch and accumulation 1-6, which two or all
three keys the config writes, a train_batch_size that fits or misses the rule) and checked in
batches, on 2 ranks of the CPU accelerator (every GPU on CUDA). The rule and the judgement:
``dsconform/checks/batch_rule.py``.

- BATCH-RULE-1 (``test_config_infers_the_third``): DeepSpeed's config class (``DeepSpeedConfig``,
  what ``deepspeed.initialize`` builds) MUST hold the rule's three values for every case the rule
  accepts: two given, the third inferred; all three given and consistent, kept.
- BATCH-REFUSE-1 (``test_inconsistent_is_refused``): a triple that breaks the rule, and two
  values whose quotient is not whole (train_batch_size 10, micro-batch 3, 2 ranks), MUST be
  refused, the error naming every value the config gave.
- BATCH-REFUSE-2 (``test_too_small_is_refused_by_name``): two values from which the third would
  be below 1 (train_batch_size smaller than micro-batch x ranks, or than accumulation x ranks)
  MUST be refused the same way.
- BATCH-ENGINE-1 (``test_engine_batch``): one real engine per case family (all three given, each
  key left out, an inconsistent triple) MUST report the rule's values through
  ``train_batch_size()``, ``train_micro_batch_size_per_gpu()`` and
  ``gradient_accumulation_steps()`` and take one optimizer step per accumulation of micro-batches
  (or refuse, naming the values).

Upstream: https://www.deepspeed.ai/docs/config-json/#batch-size-related-parameters

Stable ids: BATCH-RULE-1, BATCH-REFUSE-1, BATCH-REFUSE-2, BATCH-ENGINE-1; each case id
(``cpu-no_accum``) names its cell and does not change.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsconform.suite import ACCELERATORS, accel_cell, batch_rule, run_ranks
from suites import batch_size_ranks

CAPABILITY = "batch_size"
TIMEOUT_S = 300
CPU_WORLD_SIZE = 2

GIVEN = st.sampled_from([("train", "micro", "accum"), ("train", "micro"), ("train", "accum"),
                         ("micro", "accum")])
SMALL = st.integers(min_value=1, max_value=6)


def _world(accelerator: str, node) -> int:
    return CPU_WORLD_SIZE if accelerator == "cpu" else node.gpu_count


@st.composite
def batch_cases(draw: st.DrawFn, ws: int, accepted: bool) -> batch_rule.BatchCase:
    """One case the rule accepts (``accepted``) or refuses with every inferred value >= 1."""
    micro, accum, given = draw(SMALL), draw(SMALL), draw(GIVEN)
    fits = micro * accum * ws
    if accepted:
        return batch_rule.BatchCase(fits, micro, accum, given, ws)
    known = {"train": 1, "micro": micro, "accum": accum}
    if given == ("micro", "accum") or (len(given) == 2 and known[given[1]] * ws == 1):
        # a train_batch_size is always inferred, and any one divides by 1: give all three
        given = ("train", "micro", "accum")
    floor = max([known[k] * ws for k in given if k != "train"] + [1])
    train = draw(st.integers(min_value=floor, max_value=fits + 2 * ws).filter(
        lambda t: t != fits and (len(given) == 3 or t % floor)))
    return batch_rule.BatchCase(train, micro, accum, given, ws)


def check_cases(cases: list[batch_rule.BatchCase], accelerator: str, ws: int,
                lenient: bool = False) -> list[str]:
    found = run_ranks(batch_size_ranks.configure, ws, timeout_s=TIMEOUT_S, args=(cases,),
                      kwargs={"lenient": lenient}, accelerator=accelerator)
    problems = []
    for r, outcomes in enumerate(found):
        for case, outcome in zip(cases, outcomes):
            problems += [f"rank {r}: {p}" for p in batch_rule.judge(case, outcome)]
    return problems


def _params(slow_on_cuda: bool = False) -> list:
    return [accel_cell(accel, world_size=CPU_WORLD_SIZE if accel == "cpu" else "all",
                       slow=slow_on_cuda and accel == "cuda") for accel in ACCELERATORS]


@pytest.mark.parametrize("accelerator", _params(slow_on_cuda=True))
@given(data=st.data())
def test_config_infers_the_third(accelerator: str, data, node):
    """BATCH-RULE-1: DeepSpeed MUST infer the third batch value by the rule."""
    ws = _world(accelerator, node)
    cases = data.draw(st.lists(batch_cases(ws, accepted=True), min_size=1, max_size=8),
                      label="cases")
    problems = check_cases(cases, accelerator, ws)
    assert not problems, "\n".join(problems)


def pinned_refusals(ws: int) -> list[batch_rule.BatchCase]:
    """Checked with every draw, whatever the hypothesis profile: a quotient that is not whole
    each way (5 ws / (3 ws), (3 ws + 1) / (3 ws)) and a triple off the rule."""
    return [batch_rule.BatchCase(5 * ws, 3, 1, ("train", "micro"), ws),
            batch_rule.BatchCase(3 * ws + 1, 1, 3, ("train", "accum"), ws),
            batch_rule.BatchCase(4 * ws, 2, 3, ("train", "micro", "accum"), ws)]


@pytest.mark.parametrize("accelerator", _params(slow_on_cuda=True))
@given(data=st.data())
def test_inconsistent_is_refused(accelerator: str, data, node):
    """BATCH-REFUSE-1: a batch triple that breaks the rule MUST be refused, naming its values."""
    ws = _world(accelerator, node)
    cases = pinned_refusals(ws) + data.draw(
        st.lists(batch_cases(ws, accepted=False), min_size=1, max_size=8), label="cases")
    problems = check_cases(cases, accelerator, ws)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("accelerator", _params())
def test_too_small_is_refused_by_name(accelerator: str, node):
    """BATCH-REFUSE-2: two batch values with no third >= 1 MUST be refused, naming them."""
    ws = _world(accelerator, node)
    cases = [batch_rule.BatchCase(ws * 3 - 1, 3, 1, ("train", "micro"), ws),
             batch_rule.BatchCase(ws * 4 - 1, 1, 4, ("train", "accum"), ws)]
    problems = check_cases(cases, accelerator, ws)
    assert not problems, "\n".join(problems)


# One engine per family: (micro, accum, the keys written, train_batch_size offset from the rule).
FAMILIES = {
    "all_three": (2, 3, ("train", "micro", "accum"), 0),
    "no_train": (3, 2, ("micro", "accum"), 0),
    "no_micro": (3, 2, ("train", "accum"), 0),
    "no_accum": (2, 3, ("train", "micro"), 0),
    "inconsistent": (2, 3, ("train", "micro", "accum"), 1),
}


def engine_case(family: str, ws: int) -> batch_rule.BatchCase:
    micro, accum, keys, off = FAMILIES[family]
    return batch_rule.BatchCase(micro * accum * ws + off, micro, accum, keys, ws)


def check_engine(family: str, accelerator: str, ws: int, lenient: bool = False) -> list[str]:
    case = engine_case(family, ws)
    found = run_ranks(batch_size_ranks.train, ws, timeout_s=TIMEOUT_S, args=(case,),
                      kwargs={"lenient": lenient}, accelerator=accelerator)
    problems = []
    for r, outcome in enumerate(found):
        where = f"rank {r}: deepspeed.initialize"
        problems += [f"{where}: {p}" for p in batch_rule.judge(case, outcome)]
        want = batch_rule.expected(case)
        if want is not None and "values" in outcome and outcome["global_steps"] != 1:
            problems.append(f"{where}: {case}: {want[2]} micro-batches of {want[1]} made "
                            f"{outcome['global_steps']} optimizer steps, expected 1")
        if want is not None and outcome.get("global_samples") not in (None, want[0]):
            problems.append(f"{where}: {case}: one step counted {outcome['global_samples']} "
                            f"samples, train_batch_size is {want[0]}")
    return problems


def _engine_params() -> list:
    """Every family on 2 CPU ranks; on GPUs the family that infers the accumulation in the
    acceptance tier, the rest nightly."""
    return [accel_cell(accel, family, id=family,
                       world_size=CPU_WORLD_SIZE if accel == "cpu" else "all",
                       slow=accel == "cuda" and family != "no_accum")
            for accel in ACCELERATORS for family in FAMILIES]


@pytest.mark.parametrize("accelerator, family", _engine_params())
def test_engine_batch(accelerator: str, family: str, node):
    """BATCH-ENGINE-1: a real engine MUST report (or refuse) the rule's batch values."""
    problems = check_engine(family, accelerator, _world(accelerator, node))
    assert not problems, "\n".join(problems)
