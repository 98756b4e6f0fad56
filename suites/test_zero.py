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
so an upgrade that moves one is named. Beside the matrix, the Adam-with-L2 cells
(``z2-off_opt-fp32-cpu_adam_l2-gas1-ws2``) train ZeRO-Offload's DeepSpeedCPUAdam in Adam mode
with weight decay 0.01, an L2 term of the gradient, against torch Adam(weight_decay=0.01), on
every offload placement.

Upstream: https://www.deepspeed.ai/tutorials/zero/ ,
https://www.deepspeed.ai/tutorials/zero-offload/ , https://www.deepspeed.ai/docs/config-json/ ,
https://deepspeed.readthedocs.io/en/latest/zero3.html#debugging (the safe_get_full_* APIs).

Stable ids: ZERO-EQ-1 (matrix), ZERO-EQ-2 (partition padding property), ZERO-DEF-1 (defaults),
ZERO-DEF-2 (dtypes the engine resolves),
ZERO-CLIP-1 (gradient clipping), ZERO-ACCUM-1 (accumulation by the caller);
each case id (``z3-off_opt-bf16-adam-gas4-ws2``) names its cell and does not change.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsconform.suite import (
    ACCELERATORS,
    ASSUMED_DEFAULTS,
    ASSUMED_RESOLVED,
    KNOWN_ISSUES,
    OPTIMIZER_OPS,
    Comparison,
    RankCall,
    ZeroCase,
    accel_cell,
    accel_params,
    batched,
    cell_results,
    clip_problems,
    compare_rank_results,
    compat,
    covering_cases,
    defaults_mismatches,
    one_rank_twins,
    record_zero_comparison,
    requires,
    run_ranks,
    run_state,
    tier_params,
    tolerance,
    train_zero_and_ddp,
    zero_check_name,
)
from suites.zero_ranks import l2_matrix, matrix, read_effective_defaults, read_resolved_dtypes

CAPABILITY = "zero"
# Per call. DeepSpeed's FusedAdam/CPU Adam JIT-build inside the first call that uses them
# (docs/findings.md#op-builds); everything else takes seconds.
TIMEOUT_S = 180
OP_TIMEOUT_S = 600


def in_cpu_tier(case: ZeroCase) -> bool:
    """The default CPU tier: every axis of the matrix at least once, in about 25 cases, so CI
    runs the zero suite in a few minutes on 2 cores. Everything else is marked ``slow`` on the
    CPU accelerator (it runs under ``-m slow`` and on GPU nodes, which run the whole matrix)."""
    c = case
    cell = (c.stage, c.offload, c.dtype, c.optimizer, c.grad_accum, c.world_size)
    if c.optimizer == "fused_adam":
        # Not promised by the cpu-ci profile, and its first use JIT-builds (findings#op-builds).
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
    least once (a pairwise covering array), plus every cell a known upstream issue of the
    installed DeepSpeed names (its strict xfail then shows the fix), plus one cell for every
    tolerance-table entry the matrix uses. The rest is the nightly tier."""
    here = compat.installed_deepspeed()
    known = [c for c in cases if any(ki.affects(here) and ki.covers(
        f"test_zero.py::test_zero_matches_ddp[cuda-{c.id}]") for ki in KNOWN_ISSUES)]
    # Among cells that cover as many new pairs, prefer the most ranks: the distributed paths
    # (partitioning, reduction) are what a node is accepted for.
    tier = covering_cases(cases, _axes, must=known,
                          first={"world_size": lambda ws: -1 if ws == "all" else -ws})
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


def one_rank_tier(cases: list[ZeroCase]) -> list[ZeroCase]:
    """The acceptance tier of a node with one GPU (``one_gpu_tier``): ``gpu_tier`` over the
    one-rank cells, so every pair of the other axes' values, every known-issue cell and every
    tolerance entry runs at one rank. ZeRO against DDP means as much there (the optimizer
    wrappers, offload, mixed precision, accumulation); the two-rank acceptance cells it stands
    for are left out on such a node (``covered_on_one_gpu``). What only two ranks show,
    partition padding across ranks, is ZERO-EQ-2."""
    return gpu_tier([c for c in cases if c.world_size == 1])


def _matrix_params(gpus: int) -> list:
    params = []
    for accel in ACCELERATORS:
        params += tier_params(accel, matrix(world_sizes=_world_sizes(accel, gpus)),
                              cpu_tier=in_cpu_tier, gpu_tier=gpu_tier,
                              one_rank_tier=lambda cases, tier: one_rank_tier(cases),
                              marks=_needs)
        params += _l2_params(accel, gpus)
    return params


def in_l2_tier(case: ZeroCase, accel: str) -> bool:
    """The Adam-with-L2 cells' tiers, apart from the matrix's: CPU one cell (ZeRO-2, optimizer
    offloaded, fp32, 2 ranks); GPUs every offload placement in fp32 at 1 and 2 ranks, and bf16
    and fp16 once each. The rest is nightly."""
    cell = (case.stage, case.offload, case.dtype, case.world_size)
    if accel == "cpu":
        return cell == (2, "opt", "fp32", 2)
    return (case.dtype == "fp32" and case.world_size in (1, 2)) or cell in {
        (3, "param+opt", "bf16", 2), (2, "opt", "fp16", 2)}


def _l2_one_gpu_role(case: ZeroCase, accel: str) -> str | None:
    """A node with one GPU runs the one-rank twin of every two-rank cell of the L2 tier in its
    place."""
    if accel != "cuda" or case.world_size not in (1, 2):
        return None
    if case.world_size == 1:
        return "tier" if in_l2_tier(case.with_(world_size=2), accel) else None
    return "covered" if in_l2_tier(case, accel) else None


def _l2_params(accel: str, gpus: int) -> list:
    return [accel_cell(accel, case, id=case.id, world_size=case.world_size, marks=_needs(case),
                       slow=not in_l2_tier(case, accel), one_gpu=_l2_one_gpu_role(case, accel))
            for case in l2_matrix(world_sizes=_world_sizes(accel, gpus))]


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
@requires(two_ranks="ZeRO pads each partition across ranks")
@given(width=WIDTHS, seed=st.integers(min_value=0, max_value=2**31 - 1),
       lr=st.floats(min_value=1e-3, max_value=0.2, allow_nan=False, allow_infinity=False))
def test_zero_partition_padding(accelerator: str, stage: int, width: int, seed: int, lr: float,
                                profile):
    """ZERO-EQ-2: fp32 SGD on 2 ranks MUST stay bit-exact with DDP for any width, seed and lr.

    Needs two ranks: partitions are padded only where a tensor is split across ranks, so a
    node with one GPU skips it (GPUs>=2)."""
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
    # The defaults of this release: older ones are held to what they had (compat's history).
    mismatches = defaults_mismatches(compat.assumed_defaults(ASSUMED_DEFAULTS), found)
    assert not mismatches, (
        f"DeepSpeed {deepspeed.__version__} changed defaults the suite assumes "
        f"(dsconform/checks/dsconfig.py ASSUMED_DEFAULTS); configs built by ds_config pin them, "
        f"user configs that omit them now train differently:\n  " + "\n  ".join(mismatches))


def resolved_mismatches(found: dict) -> list[str]:
    """ZERO-DEF-2's judgement: every pinned value of a dtype the accelerator runs."""
    skipped = tuple(f"{d}." for d in found.get("unsupported", ()))
    # as this release resolves them: an older one is held to what it had (compat's history)
    return defaults_mismatches({k: v for k, v in compat.assumed_defaults(ASSUMED_RESOLVED).items()
                                if not k.startswith(skipped)}, found)


@pytest.mark.anynode
def test_resolved_dtypes(facts):
    """ZERO-DEF-2: the communication and gradient accumulation dtypes DeepSpeed resolves inside
    the engine for configs that leave them out MUST be the ones the suite assumes."""
    found = run_ranks(read_resolved_dtypes, 1, timeout_s=TIMEOUT_S)[0]
    for key, value in sorted(found.items()):  # the radar shows a moved one as "default moved"
        facts.record(f"default.resolved.{key}", value)
    mismatches = resolved_mismatches(found)
    assert not mismatches, (
        "DeepSpeed resolves dtypes otherwise than the suite assumes (dsconform/checks/"
        "dsconfig.py ASSUMED_RESOLVED); configs that leave them out now reduce or accumulate "
        "gradients differently:\n  " + "\n  ".join(mismatches))


# ------------------------------------------------------------------ gradient clipping

#: Clips about half the steps of the suite's data: its global gradient norms run 0.31-0.57 over
#: the 20 steps (2 ranks, fp32 SGD); DeepSpeed's default 1.0 never clips there.
CLIP = 0.4


def clip_matrix(world_sizes: tuple[int, ...]) -> list[ZeroCase]:
    """Every stage and offload placement, fp32 and bf16, SGD (torch Adam where the optimizer
    is offloaded: DeepSpeed's CPU Adam), one accumulation step, with clipping on."""
    return [c.with_(clip=CLIP) for c in matrix(world_sizes=world_sizes)
            if c.grad_accum == 1 and c.dtype in ("fp32", "bf16")
            and c.optimizer == ("cpu_adam" if c.offload_optimizer else "sgd")]


#: The acceptance cells: one per stage, at two ranks (the norm across partitions) and, on a node
#: with one GPU, their one-rank twins.
CLIP_TIER = {(0, "none", "fp32"), (1, "opt", "bf16"), (2, "none", "bf16"), (3, "param+opt", "fp32")}
CLIP_CPU_TIER = {(0, "none", "fp32"), (2, "none", "fp32"), (3, "none", "fp32"), (2, "opt", "fp32")}


def _two_rank_tier_params(cases: list[ZeroCase], cell, gpu_tier: set, cpu_tier: set) -> list:
    """A check's cells: those whose ``cell(case)`` is in the accelerator's tier run at two
    ranks (on a node with one GPU, the GPU tier's one-rank twins in their place); the rest are
    nightly."""
    def two_ranks(c: ZeroCase, tier: set) -> bool:
        return c.world_size == 2 and cell(c) in tier

    return [p for accel in ACCELERATORS for p in tier_params(
        accel, cases, marks=_needs, cpu_tier=lambda c: two_ranks(c, cpu_tier),
        gpu_tier=lambda cs: [c for c in cs if two_ranks(c, gpu_tier)],
        one_rank_tier=lambda cs, tier: one_rank_twins(cs, tier, cell))]


def _clip_params() -> list:
    return _two_rank_tier_params(clip_matrix((1, 2)), lambda c: (c.stage, c.offload, c.dtype),
                                 CLIP_TIER, CLIP_CPU_TIER)


@pytest.mark.parametrize("accelerator, case", _clip_params())
@batched(_plan)
def test_zero_clipping_matches_ddp(accelerator: str, case: ZeroCase, profile, metrics, facts,
                                   request):
    """ZERO-CLIP-1: with gradient clipping on, ZeRO MUST clip by the global norm over every
    partition of every rank (offloaded ones too) as DDP's clip_grad_norm_ does over the full
    gradient: the same norm each step, and DDP's losses, gradients and parameters."""
    results = cell_results(request)
    cmp = compare_rank_results(results, tolerance("zero_clip", case.dtype, case.optimizer,
                                                  profile.tolerances, accelerator=accelerator),
                               label=f"{accelerator}-{case.id}")
    record_zero_comparison(metrics, cmp, case, accelerator)
    norm_tol = tolerance("zero_clip_norm", case.dtype, case.optimizer, profile.tolerances,
                         accelerator=accelerator)
    problems, clipped, worst = clip_problems(results, case, norm_tol.rtol)
    facts.record("zero.clipped_steps", clipped)
    metrics.record("zero.clip_norm_rel_diff", worst, unit="1", better="lower",
                   bound=norm_tol.rtol, **case.params(), accelerator=accelerator,
                   rtol=norm_tol.rtol)
    assert not problems, (f"{accelerator}-{case.id}: gradient clipping at {case.clip:g} "
                          f"({clipped} of {case.steps} steps clip):\n  " + "\n  ".join(problems)
                          + f"\n  tolerance: {norm_tol}")
    cmp.assert_ok()


# ------------------------------------------------------------------ manual accumulation

def manual_matrix(world_sizes: tuple[int, ...]) -> list[ZeroCase]:
    """Every ZeRO stage and optimizer placement (1-3; parameters stay on the device), fp32 SGD,
    4 micro-batches accumulated by the caller on an engine configured for 1."""
    return [c.with_(manual_accum=True) for c in matrix(world_sizes=world_sizes)
            if c.stage > 0 and not c.offload_param and c.grad_accum == 4
            and c.dtype == "fp32" and c.optimizer == "sgd"]


#: The acceptance cells at two ranks (on a node with one GPU, their one-rank twins); the CPU
#: tier runs every placement of stages 1 and 2, where the optimizer's host copy is filled.
MANUAL_TIER = {(1, "opt"), (2, "opt"), (3, "none")}
MANUAL_CPU_TIER = {(1, "opt"), (2, "none"), (2, "opt"), (3, "opt")}


def _manual_params() -> list:
    return _two_rank_tier_params(manual_matrix((1, 2)), lambda c: (c.stage, c.offload),
                                 MANUAL_TIER, MANUAL_CPU_TIER)


@pytest.mark.parametrize("accelerator, case", _manual_params())
@batched(_plan)
def test_manual_accumulation_matches_ddp(accelerator: str, case: ZeroCase, profile, metrics,
                                         request):
    """ZERO-ACCUM-1: gradients accumulated by the caller (engine.set_gradient_accumulation_
    boundary(False) before every backward but the last of a step, one engine.step(), on an
    engine configured with gradient_accumulation_steps 1) MUST sum every backward of the step,
    on every stage and optimizer placement: DDP's losses, boundary gradients and parameters."""
    cmp = compare_case(cell_results(request), case, accelerator, profile)
    record_zero_comparison(metrics, cmp, case, accelerator)
    cmp.assert_ok()
