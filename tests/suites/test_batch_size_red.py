"""The batch-size suite's checks MUST go red when DeepSpeed accepts an inconsistent batch triple.

The suite's own rank code (suites/batch_size_ranks.py) builds DeepSpeed's config class and a real
engine on 2 ranks of the CPU accelerator, first as they are (the control: refused, by name) and
then with ``lenient=True``: DeepSpeed's own ``DeepSpeedConfig._batch_assertion``, the check that
refuses a triple off the rule, accepts everything. BATCH-REFUSE-1 and BATCH-ENGINE-1 MUST then
fail, naming the case, the values DeepSpeed took and why the rule refuses them.
"""

from __future__ import annotations

from suites.test_batch_size import check_cases, check_engine, pinned_refusals

WS = 2


def test_inconsistent_triple_accepted_fails():
    cases = pinned_refusals(WS)
    assert check_cases(cases, "cpu", WS) == []  # the control
    text = "\n".join(check_cases(cases, "cpu", WS, lenient=True))
    assert ("{train_batch_size=8, train_micro_batch_size_per_gpu=2, "
            "gradient_accumulation_steps=3} on 2 ranks: accepted as train_batch_size=8, "
            "train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=3; the rule refuses "
            "it (8 != 2 * 3 * 2)") in text, text
    # 10 / (3 x 2) floors to an accumulation of 1, accepted as such
    assert ("{train_batch_size=10, train_micro_batch_size_per_gpu=3} on 2 ranks: accepted as "
            "train_batch_size=10, train_micro_batch_size_per_gpu=3, "
            "gradient_accumulation_steps=1") in text, text
    assert text.count("rank 1:") == text.count("rank 0:") == 3, text


def test_engine_accepting_an_inconsistent_triple_fails():
    assert check_engine("inconsistent", "cpu", WS) == []  # the control
    text = "\n".join(check_engine("inconsistent", "cpu", WS, lenient=True))
    assert "rank 0: deepspeed.initialize: {train_batch_size=13, " in text, text
    assert "accepted as train_batch_size=13, train_micro_batch_size_per_gpu=2, " \
           "gradient_accumulation_steps=3; the rule refuses it (13 != 2 * 3 * 2)" in text, text
