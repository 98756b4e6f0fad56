"""The checkpoint suite's library logic, without DeepSpeed ranks: the preflight, the sha256
manifest, the damage tools, the flattening of nested state, state comparison and the judgement
of partial loads. Real files in tmp_path; fakes only for the library's own inputs (snapshots)
and for the free-space number (disk_usage) of a disk this machine does not have.
"""

from __future__ import annotations

import shutil
import zipfile
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from dsconform.checks import checkpoint_state as cs
from dsconform.checks.equivalence import compare_states
from dsconform.checks.tolerances import Tol, tolerance
from dsconform.storage import checkpoint as st

EXACT = tolerance("checkpoint", "fp32", "adam", accelerator="cpu")


# ---------------------------------------------------------------------------- preflight

def test_preflight_accepts_a_writable_roomy_directory_and_writes_nothing(tmp_path):
    st.preflight(tmp_path / "ckpt", 1 << 20)
    assert list(tmp_path.iterdir()) == []


def test_preflight_refuses_too_little_space_before_writing(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(st.shutil, "disk_usage", lambda p: usage(10**12, 10**12 - 10**9, 10**9))
    with pytest.raises(st.CheckpointStorageError) as err:
        st.preflight(tmp_path / "ckpt", 6 * 10**8)  # 1.2 GB with 2x headroom > 1 GB free
    msg = str(err.value)
    assert str(tmp_path / "ckpt") in msg and "1 GB free" in msg and "--scratch" in msg, msg
    assert "0.6 GB" in msg and "1.2 GB" in msg, msg
    assert list(tmp_path.iterdir()) == []
    st.preflight(tmp_path / "ckpt", 4 * 10**8)  # 0.8 GB fits


def test_preflight_refuses_an_unwritable_directory():
    # /proc refuses new files even to root (CI runs as root, so chmod would prove nothing).
    with pytest.raises(st.CheckpointStorageError, match=r"/proc/dsconform-ckpt: cannot write in "
                                                        r"/proc .*point --scratch"):
        st.preflight(Path("/proc/dsconform-ckpt"), 1)


def test_preflight_refuses_a_file_in_the_way(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(st.CheckpointStorageError, match="is not a directory"):
        st.preflight(tmp_path / "f" / "ckpt", 1, option="--results")
    with pytest.raises(ValueError):
        st.preflight(tmp_path, -1)


# ---------------------------------------------------------------------------- manifest, damage

def _ckpt(tmp_path: Path) -> Path:
    root = tmp_path / "tag"
    (root / "sub").mkdir(parents=True)
    torch.save({"w": torch.arange(4096, dtype=torch.float32), "step": 3}, root / "a.pt")
    torch.save({"m": torch.ones(7)}, root / "sub" / "b.pt")
    return root


def test_manifest_is_sha256sum_format_and_verifies(tmp_path):
    root = _ckpt(tmp_path)
    manifest = st.write_manifest(root)
    lines = manifest.read_text().splitlines()
    assert [ln.split("  ")[1] for ln in lines] == ["a.pt", "sub/b.pt"]
    assert all(len(ln.split("  ")[0]) == 64 for ln in lines)
    if shutil.which("sha256sum"):  # the format coreutils checks
        import subprocess
        subprocess.run(["sha256sum", "--quiet", "-c", st.MANIFEST_NAME], cwd=root, check=True)
    st.drop_cached_pages(st.checkpoint_files(root))
    assert st.verify_manifest(root) == []
    assert st.total_bytes(root) == sum(p.stat().st_size for p in st.checkpoint_files(root))


def test_manifest_names_a_flipped_bit_a_missing_and_an_unlisted_file(tmp_path):
    root = _ckpt(tmp_path)
    st.write_manifest(root)
    flip = st.flip_tensor_byte(root / "a.pt")
    (root / "sub" / "b.pt").unlink()
    (root / "extra.pt").write_bytes(b"x")
    problems = st.verify_manifest(root)
    assert problems[0].startswith("a.pt: sha256 ") and "read back" in problems[0], problems
    assert problems[1:] == ["sub/b.pt: listed in SHA256SUMS but missing",
                            "extra.pt: present but not in SHA256SUMS"]
    assert flip.entry.endswith("/data/0")


def test_a_flipped_tensor_bit_loads_silently_with_torch(tmp_path):
    """The fact behind CKPT-CORRUPT-2's strict xfail: the zip stays valid, torch.load does not
    check the CRC-32 it wrote, and exactly one element changes."""
    root = _ckpt(tmp_path)
    before = torch.load(root / "a.pt", weights_only=True)["w"]
    flip = st.flip_tensor_byte(root / "a.pt")
    after = torch.load(root / "a.pt", weights_only=True)["w"]
    assert int((after != before).sum()) == 1
    with zipfile.ZipFile(root / "a.pt") as z:
        assert z.testzip() == flip.entry  # Python's zipfile does check the CRC


def test_truncate_makes_torch_load_fail(tmp_path):
    root = _ckpt(tmp_path)
    size = (root / "a.pt").stat().st_size
    assert st.truncate(root / "a.pt") == size // 2
    with pytest.raises((RuntimeError, OSError)):  # which one depends on where the cut falls
        torch.load(root / "a.pt", weights_only=True)


def test_flip_needs_tensor_data(tmp_path):
    torch.save({"step": 3}, tmp_path / "x.pt")
    with pytest.raises(ValueError, match="no uncompressed tensor storage"):
        st.flip_tensor_byte(tmp_path / "x.pt")


def test_estimate_counts_weights_masters_and_moments():
    assert st.estimate_bytes(1000, param_bytes=2) == 1000 * (2 + 4 + 8) + (1 << 20)


# ---------------------------------------------------------------------------- flatten, compare

class _Scaler:
    def __init__(self):
        self.cur_scale = 256.0
        self.dynamic = True
        self._private = 1

    def update(self):  # callables are not state
        pass


def test_flatten_state_names_every_leaf():
    import enum

    class Stage(enum.IntEnum):
        two = 2

    flat = cs.flatten_state({"state": {0: {"exp_avg": torch.ones(2)}}, "groups": [{"lr": 0.1}],
                             "loss_scaler": _Scaler(), "stage": Stage.two, "none": None},
                            "optimizer")
    assert set(flat) == {"optimizer/state/0/exp_avg", "optimizer/groups[0]/lr",
                         "optimizer/loss_scaler:type", "optimizer/loss_scaler.cur_scale",
                         "optimizer/loss_scaler.dynamic", "optimizer/stage", "optimizer/none"}
    assert flat["optimizer/stage"] == 2 and flat["optimizer/loss_scaler:type"] == "_Scaler"


def test_compare_states_is_exact_and_names_what_differs():
    a = {"module/w": torch.tensor([1.0, 2.0]), "engine/global_steps": 3, "x": "v"}
    assert compare_states(dict(a), a, EXACT).ok
    b = dict(a, **{"module/w": torch.tensor([1.0, 2.0 + 2**-20])})
    cmp = compare_states(b, a, EXACT, label="rt")
    assert not cmp.ok and "state of 'module/w'" in cmp.report()
    problems = compare_states({"module/w": a["module/w"].bfloat16(), "engine/global_steps": 3,
                               "x": "w"}, a, EXACT).problems
    assert any("torch.bfloat16" in p for p in problems) and any("'w' in the candidate" in p
                                                                 for p in problems)
    assert "only in the reference ['x']" in compare_states({"module/w": a["module/w"]},
                                                           {"module/w": a["module/w"], "x": 1},
                                                           EXACT).problems[0]
    assert not compare_states({}, {}, EXACT).ok
    nan = {"w": torch.tensor([float("nan")])}
    assert not compare_states(nan, nan, EXACT).ok


# ---------------------------------------------------------------------------- partial loads

def _snap(module: float, moment: float, it: int, steps: int) -> dict:
    return {"module/w": torch.full((3,), module),
            "optimizer/base_optimizer_state/state/0/exp_avg": torch.full((3,), moment),
            "optimizer/base_optimizer_state/state/0/step": torch.tensor(float(steps)),
            "scheduler/last_batch_iteration": it, "engine/global_steps": steps,
            "engine/global_samples": 8 * steps, "engine/skipped_steps": 0}


SAVED, FRESH = _snap(1.0, 0.5, 2, 3), _snap(9.0, 0.0, -1, 0)


def test_components_of_a_snapshot():
    assert cs.component("optimizer/base_optimizer_state/state/0/exp_avg") == "moments"
    assert cs.component("optimizer/state/3/momentum_buffer") == "moments"
    # Adam's step count (its bias correction) goes with the moments, per parameter or per group
    assert cs.component("optimizer/base_optimizer_state/state/0/step") == "moments"
    assert cs.component("optimizer/base_optimizer_state/param_groups[0]/step") == "moments"
    assert cs.component("scheduler/x") == "scheduler"
    assert cs.component("engine/lr[0]") is None
    with pytest.raises(ValueError):
        cs.select(SAVED, "weights")


@pytest.mark.parametrize("mode", list(cs.LOAD_MODES))
def test_a_load_that_does_what_its_flags_say_passes(mode):
    exp = cs.EXPECTED[mode]
    loaded = {}
    for name in SAVED:
        which = cs.component(name)
        src = SAVED if which is None or exp[which] == "saved" else FRESH
        loaded[name] = src[name]
    assert cs.judge_load(mode, SAVED, FRESH, loaded, EXACT) == []


def test_a_load_that_ignores_load_optimizer_states_false_is_named():
    loaded = dict(SAVED)  # everything loaded although the optimizer should not have been
    problems = cs.judge_load("no_optimizer", SAVED, FRESH, loaded, EXACT, where="rank 1")
    assert len(problems) == 1, problems
    assert problems[0].startswith("load_checkpoint(load_optimizer_states=False) (rank 1): "
                                  "moments must be the fresh engine's (it holds the saved "
                                  "values)"), problems[0]


def test_a_full_load_that_drops_the_scheduler_is_named():
    loaded = dict(SAVED, **{"scheduler/last_batch_iteration": -1})
    problems = cs.judge_load("full", SAVED, FRESH, loaded, EXACT)
    assert len(problems) == 1 and "scheduler must be the saved engine's (it holds the fresh" \
        in problems[0], problems


def test_indistinguishable_saved_and_fresh_is_a_problem_not_a_pass():
    problems = cs.judge_load("no_scheduler", SAVED, dict(FRESH, **{
        "scheduler/last_batch_iteration": 2}), dict(SAVED), EXACT)
    assert any("cannot tell them apart" in p for p in problems), problems


def test_a_load_that_keeps_the_fresh_step_count_is_named():
    """Adam's moments loaded but its step count left at the fresh engine's (every bias
    correction then restarts): the moments component MUST fail."""
    loaded = dict(SAVED, **{"optimizer/base_optimizer_state/state/0/step": torch.tensor(0.0)})
    problems = cs.judge_load("full", SAVED, FRESH, loaded, EXACT)
    assert len(problems) == 1 and problems[0].startswith(
        "load_checkpoint(defaults): moments must be the saved engine's"), problems
    assert "state/0/step" in problems[0], problems


def test_a_skip_counter_alike_in_saved_and_fresh_is_a_problem_with_a_dynamic_scaler():
    """With a dynamic loss scaler the saved engine must have skipped a step (the suite injects
    overflows before the save): a skip counter the fresh engine also holds makes the counters'
    check vacuous for it. Without one (bf16, fp32) it is a constant and not asked for."""
    dynamic = {"loss_scaler/dynamic": True}
    problems = cs.judge_load("full", dict(SAVED, **dynamic), dict(FRESH, **dynamic),
                             dict(SAVED, **dynamic), EXACT)
    assert problems == ["load_checkpoint(defaults): counters: the checkpoint and the fresh "
                        "engine hold the same engine/skipped_steps (0); the check cannot tell "
                        "them apart"], problems
    assert cs.judge_load("full", SAVED, FRESH, dict(SAVED), EXACT) == []
    assert cs.same_as_fresh(dict(SAVED, **dynamic), dict(FRESH, **dynamic,
                                                        **{"engine/skipped_steps": 2})) == []


def test_empty_fresh_moments_left_empty_pass():
    fresh = {k: v for k, v in FRESH.items() if cs.component(k) != "moments"}
    loaded = {k: (v if cs.component(k) != "moments" else None) for k, v in SAVED.items()}
    loaded = {k: v for k, v in loaded.items() if v is not None}
    loaded["scheduler/last_batch_iteration"] = 2
    assert cs.judge_load("no_optimizer", SAVED, fresh, loaded, Tol(0, 0)) == []


def _loaded(mode: str, saved: dict, fresh: dict, masters: float) -> dict:
    """What a load that obeys its flags holds, with the fp32 masters given."""
    exp = cs.EXPECTED[mode]
    out = {name: (saved if cs.component(name) is None or exp[cs.component(name)] == "saved"
                  else fresh)[name] for name in saved if cs.component(name) != "masters"}
    out["fp32/w"] = torch.full((3,), masters)
    return out


# bf16 training: the module holds 1.0, the fp32 master 1.004 it was rounded from.
SAVED_M = dict(SAVED, **{"fp32/w": torch.full((3,), 1.004)})
FRESH_M = dict(FRESH, **{"fp32/w": torch.full((3,), 9.0)})


@pytest.mark.parametrize("mode, good, bad", [
    ("full", [1.004], [1.0, 9.0]),
    ("no_scheduler", [1.004], [1.0, 9.0]),
    ("no_optimizer", [1.004, 1.0], [9.0]),  # ZeRO 1-3 restore them from the weights
    ("module_only", [1.0], [1.004, 9.0]),
])
def test_fp32_masters_must_not_stay_the_fresh_engines(mode, good, bad):
    """A load that keeps the fresh engine's fp32 masters would overwrite the loaded weights at
    its next step (found by mutation: a no_scheduler load that left them passed before)."""
    for masters in good:
        loaded = _loaded(mode, SAVED_M, FRESH_M, masters)
        assert cs.judge_load(mode, SAVED_M, FRESH_M, loaded, EXACT) == [], masters
    for masters in bad:
        problems = cs.judge_load(mode, SAVED_M, FRESH_M, _loaded(mode, SAVED_M, FRESH_M, masters),
                                 EXACT)
        assert len(problems) == 1 and ": masters must be " in problems[0], (masters, problems)
    if mode == "no_scheduler":
        assert "(it holds the fresh values)" in cs.judge_load(
            mode, SAVED_M, FRESH_M, _loaded(mode, SAVED_M, FRESH_M, 9.0), EXACT)[0]


@pytest.mark.parametrize("mode", ["module_only", "no_optimizer"])
def test_a_master_missing_after_the_load_is_named(mode):
    """Restored-from-the-weights masters are expected for every saved master, not only for
    the ones the load left (a load that drops one would otherwise pass)."""
    saved = dict(SAVED_M, **{"module/v": torch.full((2,), 2.0), "fp32/v": torch.full((2,), 2.0)})
    fresh = dict(FRESH_M, **{"module/v": torch.full((2,), 7.0), "fp32/v": torch.full((2,), 7.0)})
    loaded = _loaded(mode, saved, fresh, 1.0)
    loaded["module/v"] = saved["module/v"]
    assert cs.judge_load(mode, saved, fresh, dict(loaded, **{"fp32/v": torch.full((2,), 2.0)}),
                         EXACT) == []
    problems = cs.judge_load(mode, saved, fresh, loaded, EXACT)  # fp32/v gone
    assert len(problems) == 1 and "'fp32/v'" in problems[0] and "masters must be" in problems[0], \
        problems


# ---------------------------------------------------------------------------- ds_config

def _cfg(**kw):
    from dsconform.checks.dsconfig import ds_config

    base = {"stage": 3, "dtype": "fp32", "optimizer": "adam", "lr": 1e-3, "micro_batch": 4,
            "grad_accum": 1, "world_size": 2}
    return ds_config(**{**base, **kw})


def test_ds_config_checkpoint_arguments():
    assert "scheduler" not in _cfg() and "checkpoint" not in _cfg()
    cfg = _cfg(lr_warmup_steps=10, checkpoint_writer="fast", load_universal=True)
    assert cfg["scheduler"] == {"type": "WarmupLR", "params": {
        "warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 10,
        "warmup_type": "linear"}}
    assert cfg["checkpoint"]["load_universal"] is True
    assert cfg["checkpoint"]["writer"]["type"] == "fast" and "aio" in cfg
    with pytest.raises(ValueError, match=r"ds_config\(checkpoint_writer='fast'\): needs "
                                         r"stage=3 \(stage=2\)"):
        _cfg(stage=2, checkpoint_writer="fast")
    with pytest.raises(ValueError, match=r"checkpoint_writer='nebula'"):
        _cfg(checkpoint_writer="nebula")
    with pytest.raises(ValueError, match=r"lr_warmup_steps=-1"):
        _cfg(lr_warmup_steps=-1)
    with pytest.raises(ValueError, match=r"load_universal=1"):
        _cfg(load_universal=1)


def test_read_back_verdict():
    """Wrong bytes fail even when memory served them; a clean read-back from memory cannot vouch
    for a device (a skip naming the fraction); a clean one from the device passes."""
    root = Path("/scratch/ckpt/r0")
    verdict, why = st.read_back_verdict(root, ["a.pt: sha256 ... read back"], 1.0)
    assert verdict == "fail" and "returned other bytes than were written" in why
    verdict, why = st.read_back_verdict(root, [], 0.25)
    assert verdict == "skip" and "25% of a file's pages stayed in memory" in why, why
    assert st.read_back_verdict(root, [], 0.0) == ("pass", "")
