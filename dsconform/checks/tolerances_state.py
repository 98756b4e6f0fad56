"""The state-fidelity suite's entries of the one tolerance table (dsconform/checks/tolerances.py
adds them to ``TABLE``): (check, dtype, optimizer) -> (rtol, atol, why), the same on both
accelerators.

``state``       a model's state_dict through the engine, a checkpoint round trip and
                zero_to_fp32 against the documented dtype and value (STATE-BUF-1).
``state_full``  DeepSpeed's safe_get_full_* accessors against DDP and torch AdamW (STATE-FULL-1).
"""

from __future__ import annotations

_CPU = "CPU machine, 2 cores, DeepSpeed 0.19.8, torch 2.13 CPU, gloo, 2026-12-04"

_STATE = (0.0, 0.0,
          f"exact: a checkpoint stores bytes, a master rounded to the training dtype and a "
          f"buffer cast to fp32 are deterministic, and the BatchNorm statistics run the same "
          f"kernel on the same data as their reference; measured 0 at stages 0-3, fp32 and "
          f"bf16 ({_CPU}). A buffer in another dtype or one value off is a lost state")
_FULL = (0.0, 0.0,
         f"exact: fp32 gradients averaged over 2 ranks and torch AdamW on them; measured 0 "
         f"for every gradient, parameter and moment at stages 0-3 over 3 steps ({_CPU}); a "
         f"gradient 0.1% off or a group's moments lost is far outside")

ENTRIES: dict[tuple[str, str, str], tuple[float, float, str]] = {
    **{("state", dtype, "adamw"): _STATE for dtype in ("fp32", "bf16", "fp16")},
    ("state_full", "fp32", "adamw"): _FULL,
}
