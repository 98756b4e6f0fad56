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

# Muon: its Newton-Schulz iteration runs in 16 bits where the accelerator has them (DeepSpeed's
# default "gram" method in fp16; "standard" in bf16; fp32 where neither: this CPU machine), the
# written-out rule in float64. Worst per-step error of the orthogonalised update (x its shape
# scale) against float64 over 50 random gradients of the suite's shapes (53x13, 7x53): fp16
# 6.5e-3, bf16 5.9e-2, fp32 1.5e-6; a coefficient a = 3.0 (for 3.4445) 0.34. Times lr 0.02 over
# 6 steps the parameters take at most 7.8e-4 from fp16.
_MUON = (1e-5, 2e-3,
         f"Newton-Schulz in fp16 (DeepSpeed's default on GPUs) against the float64 rule: at most "
         f"7.8e-4 over 6 steps at lr 0.02 from a worst per-step update error of 6.5e-3 "
         f"(docs/suites.md, Optimizers); measured 2.3e-7 where it runs in fp32 ({_CPU}, "
         f"ZeRO-2 offloaded); a wrong coefficient (a = 3.0) is off by 6.7e-3 at the first step and "
         f"grows, a dropped momentum by more at the second")

ENTRIES: dict[tuple[str, str, str], tuple[float, float, str]] = {
    **{("optimizer", dtype, kind): _OPT
       for kind in ("adam", "adamw", "adagrad", "lion", "lamb", "client")
       for dtype in ("fp32", "bf16")},
    **{("optimizer", dtype, "muon"): _MUON for dtype in ("fp32", "bf16")},
    ("clip_norm", "fp32", "sgd"): _CLIP,
}
