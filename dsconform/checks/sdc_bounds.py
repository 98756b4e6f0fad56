"""The SDC suite's bounds against its CPU float64 reference (SDC-REF-1), entered into the one
tolerance table by dsconform/checks/tolerances.py as ("sdc_reference", dtype, kernel).

Every kernel's inputs are N(0, 1), generated on the CPU from fixed seeds and, for bf16 / fp16,
rounded to the dtype before the reference sees them: the reference differs from the GPU only
by the GPU's accumulation and its output's rounding. A bound is ``atol * scale + rtol *
|reference|`` per sampled element, ``scale`` the output's natural size: sqrt(K) for a GEMM
(the standard deviation of a sum of K products of N(0, 1)), sqrt(n) for a sum of n, 1 for the
elementwise chain, the largest element of the reference update for the training step. The
suite records the share of its bound each kernel used (``sdc.reference.bound_used``).

What the bounds MUST tell apart: a flipped exponent or sign bit moves an element by at least
its own size (over a standard deviation of the output, far outside every atol); a flipped low
mantissa bit stays inside, and is found by the hashes only (SDC-REPEAT-1, SDC-PEER-1,
SDC-CAT-1). The measurements: docs/sdc.md#measured-on-1xh200.
"""

from __future__ import annotations

_H200 = ("1xH200, torch 2.11.0+cu130, cuBLAS 13.1.0, 32 sampled rows of 4096^3 and 8192^3, "
         "2026-12-04, docs/sdc.md#measured-on-1xh200")
_H200_OTHER = ("1xH200, torch 2.11.0+cu130, 4096 x 4096 inputs of another seed, 2026-12-04, "
               "docs/sdc.md#measured-on-1xh200")
#: (dtype, kernel) -> (rtol, atol, why)
SDC_BOUNDS: dict[tuple[str, str], tuple[float, float, str]] = {
    ("bf16", "gemm"): (8e-3, 1e-3,
                       f"bf16 GEMM, fp32 accumulation (reduced-precision reduction off): the "
                       f"output's rounding to bf16 is up to 2**-8 = 3.9e-3 relative, rtol twice "
                       f"that; worst |GPU - float64| 0.0146 x sqrt(K), all of it that rounding, "
                       f"and the elements near zero far inside atol ({_H200})"),
    ("fp16", "gemm"): (1e-3, 1e-3,
                       f"fp16 GEMM, fp32 accumulation (reduced-precision reduction off): the "
                       f"output's rounding is up to 2**-11 = 4.9e-4 relative, rtol twice that; "
                       f"worst |GPU - float64| 1.9e-3 x sqrt(K), the rounding ({_H200})"),
    ("fp32", "gemm"): (0.0, 1e-4,
                       f"fp32 GEMM with TF32 off: worst |GPU - float64| 1.07e-5 x sqrt(K) at "
                       f"4096, 1.78e-5 at 8192 ({_H200}); 5.6x headroom"),
    ("tf32", "gemm"): (0.0, 1e-2,
                       f"TF32 GEMM: the inputs are rounded to a 10-bit mantissa (unknown to the "
                       f"float64 reference): worst |GPU - float64| 1.41e-3 x sqrt(K) at 4096, "
                       f"1.50e-3 at 8192 ({_H200}); 6.7x headroom"),
    ("fp32", "reduce"): (0.0, 1e-5,
                         f"fp32 row sums of 4096 N(0, 1) values: worst |GPU - float64| 5.1e-7 x "
                         f"sqrt(n) ({_H200_OTHER}); 20x headroom"),
    ("fp32", "elementwise"): (0.0, 1e-6,
                              f"tanh(x) * exp(-x^2 / 2) + sin(3x) / 4 in fp32, values under "
                              f"1.3: worst |GPU - float64| 1.8e-7 ({_H200_OTHER}); 5.7x "
                              f"headroom"),
    ("fp32", "train"): (0.0, 2e-4,
                        f"one SGD step of a 256-1024-256 MLP in fp32 (TF32 off), each weight "
                        f"against float64's in units of the largest change: worst 2.0e-5 "
                        f"({_H200_OTHER}); 10x headroom"),
}

#: The tolerance table's entries: ("sdc_reference", dtype, kernel) -> (rtol, atol, why).
ENTRIES = {("sdc_reference", *k): v for k, v in SDC_BOUNDS.items()}
