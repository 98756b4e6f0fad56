"""The optimizer and clipping suites' entries of the one tolerance table
(dsconform/checks/tolerances.py adds them to ``TABLE``): (check, dtype, optimizer) -> (rtol,
atol, why), the same on both accelerators.

``optimizer``  DeepSpeed's optimizer against its reference stepped with the same gradient on
               fp32 copies (fp32 masters in bf16 too): the optimizer suite (OPT-*).
``clip_norm``  DeepSpeed's norm helpers against torch.nn.utils.clip_grad_norm_ on the same
               gradients: the clipping suite (CLIP-NORM-*).
"""

from __future__ import annotations

_CPU = "CPU machine, 2 cores, DeepSpeed 0.19.8, torch 2.13 CPU, gloo, 2026-12-04"

_OPT = (1e-5, 1e-6,
        f"the update rule evaluated in another order (DeepSpeed's SIMD/fused kernels against "
        f"torch's loop or the written-out rules in float64): worst abs 1.2e-7 over 6 steps "
        f"(DeepSpeedCPUAdam), 0 for torch's own optimizers ({_CPU}); a beta1 2% off or a "
        f"group's weight decay dropped is off by more than 1e-4")
_CLIP = (1e-5, 0.0,
         f"norms summed in another order (per tensor, then over tensors and ranks): worst "
         f"relative 3.3e-6 over norm types 1, 2, inf on 1 and 2 ranks, sliced or not ({_CPU}); "
         f"3x headroom; a wrong norm type is off by a factor")

ENTRIES: dict[tuple[str, str, str], tuple[float, float, str]] = {
    **{("optimizer", dtype, kind): _OPT
       for kind in ("adam", "adamw", "adagrad", "lion", "lamb", "client")
       for dtype in ("fp32", "bf16")},
    ("clip_norm", "fp32", "sgd"): _CLIP,
}
