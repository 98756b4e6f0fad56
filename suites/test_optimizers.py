"""Optimizers: every optimizer DeepSpeed builds from the config's ``"optimizer"`` section, and a
client torch optimizer, MUST apply its published update rule to the gradient it is given, with
each parameter group's own lr and weight decay, under every ZeRO stage and offload placement.

The kinds, the class DeepSpeed MUST build for each (on the device / with ZeRO-Offload) and the
reference each is held to (suites/optimizer_rules.py):

- ``adam`` (``"type": "Adam"``, ``adam_w_mode`` false: weight decay as an L2 term of the
  gradient): FusedAdam / DeepSpeedCPUAdam, against torch ``Adam``;
- ``adamw`` (``"type": "AdamW"``): FusedAdam / DeepSpeedCPUAdam, against torch ``AdamW``;
- ``adagrad``: torch Adagrad / DeepSpeedCPUAdagrad, against torch ``Adagrad``;
- ``lion``: FusedLion (GPUs only) / DeepSpeedCPULion, against Lion written out (Chen et al.
  2023, Algorithm 2);
- ``lamb``: FusedLamb (GPUs only; no host LAMB, so no offload), against LAMB written out (You et
  al. 2020) in FusedLamb's form (bias corrections folded into the step size) with its
  trust-ratio clamp;
- ``muon``: MuonWithAuxAdam (Muon on the 2-D weights, its AdamW on the biases; the AdamW a
  FusedAdam / DeepSpeedCPUAdam), against Muon written out (Keller Jordan 2024: Nesterov
  momentum, Newton-Schulz 5 with (3.4445, -4.7750, 2.0315), the shape scale) and AdamW;
- ``client``: a torch ``RAdam`` handed to ``deepspeed.initialize(optimizer=...)``, against
  torch ``RAdam`` itself.

Each cell trains a small MLP whose parameters sit in three groups (lr x1 / x0.5 / x2, weight
decay 0.1 / 0 / 0.01) for 6 steps, ZeRO 0-3, with the optimizer offloaded (1-3) and the
parameters too (3), fp32 and bf16, 1 and 4 micro-batches per step, 1 and 2 ranks. The reference
steps fp32 copies of the engine's initial fp32 parameters with the gradient DeepSpeed's optimizer
received (``safe_get_full_grad`` at the accumulation boundary), so the comparison holds the
update rule alone: ZeRO's gradients against DDP's are ZERO-EQ-1's.

- OPT-RULE-1 (``test_optimizer_follows_its_rule``): DeepSpeed MUST build the documented class
  for the kind and placement, and after EVERY step every parameter (``safe_get_full_fp32_param``)
  MUST equal the reference's within ``dsconform/checks/tolerances.py`` "optimizer"; after the
  last step every optimizer state tensor (``safe_get_full_optimizer_state``: Adam's moments,
  Adagrad's sum, Lion's momentum) MUST equal the reference's (Muon: the parameters only).
- OPT-RESUME-1 (``test_resume_keeps_the_trajectory``): a checkpoint saved after step 3 and loaded
  into a fresh engine (other initial weights) MUST continue on the reference's trajectory, step
  for step, and end with its optimizer state.
- OPT-MUON-1 (``test_plain_muon_follows_its_rule``): the plainest Muon use, a model of matrices
  only handed over as ``model.parameters()`` (no groups, so every release with Muon runs it),
  MUST follow Muon's rule at every ZeRO stage, stage 0 (the default) included.

Upstream: https://www.deepspeed.ai/docs/config-json/#optimizer-parameters ,
https://deepspeed.readthedocs.io/en/latest/optimizers.html ,
https://deepspeed.readthedocs.io/en/latest/zero3.html#debugging (the safe_get_full_* APIs).

Stable ids: OPT-RULE-1, OPT-RESUME-1, OPT-MUON-1; each case id (``adamw-z2-opt-bf16-gas4-ws2``)
names its cell and does not change.
"""

from __future__ import annotations

import pytest

from dsconform.suite import (
    ACCELERATORS,
    Comparison,
    RankCall,
    accel_cell,
    batched,
    cell_results,
    compare_states,
    covering_cases,
    one_rank_twins,
    requires,
    run_ranks,
    tier_params,
    tolerance,
)
from suites.optimizer_ranks import CUDA_ONLY_ON_DEVICE, OptCase, matrix, train_optimizer

CAPABILITY = "optimizers"
# Per call. A DeepSpeed optimizer op JIT-builds inside the first call that uses it (about 45 s
# on 2 cores, docs/findings.md#op-builds); a built one takes seconds.
TIMEOUT_S = 600


def runs_on(case: OptCase, accelerator: str) -> bool:
    """FusedLion and FusedLamb are CUDA kernels only: the CPU accelerator builds neither."""
    return accelerator == "cuda" or case.offloaded or case.kind not in CUDA_ONLY_ON_DEVICE


# The CPU tier: every kind the CPU accelerator builds, every stage and placement at least once,
# bf16 and 4 micro-batches at least once each, on 2 ranks; only ops the CI profile promises
# (cpu_adam) or that need none, plus one CPU Lion cell (its reference is the written-out rule,
# which nothing else exercises on CPU). The rest is nightly (slow).
CPU_TIER = {
    ("adamw", 2, "opt", "fp32", 1), ("adam", 3, "param+opt", "bf16", 4),
    ("adam", 1, "opt", "bf16", 1), ("adagrad", 0, "none", "fp32", 4),
    ("adagrad", 2, "none", "bf16", 1), ("client", 3, "none", "fp32", 4),
    ("client", 1, "opt", "bf16", 1), ("lion", 2, "opt", "fp32", 1),
    # Muon (DeepSpeed compiles its update with torch.compile: minutes on 2 cores, once): every
    # pair of stage, dtype and accumulation, both placements, with the optimizer offloaded (on
    # the device its AdamW is FusedAdam: nightly); ZeRO-3 bf16 is a known issue.
    ("muon", 2, "opt", "fp32", 1), ("muon", 1, "opt", "bf16", 4),
    ("muon", 3, "param+opt", "bf16", 1), ("muon", 3, "opt", "fp32", 4),
    ("muon", 1, "opt", "fp32", 1), ("muon", 2, "opt", "bf16", 4),
}


def _key(case: OptCase) -> tuple:
    return (case.kind, case.stage, case.offload, case.dtype, case.grad_accum)


def _axes(case: OptCase) -> dict:
    return {"kind": case.kind, "stage": case.stage, "offload": case.offload,
            "dtype": case.dtype, "grad_accum": case.grad_accum}


# LAMB (FusedLamb, a CUDA kernel) and Muon on GPUs (Newton-Schulz in fp16) run nightly: each
# of their GPU cells is many seconds of op build or compile on a fresh node.
NIGHTLY_ONLY = ("lamb", "muon")
# The ops a GPU acceptance run builds (fused_adam, cpu_adam; None: torch's own optimizer): the
# cells of other ops (Adagrad and Lion on the host, FusedLion) are nightly on GPUs, so that an
# acceptance run on a fresh node builds no op for them (a run builds the ops its tests load).
GPU_ACCEPTANCE_OPS = (None, "fused_adam", "cpu_adam")
# The covering array above is the GPU acceptance tier (its cells measured on an H200 against
# the table's bounds, docs/suites.md); the other GPU cells run nightly.
GPU_ACCEPTANCE = True


def stage0_bf16(case: OptCase) -> bool:
    """Stage 0's bf16 wrapper steps the optimizer at initialisation (known issue
    DS-5104-Z0-WRAPPER-INIT-STEP): those cells are nightly, the acceptance tier covers every
    other pair."""
    return case.stage == 0 and case.dtype == "bf16"


def gpu_tier(cases: list[OptCase]) -> list[OptCase]:
    """The acceptance tier on GPUs: every pair of (kind, stage, offload, dtype, accumulation)
    values at least once, at two ranks (a pairwise covering array over the valid cells)."""
    two = [c for c in cases if c.world_size == 2 and c.kind not in NIGHTLY_ONLY
           and c.op() in GPU_ACCEPTANCE_OPS and not stage0_bf16(c)]
    return covering_cases(two, _axes)


def _needs(case: OptCase) -> list:
    marks = [requires(bf16=True)] if case.dtype == "bf16" else []
    if case.op():
        marks.append(requires(op=case.op()))
    return marks


def _params() -> list:
    """The CPU tier; on GPUs the covering array once GPU_ACCEPTANCE is set, and on a node with
    one GPU the one-rank twin of each of its cells instead (the update rule needs no second
    rank)."""
    cases = matrix(world_sizes=(1, 2))
    params = []
    for accel in ACCELERATORS:
        params += tier_params(
            accel, [c for c in cases if runs_on(c, accel)],
            cpu_tier=lambda c: c.world_size == 2 and _key(c) in CPU_TIER,
            gpu_tier=lambda cs: gpu_tier(cs) if GPU_ACCEPTANCE else [],
            one_rank_tier=lambda cs, tier: one_rank_twins(cs, tier, _key), marks=_needs)
    return params


def _plan(params: dict, workdir, run) -> RankCall:
    case = params["case"]
    return RankCall(train_optimizer, case.world_size, TIMEOUT_S, args=(case,),
                    accelerator=params["accelerator"])


def judge(results: list[dict], case: OptCase, accelerator: str, profile=None) -> Comparison:
    """OPT-RULE-1 / OPT-RESUME-1's judgement of every rank's trace: the class built, the
    parameters after every step and the optimizer state after the last, against the
    reference, under the table's "optimizer" tolerance."""
    tol = tolerance("optimizer", case.dtype, case.kind,
                    getattr(profile, "tolerances", None), accelerator=accelerator)
    cmp = Comparison(tol=tol, label=f"{accelerator}-{case.id}")
    for result in results:
        where = f"rank {result['rank']}"
        if result["class"] != case.expected_class():
            cmp.problems.append(f"{where}: DeepSpeed built {result['class']}, the documented "
                                f"optimizer for {case.kind} here is {case.expected_class()}")
        if len(result["params"]) != case.steps or len(result["reference"]) != case.steps:
            cmp.problems.append(f"{where}: {len(result['params'])} steps traced, "
                                f"{case.steps} expected")
        for step, (got, want) in enumerate(zip(result["params"], result["reference"])):
            cmp.extend(compare_states(got, want, tol, where=where, step=step))
        cmp.problems += [f"{where}: {e}" for e in result["state_errors"]]
        want_state = {k: v for k, v in result["reference_state"].items()
                      if k in result["state"]}
        if want_state:
            cmp.extend(compare_states(result["state"], want_state, tol,
                                      where=f"{where}, optimizer state", step=case.steps - 1))
    if not cmp.ok:
        cmp.notes += _diagnose_flat_lamb(results, tol)
    return cmp


def _diagnose_flat_lamb(results: list[dict], tol) -> list[str]:
    """Where a LAMB cell on ZeRO departs from LAMB: whether its last parameters are those of
    LAMB with one trust ratio per flat ZeRO partition of each group instead of per tensor
    (optimizer_rules.zero_partitions), the way FusedLamb sees ZeRO's flattened partitions."""
    lines = []
    for result in results:
        flat = result.get("flat_partition_params")
        if not flat or not result["params"]:
            continue
        where = f"rank {result['rank']}"
        cmp = compare_states(result["params"][-1], flat, tol, step=len(result["params"]) - 1)
        if cmp.ok:
            lines.append(f"{where}: the last parameters match LAMB with one trust ratio per flat "
                         "ZeRO partition of a group, not per tensor, within the same tolerance")
            continue
        lines.append(f"{where}: the last parameters match neither LAMB nor LAMB with one trust "
                     f"ratio per flat ZeRO partition (worst rel diff to the latter "
                     f"{cmp.worst_rel:.3g})")
        ratios = result.get("trust_ratios") or {}
        if ratios.get("kernel"):
            fmt = lambda rs: "[" + ", ".join(f"{r:.6g}" for r in rs) + "]"  # noqa: E731
            lines.append(f"{where}: trust ratios at step 0: FusedLamb's last step() call "
                         f"{fmt(ratios['kernel'][0])}; one per flat partition "
                         f"{fmt(ratios['flat'][0])}; one per tensor "
                         f"{fmt(ratios['per_tensor'][0])} (groups in order)")
    return lines


@pytest.mark.parametrize("accelerator, case", _params())
@batched(_plan)  # the cells run at once where lanes are on (dsconform.plugin.batch)
def test_optimizer_follows_its_rule(accelerator: str, case: OptCase, profile, request):
    """OPT-RULE-1: every step of DeepSpeed's optimizer MUST follow its reference's update rule,
    per parameter group, and end with its optimizer state."""
    judge(cell_results(request), case, accelerator, profile).assert_ok()


# DeepSpeed's own Adam on ZeRO-3 (FusedAdam on GPUs; the CPU accelerator builds fused_adam for
# it, nightly there), Lion offloaded to the host (its state through the host) and a client
# optimizer in bf16 on ZeRO-3. ZeRO 1/2 cannot read back their optimizer state on
# 0.19.8 (DS-Z12-OPT-STATE-LATER-GROUPS), so the resumed cells train on stage 3.
RESUME_CELLS = [OptCase("adamw", 3, "none", "fp32", 1, 2, resume_at=3),
                OptCase("lion", 3, "opt", "fp32", 1, 2, resume_at=3),
                OptCase("client", 3, "none", "bf16", 4, 2, resume_at=3)]
RESUME_TIER = {"cpu": ("lion", "client"),
               "cuda": ("adamw", "client") if GPU_ACCEPTANCE else ()}


def _resume_params() -> list:
    return [accel_cell(accel, case, id=case.id, world_size=case.world_size,
                       marks=_needs(case), slow=case.kind not in RESUME_TIER[accel])
            for accel in ACCELERATORS for case in RESUME_CELLS if runs_on(case, accel)]


@pytest.mark.parametrize("accelerator, case", _resume_params())
def test_resume_keeps_the_trajectory(accelerator: str, case: OptCase, profile, scratch):
    """OPT-RESUME-1: an optimizer resumed from a checkpoint MUST continue on its reference's
    trajectory, step for step."""
    results = run_ranks(train_optimizer, case.world_size, timeout_s=TIMEOUT_S,
                        args=(case,), kwargs={"save_dir": str(scratch / "ckpt")},
                        accelerator=accelerator)
    judge(results, case, accelerator, profile).assert_ok()



# The plain Muon cells: every stage on the device, fp32 and bf16, one and two ranks. The CPU
# tier holds stage 0 (the default stage, where no ZeRO optimizer runs Muon's update for it),
# stage 2 beside it and ZeRO-3 under zero.Init; on GPUs they are nightly, as every Muon cell is.
PLAIN_MUON = [OptCase("muon", stage, "none", dtype, 1, ws, plain=True)
              for stage in range(4) for dtype in ("fp32", "bf16") for ws in (1, 2)] + [
    # ZeRO-3 with the model built under deepspeed.zero.Init, as large models are.
    OptCase("muon", 3, "none", dtype, 1, ws, plain=True, zinit=True)
    for dtype in ("fp32", "bf16") for ws in (1, 2)]
PLAIN_MUON_CPU_TIER = {(0, "fp32", False), (2, "fp32", False), (3, "fp32", True)}


def _plain_muon_params() -> list:
    return [p for accel in ACCELERATORS for p in tier_params(
        accel, PLAIN_MUON, marks=_needs, gpu_tier=lambda cs: [],
        cpu_tier=lambda c: c.world_size == 2
        and (c.stage, c.dtype, c.zinit) in PLAIN_MUON_CPU_TIER)]


@pytest.mark.parametrize("accelerator, case", _plain_muon_params())
@batched(_plan)
def test_plain_muon_follows_its_rule(accelerator: str, case: OptCase, profile, request):
    """OPT-MUON-1: Muon configured the plainest way (its parameters ungrouped, matrices only)
    MUST orthogonalise every step's update, at every ZeRO stage."""
    judge(cell_results(request), case, accelerator, profile).assert_ok()
