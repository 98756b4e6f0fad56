"""Rank entry points of the red tests for the Adam-with-L2 cells, hysteresis and the aligned
collectives (tests/suites/test_adam_l2_red.py, tests/suites/test_hysteresis_red.py,
tests/suites/test_collectives_aligned_red.py): the suite's own rank code, run with one real
DeepSpeed function patched in the rank process and restored afterwards.

- ``train_zero_and_ddp_without_l2``: DeepSpeedCPUAdam.step zeroes its param groups'
  weight_decay before stepping: ZeRO-Offload's Adam drops the L2 term, DDP's torch Adam keeps it.
- ``faulty_scaler_trace(settings, overflows, fault)``: the loss-scaling suite's scaler trace
  (suites/loss_scaling_ranks.py) with DynamicLossScaler.update_scale wrong about hysteresis:
  "refill_capped_at_2" refills the budget to at most 2 (DeepSpeed's default, whatever the config
  says), "consecutive_ignored" never refills on a clean step (consecutive_hysteresis ignored).
- ``aligned_tail_unreduced(fn, ...)``: deepspeed.comm.all_reduce on a tensor whose size is a
  multiple of 8 leaves its last 8 elements as this rank's input (a vectorised kernel that skips
  its tail); other sizes, and torch.distributed, stay correct. ``fn`` is one of the suite's
  rank functions, run under the patch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from dsconform.checks.zero_vs_ddp import ZeroCase, train_zero_and_ddp

TAIL = 8


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def train_zero_and_ddp_without_l2(case: ZeroCase) -> dict[str, Any]:
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    original = DeepSpeedCPUAdam.step

    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        for group in self.param_groups:
            group["weight_decay"] = 0.0
        return original(self, *args, **kwargs)

    with _patched(DeepSpeedCPUAdam, "step", step):
        return train_zero_and_ddp(case)


def faulty_scaler_trace(settings: dict[str, Any], overflows: list[bool],
                        fault: str) -> list[dict[str, Any]]:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    from suites.loss_scaling_ranks import scaler_trace

    original = DynamicLossScaler.update_scale

    def refill_capped_at_2(self: Any, overflow: bool) -> None:
        before = self.cur_hysteresis
        original(self, overflow)
        if self.cur_hysteresis > before:
            self.cur_hysteresis = min(self.delayed_shift, 2)

    def consecutive_ignored(self: Any, overflow: bool) -> None:
        consecutive = self.consecutive_hysteresis
        self.consecutive_hysteresis = False
        try:
            original(self, overflow)
        finally:
            self.consecutive_hysteresis = consecutive

    faults = {"refill_capped_at_2": refill_capped_at_2,
              "consecutive_ignored": consecutive_ignored}
    with _patched(DynamicLossScaler, "update_scale", faults[fault]):
        return scaler_trace(settings, overflows)


def _tail_unreduced(call: Callable) -> Callable:
    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if tensor.numel() % TAIL:
            return call(tensor, *args, **kwargs)
        flat = tensor.view(-1)
        mine = flat[-TAIL:].clone()
        result = call(tensor, *args, **kwargs)
        flat[-TAIL:] = mine
        return result
    return all_reduce


def aligned_tail_unreduced(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    import deepspeed.comm as dc

    with _patched(dc, "all_reduce", _tail_unreduced(dc.all_reduce)):
        return fn(*args, **kwargs)


def train_zero_and_ddp_with_local_norm(case: ZeroCase) -> dict[str, Any]:
    """The ZeRO-vs-DDP cell with the ZeRO optimizers' gradient norm taken over this rank's own
    partition only: deepspeed.comm.all_reduce does nothing while DeepSpeedZeroOptimizer (stages
    1-2) and DeepSpeedZeroOptimizer_Stage3 compute the norm (get_grad_norm_direct, and
    complete_grad_norm_calculation_for_cpu_offload under offload). Training still works; it
    clips differently from DDP."""
    import deepspeed.comm as dscomm
    from deepspeed.runtime.zero import stage3, stage_1_and_2

    def local(method: Callable) -> Callable:
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            with _patched(dscomm, "all_reduce", lambda *a, **k: None):
                return method(self, *args, **kwargs)
        return wrapper

    with contextlib.ExitStack() as stack:
        for cls in (stage_1_and_2.DeepSpeedZeroOptimizer, stage3.DeepSpeedZeroOptimizer_Stage3):
            for name in ("get_grad_norm_direct", "complete_grad_norm_calculation_for_cpu_offload"):
                if hasattr(cls, name):
                    stack.enter_context(_patched(cls, name, local(getattr(cls, name))))
        return train_zero_and_ddp(case)


def client_state_dropped(case: Any, ckpt_dir: str) -> dict[str, Any]:
    """The checkpoint suite's client_state round trip with load_checkpoint returning an empty
    client state (what a DeepSpeed that stopped saving it would give back)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    from suites import checkpoint_files_ranks

    real = DeepSpeedEngine.load_checkpoint

    def load(self: Any, *args: Any, **kwargs: Any) -> Any:
        path, _ = real(self, *args, **kwargs)
        return path, {}

    with _patched(DeepSpeedEngine, "load_checkpoint", load):
        return checkpoint_files_ranks.client_state_round_trip(case, ckpt_dir)


def latest_left_stale(case: Any, ckpt_dir: str, saves: int) -> dict[str, Any]:
    """The checkpoint suite's newest-save load with save_checkpoint writing `latest` only on its
    first save (a DeepSpeed that leaves it naming an old tag)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    from suites import checkpoint_files_ranks

    real = DeepSpeedEngine.save_checkpoint
    calls = [0]

    def save(self: Any, save_dir: str, tag: Any = None, client_state: Any = None,
             save_latest: bool = True, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(self, save_dir, tag=tag, client_state=client_state or {},
                    save_latest=save_latest and calls[0] == 1, **kwargs)

    with _patched(DeepSpeedEngine, "save_checkpoint", save):
        return checkpoint_files_ranks.load_latest(case, ckpt_dir, saves)
