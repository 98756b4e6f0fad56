"""Version awareness of the onebit suite: a DeepSpeed without 1-bit optimizers is reported by
name (a skip saying "removed in DeepSpeed 0.19.7, PR #8490"), and a profile that promises one
turns that removal into a failure. Plus the profile field and the ds_config arguments behind it.

The last two tests run the real suite (suites/test_onebit.py) in a pytest subprocess on this
machine's DeepSpeed (0.19.8 here): once with the shipped cpu-ci profile (every GPU test skips,
naming the removal, and the results record it), once with a profile that promises OneBitAdam
(the tests that need it fail, naming the promise and the version found).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsconform.base import removed, versions
from dsconform.checks.dsconfig import ds_config
from dsconform.gate import requires as gating
from dsconform.profile.schema import PROFILES_DIR, Profile, from_data, validate_data
from tests.node.test_detect import fake_node

ROOT = Path(__file__).resolve().parents[2]
REMOVAL = "removed in DeepSpeed 0.19.7, PR #8490 https://github.com/deepspeedai/DeepSpeed/pull/8490"
PLAIN = Profile(name="plain", source="t", gpu_count=0)
PROMISES = Profile(name="promises", source="t", gpu_count=0, onebit=("OneBitAdam",))


def node(version: str | None):
    n = fake_node(0)
    n.deepspeed_version = version
    return n


@pytest.mark.parametrize("version, gone", [("0.19.6", False), ("0.19.6.post1", False),
                                           ("0.19.7", True), ("0.19.8", True), ("0.20.0", True),
                                           (None, True)])
def test_removal_is_by_version(version, gone):
    for name in removed.ONEBIT_OPTIMIZERS:
        assert (removed.removal(name, version) is not None) is gone
    with pytest.raises(KeyError):
        removed.removal("TwoBitAdam", "0.19.6")


def test_skip_names_the_removal_with_the_gpu_count():
    v = gating.evaluate({"min_gpus": 2, "onebit": ["OneBitAdam"]}, node("0.19.8"), PLAIN)
    assert not v.broken_promises
    assert v.skip_reason == (f"Requires: [GPUs>=2 (found 0) + OneBitAdam ({REMOVAL}) "
                             f"(found DeepSpeed 0.19.8)]")


def test_promised_optimizer_removed_is_a_failure():
    v = gating.evaluate({"onebit": ["OneBitAdam", "OneBitLamb"]}, node("0.19.8"), PROMISES)
    assert [u.needed.split()[0] for u in v.broken_promises] == ["OneBitAdam"]
    assert v.fail_reason == (f"profile promises promises [OneBitAdam ({REMOVAL})]: expected "
                             f"OneBitAdam to train (deepspeed.onebit), found DeepSpeed 0.19.8")


def test_present_on_0196_promised_or_not():
    for prof in (PLAIN, PROMISES):
        assert gating.evaluate({"onebit": "ZeroOneAdam"}, node("0.19.6"), prof).ok


def test_onebit_conditions_merge_as_a_union():
    marks = [gating.requires(onebit="OneBitAdam").mark,
             gating.requires(onebit=["OneBitAdam", "OneBitLamb"]).mark]
    assert gating.merge_conditions(marks, {"multigpu"}) == {
        "onebit": ["OneBitAdam", "OneBitLamb"], "min_gpus": 2}


def _profile(**deepspeed) -> dict:
    return {"profile": {"name": "p"}, "gpus": {"count": 2}, "deepspeed": deepspeed}


def test_profile_field_is_validated():
    assert validate_data(_profile(onebit=["OneBitAdam", "ZeroOneAdam"]), "p.toml") == []
    assert from_data(_profile(onebit=["OneBitLamb"]), "p.toml").onebit == ("OneBitLamb",)
    assert validate_data(_profile(onebit=["onebitadam"]), "p.toml") == [
        "p.toml: deepspeed.onebit[0]: expected one of OneBitAdam, ZeroOneAdam, OneBitLamb, "
        "found 'onebitadam'"]
    assert validate_data(_profile(onebit=["OneBitAdam", "OneBitAdam"]), "p.toml") == [
        "p.toml: deepspeed.onebit[1]: 'OneBitAdam' is listed twice"]
    assert validate_data(_profile(onebit="OneBitAdam"), "p.toml") == [
        "p.toml: deepspeed.onebit: expected array, found 'OneBitAdam'"]


BASE = dict(stage=0, dtype="fp16", lr=1e-3, micro_batch=8, grad_accum=1, world_size=2)


def test_onebit_configs_write_every_parameter():
    adam = ds_config(**BASE, optimizer="onebit_adam", freeze_step=40)
    assert adam["optimizer"] == {"type": "OneBitAdam", "params": {
        "lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0,
        "bias_correction": True, "eps_inside_sqrt": False, "amsgrad": False,
        "cuda_aware": False, "comm_backend_name": "nccl", "freeze_step": 40}}
    assert adam["zero_optimization"] == {"stage": 0}
    zo = ds_config(**BASE, optimizer="zero_one_adam", var_freeze_step=40)["optimizer"]
    assert zo["type"] == "ZeroOneAdam" and "freeze_step" not in zo["params"]
    assert {k: zo["params"][k] for k in ("var_freeze_step", "var_update_scaler",
                                         "local_step_scaler", "local_step_clipper")} == {
        "var_freeze_step": 40, "var_update_scaler": 16, "local_step_scaler": 32678,
        "local_step_clipper": 16}
    lamb = ds_config(**BASE, optimizer="onebit_lamb", freeze_step=40, max_coeff=0.3)["optimizer"]
    assert lamb["type"] == "OneBitLamb"
    assert {k: lamb["params"][k] for k in ("max_coeff", "min_coeff", "coeff_beta", "factor_max",
                                           "factor_min", "factor_threshold")} == {
        "max_coeff": 0.3, "min_coeff": 0.01, "coeff_beta": 0.9, "factor_max": 4.0,
        "factor_min": 0.5, "factor_threshold": 0.1}


@pytest.mark.parametrize("changes, argument", [
    (dict(optimizer="onebit_adam"), "freeze_step"),                      # 100000 never freezes
    (dict(optimizer="onebit_adam", freeze_step=0), "freeze_step"),
    (dict(optimizer="onebit_adam", freeze_step=40, stage=1), "stage"),   # not with ZeRO
    (dict(optimizer="onebit_adam", freeze_step=40, dtype="bf16"), "dtype"),
    (dict(optimizer="zero_one_adam", freeze_step=40), "var_freeze_step"),
    (dict(optimizer="zero_one_adam", var_freeze_step=40, freeze_step=40), "freeze_step"),
    (dict(optimizer="onebit_adam", freeze_step=40, max_coeff=0.3), "max_coeff"),
    (dict(optimizer="onebit_lamb", freeze_step=40, local_step_clipper=4), "local_step_clipper"),
    (dict(optimizer="onebit_lamb", freeze_step=40, min_coeff=20.0), "min_coeff"),
    (dict(optimizer="onebit_adam", freeze_step=40, comm_backend_name="gloo"),
     "comm_backend_name"),
    (dict(optimizer="adam", cuda_aware=True), "cuda_aware"),
    (dict(optimizer="onebit_lamb", freeze_step=40, loss_scale=1024.0), "loss_scale"),
])
def test_onebit_arguments_name_what_is_wrong(changes, argument):
    with pytest.raises(ValueError, match=rf"^ds_config\({argument}="):
        ds_config(**{**BASE, **changes})


# ---------------------------------------------------------------- the real suite, this machine

installed = versions.parse(__import__("importlib.metadata").metadata.version("deepspeed"))
needs_removed = pytest.mark.skipif(
    installed is None or installed < versions.Version("0.19.7"),
    reason=f"shows the removal: needs DeepSpeed >= 0.19.7 installed (found {installed})")


def _suite(tmp_path: Path, profile: Path) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """`pytest suites/test_onebit.py -m gpu` (the acceptance tier) with ``profile``; returns
    the process and the outcomes recorded in the results."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSCONFORM_")}
    env.pop("PYTEST_ADDOPTS", None)
    results = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "suites/test_onebit.py",
         "-m", "gpu", "-rs", "--profile", str(profile), "--results", str(results)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    outcomes = [json.loads(line)["outcome"] for line in
                (results / "records.jsonl").read_text().splitlines() if '"outcome"' in line]
    return proc, outcomes


@needs_removed
def test_suite_reports_the_removal_as_skips(tmp_path):
    """cpu-ci promises no 1-bit optimizer: every GPU test skips and says why, in the results
    (and the GPU tier fails on this machine, where no GPU is found)."""
    proc, outcomes = _suite(tmp_path, PROFILES_DIR / "cpu-ci.toml")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "no GPU found on this node" in proc.stdout
    assert outcomes and {o["outcome"] for o in outcomes} == {"skipped"}
    for o in outcomes:
        assert REMOVAL in o["reason"] and o["reason"].startswith("Requires: [GPUs>=2 (found "), o
        assert o["capability"] == "onebit" and o["must"].startswith("ONEBIT-")
    assert "ImportError" not in proc.stdout and "ModuleNotFoundError" not in proc.stdout


@needs_removed
def test_suite_fails_a_promised_optimizer_that_was_removed(tmp_path):
    """The red case: the same run with a profile that promises OneBitAdam."""
    text = (PROFILES_DIR / "cpu-ci.toml").read_text().replace(
        '[deepspeed]\n', '[deepspeed]\nonebit = ["OneBitAdam"]\n', 1).replace(
        'name = "cpu-ci"', 'name = "promises-onebit"', 1)
    assert 'onebit = ["OneBitAdam"]' in text and "promises-onebit" in text
    profile = tmp_path / "promises-onebit.toml"
    profile.write_text(text)
    proc, outcomes = _suite(tmp_path, profile)
    assert proc.returncode == 1, proc.stdout[-3000:]
    failed = {o["nodeid"].split("::")[-1] for o in outcomes if o["outcome"] == "failed"}
    skipped = {o["nodeid"].split("::")[-1] for o in outcomes if o["outcome"] == "skipped"}
    # Every acceptance-tier test that needs OneBitAdam (the allreduce tests serve all three)
    # fails ...
    assert failed == {
        "test_compressed_allreduce_matches_reference[1]",
        "test_compressed_allreduce_matches_reference[53]",
        "test_compressed_allreduce_matches_reference[8x129]",
        "test_compressed_allreduce_matches_reference[65541]",
        "test_compressed_allreduce_cost[64MiB]", "test_compressed_allreduce_cost[256MiB]",
        "test_converges_like_baseline[onebit_adam-fp16]",
        "test_resume_in_compressed_stage[onebit_adam-fp32]",
        "test_resume_keeps_converging[onebit_adam-fp32]",
        "test_replicas_agree_after_resume[onebit_adam-fp32]"}
    # ... and the ones for the optimizers it does not promise still skip.
    assert skipped and all("onebit_adam" not in name for name in skipped)
    reasons = {o["reason"] for o in outcomes if o["outcome"] == "failed"}
    assert reasons == {f"profile promises-onebit promises [OneBitAdam ({REMOVAL})]: expected "
                       f"OneBitAdam to train (deepspeed.onebit), found DeepSpeed {installed}"}
