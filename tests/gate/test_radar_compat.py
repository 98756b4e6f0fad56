"""What differs between the DeepSpeed releases the suite supports: an API a release lacks skips
its check naming the release that added it (dsconform/base/compat.py); the package installs
beside any release from 0.16 on; the registry's torch incompatibilities cover their cases only
beside the torch they were seen with."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from dsconform.base import compat
from dsconform.checks import dsconfig
from dsconform.gate import known_issues
from dsconform.gate.known_issues import KnownIssue, check_registry, issues_for

ROOT = Path(__file__).resolve().parents[2]
STAGE0_BF16 = dict(stage=0, dtype="bf16", optimizer="sgd", lr=0.1, micro_batch=1, grad_accum=1,
                   world_size=2)


def test_the_package_installs_beside_every_release_from_0_16():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    [ds] = [d for d in deps if d.startswith("deepspeed")]
    from packaging.requirements import Requirement
    spec = Requirement(ds).specifier
    for v in ("0.16.0", "0.16.9", "0.17.6", "0.18.9", "0.19.8", "0.20.0", "1.0.0"):
        assert spec.contains(v), (ds, v)
    assert not spec.contains("0.15.4")


def test_an_addition_is_missing_before_its_release_only():
    assert compat.missing(compat.STAGE0_BF16, "0.16.9").added_in == "0.17.6"
    for v in ("0.17.6", "0.18.9", "0.19.8", "0.19.10", "0.20.0"):
        assert compat.missing(compat.STAGE0_BF16, v) is None, v
    assert compat.skip_reason(compat.STAGE0_BF16, "0.16.9") == (
        "Requires: [ZeRO stage 0 bf16 with bf16 gradient accumulation (added in DeepSpeed "
        "0.17.6, PR #7515 https://github.com/deepspeedai/DeepSpeed/pull/7515) (found DeepSpeed "
        "0.16.9)]")
    with pytest.raises(KeyError):
        compat.missing("no such feature", "0.19.8")


def test_a_stage0_bf16_config_skips_on_a_release_without_it(monkeypatch):
    """On 0.16.9 deepspeed.initialize refuses stage-0 bf16 with bf16 accumulation
    (NotImplementedError): the config builder skips first, naming the release."""
    assert dsconfig.ds_config(**STAGE0_BF16)["data_types"] == {"grad_accum_dtype": "bf16"}
    monkeypatch.setattr(compat, "installed_deepspeed", lambda: "0.16.9")
    with pytest.raises(pytest.skip.Exception, match=r"added in DeepSpeed 0\.17\.6.*found "
                                                    r"DeepSpeed 0\.16\.9"):
        dsconfig.ds_config(**STAGE0_BF16)
    dsconfig.ds_config(**{**STAGE0_BF16, "stage": 1})  # ZeRO 1-3 bf16 exists there
    dsconfig.ds_config(**{**STAGE0_BF16, "dtype": "fp32"})


# ------------------------------------------------------------------ torch incompatibilities

CASE = "test_zero.py::test_zero_matches_ddp[cpu-z1-off_none-fp32-sgd-gas1-ws2]"


def torch_entry(**change) -> KnownIssue:
    base = dict(id="DS-X-TORCH", title="t", deepspeed=">=0.18.0,<=0.18.9",
                link="https://x/1", cases=("test_zero.py::test_zero_matches_ddp[*-z1-*]",),
                seen="here", failure="Output 0 of Split is a view", kind=known_issues.TORCH,
                torch=">=2.13")
    return KnownIssue(**{**base, **change})


def test_a_torch_incompatibility_covers_its_cases_beside_that_torch_only():
    ki = torch_entry()
    assert issues_for(CASE, "0.18.9", (ki,), torch_version="2.13.0+cpu") == [ki]
    assert issues_for(CASE, "0.18.9", (ki,), torch_version="2.14.1") == [ki]
    assert issues_for(CASE, "0.18.9", (ki,), torch_version="2.11.0+cu130") == []
    assert issues_for(CASE, "0.19.0", (ki,), torch_version="2.13.0") == []
    assert "known incompatibility with torch >=2.13" in ki.reason
    assert ki.summary()["kind"] == "torch" and ki.summary()["torch"] == ">=2.13"


@pytest.mark.parametrize("change, problem", [
    ({"torch": ""}, "must name the torch versions"),
    ({"torch": "<2.14"}, "no lower bound"),
    ({"torch": "2.13+"}, "not a version specifier"),
    ({"kind": "hardware"}, "kind must be one of"),
    ({"fixed_in": "0.18.5"}, "inside its own range"),
    ({"fixed_in": "soon"}, "is not a version"),
])
def test_registry_defects_of_the_new_fields_are_named(change, problem):
    [found] = check_registry((torch_entry(**change),))
    assert problem in found


def test_the_shipped_torch_entries_are_sound_and_say_so():
    entries = [ki for ki in known_issues.KNOWN_ISSUES if ki.kind == known_issues.TORCH]
    assert check_registry() == []
    for ki in entries:
        assert ki.torch and f"with torch {ki.torch}" in ki.reason


# ------------------------------------------------------------------ intermittent entries

FAKE_RACE = '''
import pytest

@pytest.mark.parametrize("cell", ["cpu-z3-a-ws2", "cpu-z3-b-ws2", "cpu-z3-c-ws2"])
def test_zero_matches_ddp(cell):
    if cell == "cpu-z3-b-ws2":
        raise AssertionError("state 'w' (rank 0): 3 NaN of 9 elements in the candidate")
    if cell == "cpu-z3-c-ws2":
        raise AssertionError("first diverging step 4: step 4, loss: max rel diff 0.02")
'''


def test_an_intermittent_entry_xfails_its_failure_and_lets_a_pass_pass(pytester, tmp_path,
                                                                       monkeypatch):
    """A race (DS-8539): the cell that hit it is known, the one that did not passes, and one
    that failed another way still FAILS."""
    race = torch_entry(id="DS-X-RACE", kind=known_issues.UPSTREAM, torch="",
                       deepspeed=">=0.16", intermittent=True,
                       cases=("test_zero.py::test_zero_matches_ddp[cpu-z3-*]",),
                       failure=r"\d+ NaN of \d+ elements in the candidate")
    real = known_issues.issues_for
    monkeypatch.setattr(known_issues, "issues_for",
                        lambda case, ds, issues=(race,), torch_version=None:
                        real(case, ds, issues, torch_version))
    pytester.makepyfile(test_zero=FAKE_RACE)
    prof = tmp_path / "p.toml"
    prof.write_text('[profile]\nname = "p"\n[gpus]\ncount = 0\n')
    result = pytester.runpytest("-p", "fixtures.plugin", "--profile", str(prof), "--results",
                                str(pytester.path / "res"))
    result.assert_outcomes(passed=1, xfailed=1, failed=1)
    import json
    doc = json.loads((pytester.path / "res" / "benchmarks.json").read_text())
    got = {o["nodeid"].split("[")[1][:-1]: (o["outcome"], o["known_issue"])
           for o in doc["dsconform"]["outcomes"]}
    assert got == {"cpu-z3-a-ws2": ("passed", ""), "cpu-z3-b-ws2": ("xfailed", "DS-X-RACE"),
                   "cpu-z3-c-ws2": ("failed", "DS-X-RACE")}
    assert "(intermittent)" in race.reason and "proves nothing" in race.reason


# ------------------------------------------------------------------ adapters (fakes: tests only)

class _Fp16Section:
    loss_scale = 0.0

    def dynamic_loss_scale_args(self):
        return {"init_scale": 2 ** 8}


class _Config017:  # DeepSpeedConfig from 0.17.1 on: the section is float16_config
    float16_config = _Fp16Section()


class _Config016:  # DeepSpeedConfig before: the section's values are the config's attributes
    loss_scale = 128.0
    dynamic_loss_scale_args = None


def test_the_fp16_scaler_arguments_are_read_from_either_layout():
    assert compat.fp16_scaler_args(_Config017()) == (0.0, True, {"init_scale": 256})
    assert compat.fp16_scaler_args(_Config016()) == (128.0, False, None)


def test_the_aio_alignment_and_the_old_stage0_scaler_layout():
    class New:
        def get_alignment(self):
            return 2048

    class Old:  # 0.16.9's aio_handle: no get_alignment
        def get_intra_op_parallelism(self):
            return 3

    assert compat.aio_alignment(New()) == 2048 and compat.aio_alignment(Old()) == 1536

    class OldWrapper:  # FP16_Optimizer before 0.18.6
        cur_scale, dynamic_loss_scale = 1024, True

    assert compat.stage0_scaler(OldWrapper()) == (1024.0, True)
    assert compat.stage0_scaler(object()) is None
    from dsconform.checks.lossscale import read_scaler
    state = read_scaler(OldWrapper())
    assert (state.scale, state.dynamic, state.hysteresis_left) == (1024.0, True, None)


def test_a_release_is_held_to_its_own_defaults():
    from dsconform.checks.dsconfig import ASSUMED_DEFAULTS, ASSUMED_RESOLVED, defaults_mismatches
    for change in compat.DEFAULT_HISTORY:
        table = ASSUMED_DEFAULTS if change.key in ASSUMED_DEFAULTS else ASSUMED_RESOLVED
        assert change.key in table, change
        before = compat.assumed_defaults(table, "0.16.9")
        since = compat.assumed_defaults(table, change.changed_in)
        assert before[change.key] == change.before
        assert since[change.key] == table[change.key]
    # ZERO-DEF-2 on 0.17.5 is held to BF16_Optimizer's fp32 accumulation at stage 0
    resolved = compat.assumed_defaults(ASSUMED_RESOLVED, "0.17.5")
    assert (resolved["bf16.z0.grad_accum_dtype"], resolved["bf16.z0.wrapper"]) == \
        ("float32", "BF16_Optimizer")
    assert resolved["bf16.z1.grad_accum_dtype"] == "bfloat16"
    old = compat.assumed_defaults(ASSUMED_DEFAULTS, "0.17.6")
    found = {**ASSUMED_DEFAULTS, "fp16.stage0.scale_factor": compat.MISSING,
             "gradient_clipping": 0.0, "constants.GRADIENT_CLIPPING_DEFAULT": 0.0,
             "bf16.check_grad_overflow": False, "zero.allgather_sequential": compat.MISSING}
    assert defaults_mismatches(old, found) == []  # 0.17.6 as it was: no clipping by default
    assert defaults_mismatches(ASSUMED_DEFAULTS, found)  # held to 0.19.8's, it would fail
    # ...and a default that moved without a record is still named
    assert defaults_mismatches(old, {**found, "adam.eps": 1e-6}) == [
        "adam.eps: expected 1e-08, found 1e-06"]


def test_of_two_issues_covering_a_case_the_one_that_failed_is_recorded(pytester, tmp_path,
                                                                        monkeypatch):
    first = torch_entry(id="DS-X-NAN", kind=known_issues.UPSTREAM, torch="", deepspeed=">=0.16",
                        cases=("test_zero.py::test_zero_matches_ddp[cpu-z3-*]",),
                        failure=r"\d+ NaN of \d+ elements")
    second = torch_entry(id="DS-X-OTHER", kind=known_issues.UPSTREAM, torch="",
                         deepspeed=">=0.16", cases=first.cases, failure="never seen")
    real = known_issues.issues_for
    monkeypatch.setattr(known_issues, "issues_for",
                        lambda case, ds, issues=(first, second), torch_version=None:
                        real(case, ds, issues, torch_version))
    pytester.makepyfile(test_zero=FAKE_RACE.replace('"cpu-z3-a-ws2", ', "")
                        .replace(', "cpu-z3-c-ws2"', ""))
    prof = tmp_path / "p.toml"
    prof.write_text('[profile]\nname = "p"\n[gpus]\ncount = 0\n')
    result = pytester.runpytest("-p", "fixtures.plugin", "--profile", str(prof), "--results",
                                str(pytester.path / "res"))
    # strict xfails of both issues are on the case: the first one's failure satisfies it
    result.assert_outcomes(xfailed=1)
    import json
    doc = json.loads((pytester.path / "res" / "benchmarks.json").read_text())
    [o] = doc["dsconform"]["outcomes"]
    assert (o["outcome"], o["known_issue"]) == ("xfailed", "DS-X-NAN")


@pytest.mark.parametrize("name", sorted(compat.ADDITIONS))
def test_every_addition_names_its_release_and_pull_request(name):
    add = compat.ADDITIONS[name]
    assert add.link.startswith("https://github.com/deepspeedai/DeepSpeed/pull/")
    assert compat.missing(name, add.added_in) is None
    assert compat.missing(name, "0.16.9") is add  # the oldest supported release lacks each
    assert f"(added in DeepSpeed {add.added_in}, PR #" in compat.skip_reason(name, "0.16.9")


def test_a_flaky_report_of_a_race_is_its_xfail_and_other_groups_stay():
    """hypothesis reports an example that failed once and passed on replay as an exception
    group (FlakyFailure): inside it, the race's own failure is the intermittent entry's xfail."""
    race = torch_entry(id="DS-X-RACE", kind=known_issues.UPSTREAM, torch="", deepspeed=">=0.16",
                       intermittent=True, failure=r"loss \(rank \d+\): inf in the candidate")
    flaky = BaseExceptionGroup("unreliable", [AssertionError(
        "cpu-z3: cannot vouch for equivalence: step 4, loss (rank 0): inf in the candidate")])
    out = known_issues.expected_failure([race], flaky)
    assert isinstance(out, pytest.xfail.Exception) and out.issue_id == "DS-X-RACE"
    other = BaseExceptionGroup("unreliable", [AssertionError("first diverging step 2")])
    assert known_issues.expected_failure([race], other) is other


def test_a_release_whose_api_can_hang_skips_naming_the_fix(monkeypatch):
    """0.17.6's aio_handle.wait() (DeepSpeed #7727, fixed in 0.18.4) and 0.19.0's blocking aio
    bindings (#8196, fixed in 0.19.4) can deadlock: DeepNVMe's I/O there skips instead of
    waiting out a 900 s timeout; 0.16.9's older handle and 0.19.4 on do not."""
    assert compat.skip_reason(compat.AIO_WAIT, "0.16.9") is None
    assert compat.skip_reason(compat.AIO_WAIT, "0.19.4") is None
    assert compat.skip_reason(compat.AIO_WAIT, "0.19.8") is None
    for v in ("0.17.6", "0.18.9", "0.19.0", "0.19.3"):
        reason = compat.skip_reason(compat.AIO_WAIT, v)
        assert reason.startswith("Skipped: aio_handle.wait() and the blocking aio bindings can "
                                 "deadlock") and "fixed in 0.19.4" in reason, v
    from dsconform.storage import io as nvme_io
    from dsconform.storage.nvme import AioSettings
    monkeypatch.setattr(compat, "installed_deepspeed", lambda: "0.19.0")
    with pytest.raises(pytest.skip.Exception, match="PR #8196"):
        nvme_io.open_handle(AioSettings())


@pytest.mark.parametrize("version,takes", [("0.19.2", True), ("0.19.3", False), ("0.19.7", False),
                                           ("0.19.8", True), ("0.20.0", True)])
def test_muon_offloaded_reduces_by_all_reduce_where_the_release_refuses_reduce_scatter(
        monkeypatch, version, takes):
    """0.19.3-0.19.7 refuse Muon with reduce_scatter and the optimizer offloaded (ZeRO 1/2): the
    optimizer suite's offloaded Muon cells all-reduce there, and keep DeepSpeed's default
    elsewhere (0.19.2 takes it: its wrong updates are a known issue, not a config to avoid)."""
    from suites import optimizer_ranks as o

    assert compat.muon_offload_reduce_scatter(version) is takes
    monkeypatch.setattr(compat, "installed_deepspeed", lambda: version)
    for stage, offload in ((1, "opt"), (2, "opt"), (2, "none"), (3, "opt")):
        case = o.OptCase("muon", stage, offload, "fp32", 1, 2)
        cfg = o.config(case, o.hyperparameters(case))
        rs = cfg["zero_optimization"].get("reduce_scatter", True)
        assert rs is (stage != 3 and (takes or offload == "none")), (stage, offload, cfg)
