"""dsconform.checks.op_compute and op_io: the ops' functional checks with real data, each
against its reference, and red when the op computes or stores wrongly. The ops build once into
the stable extensions cache (tests/ops/test_ops_lib.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from dsconform.checks import op_compute
from dsconform.checks.op_compute import (
    check_cpu_adagrad,
    check_cpu_adam,
    check_cpu_lion,
    check_fused_adam,
)
from dsconform.checks.op_io import check_async_io
from dsconform.ops.load import require_op


def _aio() -> Any:
    return require_op("async_io").module

@pytest.mark.parametrize("adamw_mode", [True, False])
def test_cpu_adam_matches_torch(adamw_mode: bool) -> None:
    result = check_cpu_adam(adamw_mode=adamw_mode, weight_decay=0.01)
    print(f"cpu_adam adamw_mode={adamw_mode}: max abs {result['max_abs_diff']:.2e} "
          f"rel {result['max_rel_diff']:.2e}")
    assert result["reference"] == ("AdamW" if adamw_mode else "Adam")
    assert result["max_param_change"] > 0


def test_optimizer_check_goes_red_on_wrong_semantics() -> None:
    # Broken on purpose: DeepSpeed's AdamW (decoupled decay) against torch Adam (L2 decay).
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    hp = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    with pytest.raises(AssertionError, match=r"cpu_adam: step 1, parameter 0 .* max rel diff"):
        op_compute._run_optimizer_pair(
            "cpu_adam", lambda ps: DeepSpeedCPUAdam(ps, adamw_mode=True, **hp),
            lambda ps: torch.optim.Adam(ps, **hp), None, steps=2, sizes=(53,))


@pytest.mark.parametrize("eps", [1e-6, 0.0])
def test_optimizer_check_goes_red_on_a_wrong_eps(eps: float) -> None:
    """DeepSpeed's CPU Adam with another eps (or none) than its torch reference MUST fail: the
    check's gradients reach eps's scale."""
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    hp = dict(lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0)
    with pytest.raises(AssertionError, match=r"cpu_adam: step 1, parameter \d .* max abs diff"):
        op_compute._run_optimizer_pair("cpu_adam", lambda ps: DeepSpeedCPUAdam(ps, eps=eps, **hp),
                                    lambda ps: torch.optim.Adam(ps, eps=1e-8, **hp), None,
                                    steps=2, sizes=(53, 4103))
    # the control: the same eps on both sides passes
    op_compute._run_optimizer_pair("cpu_adam", lambda ps: DeepSpeedCPUAdam(ps, eps=1e-8, **hp),
                                lambda ps: torch.optim.Adam(ps, eps=1e-8, **hp), None, steps=2,
                                sizes=(53, 4103))


# Not promised by cpu-ci and not used by the CPU tier: each is a cold JIT build of 1-4 minutes on
# the 2-core CI machine, so it runs in the nightly tier (-m slow).
@pytest.mark.slow
def test_fused_adam_cpu_matches_torch() -> None:
    result = check_fused_adam("cpu")
    print(f"fused_adam cpu: max abs {result['max_abs_diff']:.2e} rel {result['max_rel_diff']:.2e}")
    assert result["device"] == "cpu"


# Not promised by cpu-ci and not used by the CPU tier: each is a cold JIT build of 1-4 minutes on
# the 2-core CI machine, so it runs in the nightly tier (-m slow).
@pytest.mark.slow
def test_cpu_adagrad_matches_torch() -> None:
    assert check_cpu_adagrad()["max_param_change"] > 0


# Not promised by cpu-ci and not used by the CPU tier: each is a cold JIT build of 1-4 minutes on
# the 2-core CI machine, so it runs in the nightly tier (-m slow).
@pytest.mark.slow
def test_cpu_lion_matches_reference() -> None:
    assert check_cpu_lion()["max_param_change"] > 0


# whole blocks, and a partial last block
@pytest.mark.parametrize("nbytes", [64 * 1024**2, 1024**2 + 512])
def test_async_io_roundtrip(tmp_path: Path, nbytes: int) -> None:
    result = check_async_io(_aio(), tmp_path, nbytes)
    print(f"async_io {nbytes} bytes: write {result['write_gbps']:.2f} GB/s, "
          f"read {result['read_gbps']:.2f} GB/s")
    assert result["equal"] and result["bytes"] == nbytes
    assert result["write_gbps"] > 0 and result["read_gbps"] > 0
    assert list(tmp_path.iterdir()) == [], "the check must remove its file"


@pytest.mark.parametrize("nbytes", [1024**2 + 7, 4103, 0])
def test_async_io_refuses_unaligned_sizes(tmp_path: Path, nbytes: int) -> None:
    # DeepSpeed 0.19.8 would write a truncated file and then abort the process on the read.
    with pytest.raises(ValueError, match="multiple of the handle's alignment"):
        check_async_io(_aio(), tmp_path, nbytes)
    assert list(tmp_path.iterdir()) == []


def test_async_io_check_goes_red_on_corruption(tmp_path: Path) -> None:
    def flip_one_byte(path: Path) -> None:
        with open(path, "r+b") as f:
            f.seek(4097)
            byte = f.read(1)
            f.seek(4097)
            f.write(bytes([byte[0] ^ 0xFF]))
            f.flush()
            os.fsync(f.fileno())

    with pytest.raises(AssertionError, match=r"1 differing bytes of 1048576, first at offset 4097"):
        check_async_io(_aio(), tmp_path, 1024**2, tamper=flip_one_byte)
    assert list(tmp_path.iterdir()) == []


