"""dsconform.checks.batch_rule (the batch-size rule and its judgement) and the config sections
the flops, monitor and batch-size suites ask ds_config for; no ranks."""

from __future__ import annotations

import pytest

from dsconform.checks.batch_rule import BatchCase, expected, judge
from dsconform.checks.dsconfig import ds_config

ALL = ("train", "micro", "accum")
BASE = dict(stage=0, dtype="fp32", optimizer="sgd", lr=0.1, micro_batch=3, grad_accum=2,
            world_size=2)


@pytest.mark.parametrize("case, want", [
    (BatchCase(12, 3, 2, ALL, 2), (12, 3, 2)),
    (BatchCase(13, 3, 2, ALL, 2), None),
    (BatchCase(0, 3, 2, ("micro", "accum"), 2), (12, 3, 2)),
    (BatchCase(12, 3, 9, ("train", "micro"), 2), (12, 3, 2)),
    (BatchCase(12, 9, 2, ("train", "accum"), 2), (12, 3, 2)),
    (BatchCase(10, 3, 9, ("train", "micro"), 2), None),  # 10 / 6 is not whole
    (BatchCase(5, 3, 9, ("train", "micro"), 2), None),  # no accumulation >= 1
])
def test_the_rule(case, want):
    assert expected(case) == want


def test_judgement_names_what_is_wrong():
    ok = BatchCase(12, 3, 9, ("train", "micro"), 2)
    assert judge(ok, {"values": (12, 3, 2)}) == []
    assert "DeepSpeed took" in judge(ok, {"values": (12, 3, 1)})[0]
    refused = judge(ok, {"error": "AssertionError: x"})
    assert "refused (AssertionError: x); the rule gives" in refused[0]
    bad = BatchCase(13, 3, 2, ALL, 2)
    assert "the rule refuses it (13 != 3 * 2 * 2)" in judge(bad, {"values": (13, 3, 2)})[0]
    assert judge(bad, {"error": "AssertionError: 13 != 3 * 2 * 2"}) == []
    # 3 is in "13": a value counts as named only as a whole number
    problems = judge(bad, {"error": "AssertionError: 13 != 0"})
    assert "does not name train_micro_batch_size_per_gpu=3, gradient_accumulation_steps=2" \
        in problems[0]


def test_ds_config_writes_only_the_batch_keys_given():
    c = ds_config(**BASE, batch_keys=("train", "micro"), train_batch=13)
    assert c["train_batch_size"] == 13 and c["train_micro_batch_size_per_gpu"] == 3
    assert "gradient_accumulation_steps" not in c
    assert ds_config(**BASE)["train_batch_size"] == 12
    with pytest.raises(ValueError, match=r"ds_config\(batch_keys=\('train', 'bogus'\)\)"):
        ds_config(**BASE, batch_keys=("train", "bogus"))
    with pytest.raises(ValueError, match="train_batch=5.*'train' in batch_keys"):
        ds_config(**BASE, batch_keys=("micro", "accum"), train_batch=5)


def test_ds_config_profiler_and_monitors():
    c = ds_config(**BASE, flops_profile_step=2, flops_output="/tmp/f.txt",
                  csv_monitor_dir="/tmp/csv", tensorboard_dir="/tmp/tb")
    assert c["flops_profiler"]["profile_step"] == 2
    assert c["flops_profiler"]["output_file"] == "/tmp/f.txt"
    assert c["csv_monitor"] == {"enabled": True, "output_path": "/tmp/csv", "job_name": "dsconform"}
    assert c["tensorboard"]["output_path"] == "/tmp/tb"
    assert "flops_profiler" not in ds_config(**BASE) and "csv_monitor" not in ds_config(**BASE)
    with pytest.raises(ValueError, match="flops_output.*needs flops_profile_step"):
        ds_config(**BASE, flops_output="/tmp/f.txt")
    with pytest.raises(ValueError, match="csv_monitor_dir='rel'.*absolute"):
        ds_config(**BASE, csv_monitor_dir="rel")
