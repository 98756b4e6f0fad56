"""ZeRO equivalence: ZeRO MUST train the same model torch DDP trains.

From the same initial weights, the same per-rank data and the same optimizer settings, 20 steps of
the DeepSpeed engine (ZeRO stages 0-3, ZeRO-Offload of the optimizer on stages 1-3 and of the
parameters on stage 3; fp32, bf16, fp16; SGD, torch Adam, DeepSpeed's FusedAdam or CPU Adam;
gradient accumulation 1 and 4; 1, 2 and every GPU) MUST give the losses of every step, the
gradients at every accumulation boundary (``deepspeed.utils.safe_get_full_grad`` before
``engine.step()``) and the final parameters (``safe_get_full_fp32_param``, else
``deepspeed.zero.GatheredParameters``) that torch DDP gives, within
``dsconform/checks/tolerances.py``;
fp32 SGD bit for bit; bf16 and fp16 also the whole update (final minus initial parameters, as
one vector) within a norm-relative bound and with a gain within 1% of DDP's. The semantics are
pinned by ``dsconform.checks.dsconfig.ds_config`` (gradient_clipping 0, Adam not AdamW, no weight
decay, static fp16 loss scale), and DeepSpeed's own defaults MUST be the ones the suite assumes,
so an upgrade that moves one is named.

Upstream: https://www.deepspeed.ai/tutorials/zero/ ,
https://www.deepspeed.ai/tutorials/zero-offload/ , https://www.deepspeed.ai/docs/config-json/ ,
https://deepspeed.readthedocs.io/en/latest/zero3.html#debugging (the safe_get_full_* APIs).

Stable ids: ZERO-EQ-1 (matrix), ZERO-EQ-2 (partition padding property), ZERO-DEF-1 (defaults);
each case id (``z3-off_opt-bf16-adam-gas4-ws2``) names its cell and does not change.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsconform.suite import (
    ACCELERATORS,
    ASSUMED_DEFAULTS,
    KNOWN_ISSUES,
    OPTIMIZER_OPS,
    Comparison,
    RankCall,
    ZeroCase,
    accel_cell,
    accel_params,
    batched,
    cell_results,
    compare_rank_results,
    defaults_mismatches,
    pairwise,
    record_zero_comparison,
    requires,
    run_ranks,
    run_state,
    tolerance,
    train_zero_and_ddp,
    zero_check_name,
)
from suites.zero_ranks import matrix, read_effective_defaults

CAPABILITY = "zero"
# Per call. DeepSpeed's FusedAdam/CPU Adam JIT-build inside the first call that uses them
# (42 s each on 2 cores, docs/findings.md#op-builds); everything else takes seconds.
TIMEOUT_S = 180
OP_TIMEOUT_S = 600


def in_cpu_tier(case: ZeroCase) -> bool:
    """The default CPU tier: every axis of the matrix at least once, in about 25 cases, so CI
    runs the zero suite in a few minutes on 2 cores. Everything else is marked ``slow`` on the
    CPU accelerator (it runs under ``-m slow`` and on GPU nodes, which run the whole matrix)."""
    c = case
    cell = (c.stage, c.offload, c.dtype, c.optimizer, c.grad_accum, c.world_size)
    if c.optimizer == "fused_adam":
        # Not promised by the cpu-ci profile, and its first use JIT-builds for 42 s.
        return False
    if c.optimizer == "cpu_adam":
        # cpu-ci promises cpu_adam (the ops suite builds it into the shared cache): one cell.
        return cell == (2, "opt", "fp32", "cpu_adam", 1, 2)
    if c.world_size == 1:
        # One rank has nothing to partition or reduce; two spot checks of the degenerate case.
        return cell in {(3, "none", "fp32", "sgd", 1, 1), (0, "none", "bf16", "adam", 4, 1)}
    if c.dtype == "fp32" and c.optimizer == "sgd":
        # The bit-exact reference: every stage and offload placement, accumulation per stage.
        return c.grad_accum == 1 or c.offload == "none"
    if c.dtype == "bf16" and c.optimizer == "sgd":
        return c.grad_accum == 1 and c.offload == "none"
    if c.dtype == "fp16":
        # Skips on CPUs without mkldnn fp16; one cell where it can run.
        return cell == (2, "none", "fp16", "sgd", 1, 2)
    # torch Adam: fp32 with parameters offloaded, bf16 on stage 0 (its own optimizer wrapper)
    # and stage 2, and accumulation once.
    return cell in {(3, "param+opt", "fp32", "adam", 1, 2), (0, "none", "bf16", "adam", 1, 2),
                    (2, "none", "bf16", "adam", 1, 2), (1, "opt", "bf16", "adam", 4, 2)}


def _needs(case: ZeroCase) -> list:
    marks = []
    if case.dtype in ("bf16", "fp16"):
        marks.append(requires(**{case.dtype: True}))
    if OPTIMIZER_OPS[case.optimizer]:
        marks.append(requires(op=OPTIMIZER_OPS[case.optimizer]))
    return marks


# The axes of the matrix as the acceptance tier sees them. DeepSpeed's own Adam is one value,
# "ds_adam": FusedAdam on the device, DeepSpeedCPUAdam when the optimizer is offloaded (DeepSpeed
# picks one or the other), so every cell of the product is a real cell once offload is valid.
def _axes(case: ZeroCase) -> dict:
    kind = "ds_adam" if OPTIMIZER_OPS[case.optimizer] else case.optimizer
    return {"stage": case.stage, "offload": case.offload, "dtype": case.dtype, "optimizer": kind,
            "grad_accum": case.grad_accum, "world_size": case.world_size}


def gpu_tier(cases: list[ZeroCase]) -> list[ZeroCase]:
    """The acceptance tier of the GPU matrix (``pytest -m gpu``): every pair of axis values at
    least once (a pairwise covering array), plus every cell a known upstream issue names, plus
    one cell for every tolerance-table entry the matrix uses. The rest is the nightly tier."""
    by_axes = {tuple(_axes(c).items()): c for c in cases}
    axes: dict = {}
    for c in cases:
        for k, v in _axes(c).items():
            axes.setdefault(k, [])
            if v not in axes[k]:
                axes[k].append(v)
    # Among cells that cover as many new pairs, prefer the most ranks: the distributed paths
    # (partitioning, reduction) are what a node is accepted for.
    axes["world_size"].sort(key=lambda ws: -1 if ws == "all" else -ws)
    known = [c for c in cases if any(ki.covers(f"test_zero.py::test_zero_matches_ddp[cuda-{c.id}]")
                                     for ki in KNOWN_ISSUES)]
    chosen = pairwise(axes, valid=lambda cell: tuple(cell.items()) in by_axes,
                      must=[_axes(c) for c in known])
    tier = [by_axes[tuple(cell.items())] for cell in chosen]
    for c in cases:  # one representative of every tolerance entry the matrix reaches
        key = (zero_check_name(c), c.dtype, c.optimizer)
        if not any((zero_check_name(t), t.dtype, t.optimizer) == key for t in tier):
            tier.append(c)
    return tier


def _world_sizes(accel: str, gpus: int) -> tuple:
    """CPU: 1 and 2 ranks. GPUs: 1, 2 and every GPU, where "every GPU" is a cell of its own only
    on nodes with more than 2 (elsewhere it would only skip: the ws2 cell covers it)."""
    if accel == "cpu":
        return (1, 2)
    return (1, 2, "all") if gpus > 2 else (1, 2)


def _matrix_params(gpus: int) -> list:
    params = []
    for accel in ACCELERATORS:
        cases = matrix(world_sizes=_world_sizes(accel, gpus))
        tier = set(map(id, gpu_tier(cases))) if accel == "cuda" else set()
        for case in cases:
            in_tier = in_cpu_tier(case) if accel == "cpu" else id(case) in tier
            params.append(accel_cell(accel, case, id=case.id, world_size=case.world_size,
                                     marks=_needs(case), slow=not in_tier))
    return params


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.definition.name == "test_zero_matches_ddp":
        gpus = run_state(metafunc.config).node.gpu_count
        metafunc.parametrize("accelerator, case", _matrix_params(gpus))


def _resolve(case: ZeroCase, node) -> ZeroCase:
    if case.world_size != "all":
        return case
    return case.with_(world_size=node.gpu_count)


def case_call(case: ZeroCase, accelerator: str) -> RankCall:
    """The rank call of one cell: ZeRO and DDP trained side by side on the ranks."""
    return RankCall(train_zero_and_ddp, case.world_size,
                    OP_TIMEOUT_S if OPTIMIZER_OPS[case.optimizer] else TIMEOUT_S, args=(case,),
                    accelerator=accelerator)


def compare_case(results: list, case: ZeroCase, accelerator: str, profile) -> Comparison:
    """The ranks' ZeRO and DDP traces compared under the table's tolerance."""
    tol = tolerance(zero_check_name(case), case.dtype, case.optimizer, profile.tolerances,
                    accelerator=accelerator)
    return compare_rank_results(results, tol, label=f"{accelerator}-{case.id}")


def run_case(case: ZeroCase, accelerator: str, profile) -> Comparison:
    """Train ZeRO and DDP side by side on the ranks; compare under the table's tolerance."""
    call = case_call(case, accelerator)
    results = run_ranks(call.fn, call.world_size, args=call.args, accelerator=accelerator,
                        timeout_s=call.timeout_s)
    return compare_case(results, case, accelerator, profile)


def _plan(params: dict, workdir, run) -> RankCall:
    return case_call(_resolve(params["case"], run.node), params["accelerator"])


@batched(_plan)  # the cells run at once where lanes are on (dsconform.plugin.batch)
def test_zero_matches_ddp(accelerator: str, case: ZeroCase, node, profile, metrics, request):
    """ZERO-EQ-1: ZeRO MUST give DDP's per-step losses, boundary gradients and final parameters."""
    case = _resolve(case, node)
    cmp = compare_case(cell_results(request), case, accelerator, profile)
    record_zero_comparison(metrics, cmp, case, accelerator)
    cmp.assert_ok()


# Widths around and at awkward sizes: 53 (prime) and 1 force padding of every ZeRO partition on
# two ranks; 64 divides evenly, as a control.
WIDTHS = st.one_of(st.sampled_from([1, 53, 64]), st.integers(min_value=2, max_value=97))


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("accelerator", accel_params(2))
@given(width=WIDTHS, seed=st.integers(min_value=0, max_value=2**31 - 1),
       lr=st.floats(min_value=1e-3, max_value=0.2, allow_nan=False, allow_infinity=False))
def test_zero_partition_padding(accelerator: str, stage: int, width: int, seed: int, lr: float,
                                profile):
    """ZERO-EQ-2: fp32 SGD on 2 ranks MUST stay bit-exact with DDP for any width, seed and lr."""
    # Drawn here, in the parent: every rank gets the same example.
    case = ZeroCase(stage=stage, dtype="fp32", optimizer="sgd", grad_accum=1, world_size=2,
                    width=width, seed=seed, lr=lr, steps=5)
    run_case(case, accelerator, profile).assert_ok()


@pytest.mark.anynode  # on a GPU node it joins `-m gpu`: the upgrade comparison diffs its facts
def test_effective_defaults(facts):
    """ZERO-DEF-1: DeepSpeed's effective defaults MUST equal the ones the suite assumes."""
    import deepspeed

    found = run_ranks(read_effective_defaults, 1, timeout_s=TIMEOUT_S)[0]
    # Every default found, recorded before the check: `dsconform compare` then names a default
    # that moved between two runs (an upgrade), also one the suite does not assume.
    for key, value in sorted(found.items()):
        facts.record(f"default.{key}", value)
    mismatches = defaults_mismatches(ASSUMED_DEFAULTS, found)
    assert not mismatches, (
        f"DeepSpeed {deepspeed.__version__} changed defaults the suite assumes "
        f"(dsconform/checks/dsconfig.py ASSUMED_DEFAULTS); configs built by ds_config pin them, "
        f"user configs that omit them now train differently:\n  " + "\n  ".join(mismatches))
