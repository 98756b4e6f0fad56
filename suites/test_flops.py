"""Flops profiler: for modules whose counts are known in closed form, DeepSpeed's flops profiler
MUST report the analytic FLOPs, MACs and parameter counts, standalone and inside the engine.

The convention is the profiler's own where it states one: a multiply-accumulate is one MAC and
two flops; adding a bias, or any elementwise add or multiply, is one flop per output element
(the profiler's convolution and ``addmm`` count the bias so); a parameter counts once however
often the forward uses it, its flops every time. Attention counts its two matmuls (Q K^T and the
weights times V), not the softmax or the scaling, as the profiler's
``scaled_dot_product_attention`` counter and the usual MFU accounting do. The formulas are in
this file, beside the cells.

- FLOPS-COUNT-1 (``test_model_profile``): ``deepspeed.profiling.flops_profiler
  .get_model_profile`` on each cell's module (a Linear with and without bias, torch.matmul,
  torch.bmm, a matmul that broadcasts its batch, a matrix-vector and a vector-vector matmul, a
  strided padded Conv2d with bias, ``F.scaled_dot_product_attention`` with different query and
  key lengths, a Linear used twice, broadcasting elementwise ops by function and by operator)
  MUST return the analytic flops, MACs and parameters, exactly.
- FLOPS-ENGINE-1 (``test_engine_profiler``): an engine whose config enables the profiler at
  ``profile_step`` k (ZeRO stages 0 and 3) MUST profile the forward of step k and no other (the
  profiler runs during that forward only, its report file appears with that step), and what it
  holds then (``get_total_flops``, ``get_total_macs``, ``get_total_params``) and what the
  engine's ``flops_profiler`` keeps after the step MUST be the model's analytic counts.
- FLOPS-MFU-1 (``test_matmul_mfu``, GPU): the profiler's count of an 8192^3 bf16 matmul MUST be
  the analytic one; the achieved TFLOPS that count gives over the measured time (3 rounds) is
  recorded, and the MFU (that over the GPU model's dense bf16 peak from the GPU catalogue, where
  it has one).

A miscount that is DeepSpeed's is a known upstream issue in ``dsconform/gate/known_issues.py``
(DS-8419-FLOPS-*, DS-3087-FLOPS-OPERATORS, DS-Z3-FLOPS-LINEAR-TWICE, and before 0.19.7
DS-8246-FLOPS-SDPA-WRAPPERS-PILE-UP and DS-8324-FLOPS-BROADCAST-FROM-FRONT), never a looser
check.

Upstream: https://www.deepspeed.ai/tutorials/flops-profiler/ ,
https://www.deepspeed.ai/docs/config-json/#flops-profiler ,
https://github.com/deepspeedai/DeepSpeed/blob/master/deepspeed/profiling/flops_profiler/profiler.py

Stable ids: FLOPS-COUNT-1, FLOPS-ENGINE-1, FLOPS-MFU-1; each case id (``cpu-linear_bias``,
``cuda-z3``) names its cell and does not change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pytest

from dsconform.suite import (
    ACCELERATORS,
    TFLOPS,
    accel_cell,
    gpu_peak_tflops,
    requires,
    run_ranks,
)
from suites import flops_ranks

CAPABILITY = "flops"
TIMEOUT_S = 300


def prod(*dims: int) -> int:
    return math.prod(dims)


@dataclass(frozen=True)
class Counts:
    flops: int
    macs: int
    params: int


def linear(batch: tuple[int, ...], n_in: int, n_out: int, bias: bool, uses: int = 1) -> Counts:
    """y = x W^T (+ b) over every leading position, ``uses`` times (n_in == n_out then)."""
    macs = prod(*batch) * n_in * n_out
    flops = 2 * macs + (prod(*batch) * n_out if bias else 0)
    return Counts(uses * flops, uses * macs, n_in * n_out + (n_out if bias else 0))


def matmul(a: tuple[int, ...], b: tuple[int, ...]) -> Counts:
    """torch.matmul's semantics: a 1-D operand is a row (a) or column (b) vector, the batch
    dimensions broadcast; one MAC per output element per contracted element. b is the
    parameter."""
    a2 = (1, *a) if len(a) == 1 else a
    b2 = (*b, 1) if len(b) == 1 else b
    batch = prod(*[max(x, y) for x, y in zip(
        (1,) * (len(b2) - len(a2)) + a2[:-2], (1,) * (len(a2) - len(b2)) + b2[:-2])])
    macs = batch * a2[-2] * a2[-1] * b2[-1]
    return Counts(2 * macs, macs, prod(*b))


def conv2d(x: tuple[int, int, int, int], c_out: int, kernel: int, stride: int,
           padding: int) -> Counts:
    n, c_in, h, w = x
    out_h = (h + 2 * padding - kernel) // stride + 1
    out_w = (w + 2 * padding - kernel) // stride + 1
    positions = n * out_h * out_w
    macs = positions * c_out * c_in * kernel * kernel
    return Counts(2 * macs + positions * c_out, macs, c_out * c_in * kernel * kernel + c_out)


def attention(q: tuple[int, ...], k: tuple[int, ...], v: tuple[int, ...]) -> Counts:
    """Q K^T (L x S scores of depth E) and the weights times V (L x Ev), per batch and head."""
    *heads, length, depth = q
    source = k[-2]
    macs = prod(*heads) * length * source * (depth + v[-1])
    return Counts(2 * macs, macs, 0)


def scale_shift(x: tuple[int, ...]) -> Counts:
    """x * w + b, w and b broadcast over the last dimension: one multiply and one add per
    element of the result."""
    return Counts(2 * prod(*x), 0, 2 * x[-1])


@dataclass(frozen=True)
class Cell:
    kind: str                         # flops_ranks.build's kind
    params: dict[str, Any]            # the module's constructor arguments
    shapes: list[tuple[int, ...]]     # the forward's inputs
    counts: Counts                    # the analytic counts


# Odd sizes, so a count that swaps or drops a dimension cannot land on the right number.
X = (3, 5, 13)
CELLS: dict[str, Cell] = {
    "linear": Cell("linear", {"n_in": 13, "n_out": 7, "bias": False}, [X],
                   linear(X[:-1], 13, 7, bias=False)),
    "linear_bias": Cell("linear", {"n_in": 13, "n_out": 7, "bias": True}, [X],
                        linear(X[:-1], 13, 7, bias=True)),
    "linear_twice": Cell("linear", {"n_in": 13, "n_out": 13, "bias": False, "uses": 2}, [X],
                         linear(X[:-1], 13, 13, bias=False, uses=2)),
    "matmul": Cell("matmul", {"shape": (13, 7), "op": "matmul"}, [X], matmul(X, (13, 7))),
    "bmm": Cell("matmul", {"shape": (3, 13, 7), "op": "bmm"}, [X], matmul(X, (3, 13, 7))),
    "matmul_broadcast": Cell("matmul", {"shape": (3, 13, 7), "op": "matmul"}, [(5, 13)],
                             matmul((5, 13), (3, 13, 7))),
    "matmul_vector": Cell("matmul", {"shape": (13,), "op": "matmul"}, [(5, 13)],
                          matmul((5, 13), (13,))),
    "dot": Cell("matmul", {"shape": (13,), "op": "matmul"}, [(13,)], matmul((13,), (13,))),
    "conv2d": Cell("conv", {"c_in": 3, "c_out": 4, "kernel": 3, "stride": 2, "padding": 1},
                   [(2, 3, 9, 11)], conv2d((2, 3, 9, 11), 4, 3, 2, 1)),
    "attention": Cell("attention", {}, [(2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 6)],
                      attention((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 6))),
    "scale_shift": Cell("scale_shift", {"width": 13, "operators": False}, [X], scale_shift(X)),
    "scale_shift_operators": Cell("scale_shift", {"width": 13, "operators": True}, [X],
                                  scale_shift(X)),
}


def count_problems(found: dict[str, int], expected: Counts, what: str) -> list[str]:
    """One line per count that is not the analytic one, with both values and their ratio."""
    problems = []
    for key in ("flops", "macs", "params"):
        want, got = getattr(expected, key), found.get(key)
        if got != want:
            ratio = f" ({got / want:.4g}x)" if got is not None and want else ""
            problems.append(f"{what}: {key} {got}, analytic {want}{ratio}")
    return problems


def run_cell(name: str, accelerator: str, scale: float = 1.0) -> list[str]:
    cell = CELLS[name]
    found = run_ranks(flops_ranks.profile_module, 1, timeout_s=TIMEOUT_S,
                      args=(cell.kind, cell.params, cell.shapes), kwargs={"scale": scale},
                      accelerator=accelerator)[0]
    return count_problems(found, cell.counts,
                          f"get_model_profile of {name} (inputs {cell.shapes})")


#: Cells left off CUDA: a Conv2d forward in a pooled CUDA rank that had run earlier tests
#: crashed the rank (SIGSEGV inside torch's conv) on 2xH200 (docs/findings.md#flops-profiler);
#: the count is shape arithmetic, the same on either accelerator, and runs on the CPU one.
NOT_ON_CUDA = frozenset({"conv2d"})


def _count_params() -> list:
    """Every cell on the CPU accelerator and on one GPU: each is one forward of a few hundred
    elements."""
    return [accel_cell(accel, name, id=name) for accel in ACCELERATORS for name in CELLS
            if not (accel == "cuda" and name in NOT_ON_CUDA)]


@pytest.mark.parametrize("accelerator, name", _count_params())
def test_model_profile(accelerator: str, name: str):
    """FLOPS-COUNT-1: get_model_profile MUST report the analytic flops, MACs and parameters."""
    problems = run_cell(name, accelerator)
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------------------------
# FLOPS-ENGINE-1: the engine's profiler, configured in the config
# ---------------------------------------------------------------------------------------------

ENGINE_DIMS = (13, 16, 7)
ENGINE_MICRO_BATCH = 3
PROFILE_STEP = 2
ENGINE_STEPS = 4


def engine_counts() -> Counts:
    n_in, hidden, n_out = ENGINE_DIMS
    a = linear((ENGINE_MICRO_BATCH,), n_in, hidden, bias=False)
    b = linear((ENGINE_MICRO_BATCH,), hidden, n_out, bias=False)
    return Counts(a.flops + b.flops, a.macs + b.macs, a.params + b.params)


def check_engine(result: dict[str, Any], stage: int) -> list[str]:
    """The step the engine profiled, and its counts, against the config and the formulas."""
    where = f"ZeRO stage {stage}, profile_step {PROFILE_STEP}"
    problems = []
    if result["stage"] != stage:
        problems.append(f"{where}: the engine runs ZeRO stage {result['stage']}")
    profiled = [t["global_step"] for t in result["trace"] if t["during"] is not None]
    if profiled != [PROFILE_STEP]:
        problems.append(f"{where}: the profiler ran during the forward of global steps "
                        f"{profiled}, expected [{PROFILE_STEP}] only")
    reported = [t["global_step"] for t in result["trace"] if t["report"]]
    if not reported or reported[0] != PROFILE_STEP:
        problems.append(f"{where}: the profiler's report file first appeared after step "
                        f"{reported[0] if reported else None}, expected {PROFILE_STEP}")
    expected = engine_counts()
    for t in result["trace"]:
        if t["global_step"] == PROFILE_STEP and t["during"] is not None:
            problems += count_problems(t["during"], expected,
                                       f"{where}: the profiler during step {PROFILE_STEP}")
            problems += count_problems(t["kept"], expected,
                                       f"{where}: engine.flops_profiler after the step")
    return problems


def run_engine(stage: int, accelerator: str, report: str, scale: float = 1.0) -> list[str]:
    result = run_ranks(flops_ranks.profile_engine, 1, timeout_s=TIMEOUT_S,
                       args=(stage, ENGINE_DIMS, ENGINE_MICRO_BATCH, PROFILE_STEP,
                             ENGINE_STEPS, report), kwargs={"scale": scale},
                       accelerator=accelerator)[0]
    return check_engine(result, stage)


def _engine_params() -> list:
    """ZeRO stages 0 and 3 on the CPU accelerator; on a GPU, stage 0 in the acceptance tier
    and stage 3 nightly."""
    return [accel_cell(accel, stage, id=f"z{stage}", slow=accel == "cuda" and stage == 3)
            for accel in ACCELERATORS for stage in (0, 3)]


@pytest.mark.parametrize("accelerator, stage", _engine_params())
def test_engine_profiler(accelerator: str, stage: int, scratch):
    """FLOPS-ENGINE-1: the engine MUST profile step profile_step with the analytic counts."""
    problems = run_engine(stage, accelerator, str(scratch / "flops.txt"))
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------------------------
# FLOPS-MFU-1: the suite's own MFU (GPU)
# ---------------------------------------------------------------------------------------------

MFU_SIZE = 8192
MFU_ITERS = 20


@pytest.mark.gpu
@pytest.mark.benchmark
@requires(min_gpus=1, bf16=True)
def test_matmul_mfu(metrics):
    """FLOPS-MFU-1: the profiler MUST count an 8192^3 matmul analytically; its TFLOPS and MFU
    are recorded."""
    res = run_ranks(flops_ranks.matmul_throughput, 1, timeout_s=TIMEOUT_S,
                    args=("bf16", MFU_SIZE, MFU_ITERS), accelerator="cuda")[0]
    expected = matmul((MFU_SIZE, MFU_SIZE), (MFU_SIZE, MFU_SIZE))
    problems = count_problems({**res, "params": expected.params}, expected,
                              f"get_model_profile of a {MFU_SIZE}^3 bf16 matmul")
    assert not problems, "\n".join(problems)
    where = {"m": MFU_SIZE, "n": MFU_SIZE, "k": MFU_SIZE, "dtype": "bf16", "iters": MFU_ITERS,
             "device": res["device"]}
    metrics.record_rate("flops.matmul.model_tflops", res["seconds"], amount=res["flops"],
                        unit="TFLOPS", scale=TFLOPS, **where)
    peak = gpu_peak_tflops(res["device"], "bf16")
    if peak is not None:
        metrics.record("flops.matmul.mfu", [100.0 * res["flops"] / s / TFLOPS / peak.value
                                            for s in res["seconds"]],
                       unit="%", better="higher", peak_tflops=peak.value,
                       peak_source=peak.source, **where)
