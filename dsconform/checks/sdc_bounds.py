"""The SDC suite's bounds against its CPU float64 reference (SDC-REF-1), entered into the one
tolerance table by dsconform/checks/tolerances.py as ("sdc_reference", dtype, kernel).

Every kernel's inputs are N(0, 1), generated on the CPU from fixed seeds and, for bf16 / fp16,
rounded to the dtype before the reference sees them: the reference differs from the GPU only
by the GPU's accumulation and its output's rounding. A bound is ``atol * scale + rtol *
|reference|`` per sampled element, ``scale`` the output's natural size: sqrt(K) for a GEMM
(the standard deviation of a sum of K products of N(0, 1)), sqrt(n) for a sum of n, 1 for the
elementwise chain, the largest element of the reference update for the training step.

These bounds are derived from the formats, not yet measured on GPUs: replace each ``why`` with
the worst value an H200 node measured (the suite records the share of its bound each kernel
used as ``sdc.reference.bound_used``). What they MUST tell apart: a flipped exponent or sign
bit moves an element by at least its own size (over a standard deviation of the output, far
outside every atol); a flipped low mantissa bit stays inside, and is found by the hashes only
(SDC-REPEAT-1, SDC-PEER-1, SDC-CAT-1).
"""

from __future__ import annotations

_DERIVED = "derived from the formats, not yet measured on GPUs"
#: (dtype, kernel) -> (rtol, atol, why)
SDC_BOUNDS: dict[tuple[str, str], tuple[float, float, str]] = {
    ("bf16", "gemm"): (4e-3, 1e-3,
                       f"bf16 GEMM, fp32 accumulation (reduced-precision reduction off): the "
                       f"output's rounding to bf16 is at most half an ulp, 2**-9 = 2.0e-3 "
                       f"relative, so rtol one ulp (3.9e-3); the accumulation's error is ~1e-6 "
                       f"of sqrt(K), atol 1e-3 of sqrt(K) for the elements near zero "
                       f"({_DERIVED})"),
    ("fp16", "gemm"): (1e-3, 1e-3,
                       f"fp16 GEMM, fp32 accumulation (reduced-precision reduction off): the "
                       f"output's rounding is at most 2**-11 = 4.9e-4 relative, rtol one ulp; "
                       f"atol as bf16 ({_DERIVED})"),
    ("fp32", "gemm"): (1e-6, 1e-5,
                       f"fp32 GEMM with TF32 off: fp32 accumulation of K products in tile "
                       f"order, ~1e-7 of sqrt(K) per element (eps 1.2e-7), worst of the "
                       f"sampled elements a few times that; 10x headroom ({_DERIVED})"),
    ("tf32", "gemm"): (0.0, 1e-2,
                       f"TF32 GEMM: the inputs are rounded to a 10-bit mantissa (2**-11 "
                       f"relative each, unknown to the float64 reference), so a product is off "
                       f"by up to 2**-10 and a sum of K by ~7e-4 of sqrt(K) (one standard "
                       f"deviation); the worst of ~1e5 sampled elements about 5 of them, 3.6e-3; "
                       f"2.8x headroom ({_DERIVED})"),
    ("fp32", "reduce"): (1e-6, 1e-4,
                         f"fp32 sum of n N(0, 1) values in a tree: at most log2(n) x eps x "
                         f"sum|x| = 3.7e-5 of sqrt(n) for n = 4096, usually far less "
                         f"({_DERIVED})"),
    ("fp32", "elementwise"): (0.0, 1e-6,
                              f"tanh(x) * exp(-x^2 / 2) + sin(3x) / 4 in fp32, values under "
                              f"1.3: CUDA's tanhf, expf, sinf are within 2 ulps each, the chain "
                              f"within ~8 ulps of 1 (9.5e-7) ({_DERIVED})"),
    ("fp32", "train"): (0.0, 1e-3,
                        f"one SGD step of a 256-1024-256 MLP in fp32 (TF32 off): each weight's "
                        f"change against float64's, in units of the largest change; fp32 "
                        f"GEMMs of K <= 1024 and the weight's own rounding stay near 1e-5 of "
                        f"it ({_DERIVED})"),
}
#: The tolerance table's entries: ("sdc_reference", dtype, kernel) -> (rtol, atol, why).
ENTRIES = {("sdc_reference", *k): v for k, v in SDC_BOUNDS.items()}
