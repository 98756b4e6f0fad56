"""The failure patterns of the profiler, monitor and clipping entries against the messages the
radar's CPU timeline printed (DeepSpeed 0.16.9-0.18.5 with their period torch), and against
the nearest messages that are some other defect."""

from __future__ import annotations

import pytest

from dsconform.gate import known_issues

ATTENTION = ("get_model_profile of attention (inputs [(2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 6)]): "
             "flops {}, analytic 5880 ({})")
SCALE_SHIFT = ("get_model_profile of {} (inputs [(3, 5, 13)]): flops {}, analytic 390 ({})")
CLIP = ("1-norm on 2 rank(s):\n  rank 0: {} gave norm 3.6489111e+09, torch 62272.9531 (rel diff "
        "5.86e+04)\n  rank 0: clip_grad_norm_ clipped the gradients to other values than torch "
        "(max abs diff 168, max rel diff 1)\n  tolerance: rtol=1e-05 atol=0 (norms summed in "
        "another order)")
LOSS = ("csv_monitor Train/Samples/train_loss: optimizer step 0 wrote {} at step index {}; the "
        "engine held 1.8593389391899109 with 16 samples (rtol=1e-06 atol=0 (the step's loss))")

CASES = [
    ("DS-8246-FLOPS-SDPA-WRAPPERS-PILE-UP", ATTENTION.format(58800, "10x"), True),
    ("DS-8246-FLOPS-SDPA-WRAPPERS-PILE-UP", ATTENTION.format(11760, "2x"), True),
    # a miscount that is no whole multiple is not wrappers piling up
    ("DS-8246-FLOPS-SDPA-WRAPPERS-PILE-UP", ATTENTION.format(2940, "0.5x"), False),
    ("DS-8246-FLOPS-SDPA-WRAPPERS-PILE-UP", ATTENTION.format(8820, "1.5x"), False),
    ("DS-8324-FLOPS-BROADCAST-FROM-FRONT", SCALE_SHIFT.format("scale_shift", 1690, "4.333x"),
     True),
    ("DS-8324-FLOPS-BROADCAST-FROM-FRONT", SCALE_SHIFT.format("scale_shift", 780, "2x"), False),
    ("DS-8324-FLOPS-BROADCAST-FROM-FRONT",
     SCALE_SHIFT.format("scale_shift_operators", 1690, "4.333x"), False),
    ("DS-8313-CLIP-NORM-SQUARED", CLIP.format("clip_grad_norm_"), True),
    # another helper off torch's norm is not clip_grad_norm_'s squaring
    ("DS-8313-CLIP-NORM-SQUARED", CLIP.format("get_flattened_grad_norm"), False),
    ("DS-8313-CLIP-NORM-SQUARED",
     CLIP.format("clip_grad_norm_") + "\n  rank 1: get_global_norm_of_tensors gave norm 1.0, "
     "torch 62272.9531 (rel diff 1)", False),
    ("DS-MONITOR-LOSS-STEP-EARLY", LOSS.format("1.8593389987945557", 0), True),
    # a wrong value, or the right value at another index, is not the step-early write
    ("DS-MONITOR-LOSS-STEP-EARLY", LOSS.format("1.4064772129058838", 0), False),
    ("DS-MONITOR-LOSS-STEP-EARLY", LOSS.format("1.8593389987945557", 32), False),
    ("DS-7665-MONITOR-NO-LOSS", LOSS.format("1.8593389987945557", 0), False),
]


@pytest.mark.parametrize("issue, message, matches", CASES)
def test_failure_pattern(issue: str, message: str, matches: bool):
    assert known_issues.by_id(issue).expects(AssertionError(message)) is matches


@pytest.mark.parametrize("issue, inside, outside", [
    ("DS-8246-FLOPS-SDPA-WRAPPERS-PILE-UP", "0.19.5", "0.19.6"),
    ("DS-8324-FLOPS-BROADCAST-FROM-FRONT", "0.19.6", "0.19.7"),
    ("DS-8313-CLIP-NORM-SQUARED", "0.19.6", "0.19.7"),
    ("DS-MONITOR-LOSS-STEP-EARLY", "0.18.2", "0.18.3"),
    ("DS-7665-MONITOR-NO-LOSS", "0.18.3", "0.18.2"),
])
def test_range_ends_where_the_code_changed(issue: str, inside: str, outside: str):
    ki = known_issues.by_id(issue)
    assert ki.affects(inside) and not ki.affects(outside)
