"""Mixed precision: fp16 dynamic loss scaling MUST behave as DeepSpeed documents it, on every
rank at once, and fp16 and bf16 MUST train as well as fp32.

- DeepSpeed's own scaler MUST follow the reference model of ``dsconform/checks/lossscale.py``
  (LOSS-SCALE-1..3): suites/test_loss_scaler.py.
- The fp16 engine (ZeRO stages 0-3, 1 and 2 ranks, SGD and FusedAdam) with inf or NaN injected
  at chosen steps on one rank, into the loss or into one element of one parameter's gradient,
  MUST after every step use the model's scale, skip exactly the model's steps on EVERY rank
  (overflow consensus), leave a skipped step's fp32 masters, optimizer state and model weights
  bit-identical on every rank, apply every clean step (the one after a skip included), and keep
  the gathered fp32 masters bit-identical across ranks. A static scale never changes.
- Every step the model applies MUST move the gathered fp32 masters as far, and in the same
  direction, as the same step of an fp32 replica (plain torch, the same initial masters, every
  rank's batches, the config's optimizer, the model's skipped steps left out): the loss scale
  used in backward is the one undone, the gradients are averaged over the ranks.
- bf16 has no loss scaler and trains to finite weights.
- fp16 (dynamic scaling with DeepSpeed's defaults) and bf16 MUST reach fp32's final loss on the
  same task from the same weights within the tolerance table's margin; each loss curve's summary
  goes to the benchmark JSON.

Known upstream defects on stage 0 (dsconform/gate/known_issues.py): its fp16 wrappers never scale
the
loss in ``engine.backward`` (DS-8393-Z0-FP16-UNSCALED: fp16 SGD does not converge), and they
keep a scaler of their own that ignores hysteresis (DS-Z0-FP16-NO-HYSTERESIS) and skips forever
at the floor (DS-697-Z0-FP16-SILENT-FLOOR); their FusedAdam takes a zero-gradient step at
initialization (DS-5104-Z0-ADAM-INIT-STEP). On ZeRO 1-3 the step on which the dynamic scale
rises unscales its gradients by the new scale, twice the one backward used
(DS-8588-FP16-RAISE-STEP-HALVED). Those cells are strict xfails on affected versions.

Upstream: https://www.deepspeed.ai/docs/config-json/#fp16-training-options ,
https://www.deepspeed.ai/docs/config-json/#bfloat16-training-options ,
https://github.com/deepspeedai/DeepSpeed/blob/master/deepspeed/runtime/fp16/loss_scaler.py .

Stable ids: LOSS-SCALE-4 (engine matrix), LOSS-SCALE-5 (bf16), LOSS-SCALE-6 (convergence),
LOSS-SCALE-7 (the size of applied steps); each
case id (``z2-ws2-h2-grad_nan-fused_adam``) names its cell and does not change.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import pytest

from dsconform.suite import (
    ACCELERATORS,
    RankCall,
    ScalerModel,
    accel_cell,
    batched,
    cell_results,
    compare_update,
    pairwise,
    requires,
    tolerance,
)
from suites.loss_scaling_ranks import (
    INJECTIONS,
    SCALERS,
    CurveCase,
    ScalingCase,
    overflow_flags,
    train_bf16,
    train_curve,
    train_with_overflows,
)

CAPABILITY = "loss_scaling"
TIMEOUT_S = 300       # per call; an engine cell takes seconds
OP_TIMEOUT_S = 600    # FusedAdam JIT-builds inside its first call (docs/findings.md#op-builds)
CURVE_TIMEOUT_S = 600

# ---------------------------------------------------------------------------------------------
# LOSS-SCALE-4: the fp16 engine with injected overflows
# ---------------------------------------------------------------------------------------------

STAGES = (0, 1, 2, 3)
WORLD_SIZES = (1, 2)
OPTIMIZERS = ("sgd", "fused_adam")


def engine_matrix() -> list[ScalingCase]:
    """Every (stage, world size, scaler, injection, optimizer) cell: the nightly tier."""
    return [ScalingCase(stage=stage, world_size=ws, scaler=scaler, inject=inject, optimizer=opt)
            for stage in STAGES for ws in WORLD_SIZES for scaler in SCALERS
            for inject in INJECTIONS for opt in OPTIMIZERS]


# The acceptance tier's axes: the scaler and injection values a node can get wrong differently.
# "h1" and "h2c" differ from "h2" only in the scaler's arithmetic, which LOSS-SCALE-1 checks on
# DeepSpeed's own object in the CPU tier; NaN and inf take the same path as each other through
# the loss and through a gradient. The nightly tier runs every value.
ACCEPTANCE_AXES = {"stage": list(STAGES), "world_size": [2, 1], "scaler": ["h2", "static", "floor"],
                   "inject": ["grad_nan", "loss_inf"], "optimizer": list(OPTIMIZERS)}
# Stage 0 on two ranks with a scaler it implements (its hysteresis and floor are known defects):
# the acceptance tier checks its skip path and consensus too.
ACCEPTANCE_MUST = ({"stage": 0, "world_size": 2, "scaler": "static", "inject": "loss_inf",
                    "optimizer": "sgd"},)


def engine_tier() -> set[str]:
    """The acceptance tier (``pytest -m gpu``): every pair of ``ACCEPTANCE_AXES`` values at
    least once, two ranks first (consensus is what they add): 12 cells of the 320."""
    return {ScalingCase(**cell).id for cell in pairwise(ACCEPTANCE_AXES, must=ACCEPTANCE_MUST)}


def one_rank(axes: dict) -> dict:
    """``axes`` with the world size fixed at one rank: the axes of a one-GPU node's tier."""
    return {**axes, "world_size": [1]}


# On a node with one GPU the engine tier runs at one rank (stage 0's static skip path among its
# cells), in place of the two-rank cells but one per stage (consensus_cells).
ONE_RANK_MUST = tuple({**cell, "world_size": 1} for cell in ACCEPTANCE_MUST)


def engine_one_rank_tier() -> set[str]:
    """The acceptance tier of a node with one GPU (``one_gpu_tier``): every pair of the values
    of ``ACCEPTANCE_AXES`` other than the world size, at one rank: 12 cells."""
    return {ScalingCase(**cell).id
            for cell in pairwise(one_rank(ACCEPTANCE_AXES), must=ONE_RANK_MUST)}


def consensus_cells() -> set[str]:
    """The two-rank acceptance cells a node with one GPU keeps, and skips (GPUs>=2): overflow
    consensus across ranks needs two ranks. The first two-rank cell of each stage in the
    acceptance tier (stage 0's is ``ACCEPTANCE_MUST``'s): each stage agrees on an overflow in
    code of its own."""
    first: dict[int, str] = {}
    for cell in pairwise(ACCEPTANCE_AXES, must=ACCEPTANCE_MUST):
        if cell["world_size"] > 1:
            first.setdefault(cell["stage"], ScalingCase(**cell).id)
    return set(first.values())


def _one_gpu_role(case: ScalingCase, tier: set[str], one_rank_tier: set[str],
                  keep: set[str]) -> str | None:
    if case.id in one_rank_tier:
        return "tier"
    if case.id in tier and case.world_size > 1 and case.id not in keep:
        return "covered"
    return None


def _scaling_params(matrix: list[ScalingCase], tier: set[str],
                    one_rank_tier: set[str] = frozenset(),
                    keep: set[str] = frozenset()) -> list:
    """A ScalingCase matrix as pytest params on each accelerator: fp16 (and FusedAdam's op)
    required, the cells outside ``tier`` marked slow (nightly). On a node with one GPU the cuda
    cells of ``one_rank_tier`` join the acceptance tier, in place of the two-rank cells of
    ``tier`` but those of ``keep``."""
    params = []
    for accel in ACCELERATORS:
        for case in matrix:
            marks = [requires(fp16=True)]
            if case.optimizer == "fused_adam":
                marks.append(requires(op="fused_adam"))
            if case.id in keep:
                marks.append(requires(two_ranks="overflow consensus across ranks"))
            params.append(accel_cell(accel, case, id=case.id, world_size=case.world_size,
                                     marks=marks, slow=case.id not in tier,
                                     one_gpu=_one_gpu_role(case, tier, one_rank_tier, keep)))
    return params


def _outcome(step: dict) -> str:
    if step["error"]:
        return "error"
    return "skipped" if step["skipped"] else "applied"


def check_engine_run(case: ScalingCase, results: list[dict]) -> list[str]:
    """Every rank's steps against the model up to its first divergence (later steps follow from
    it), and the ranks against each other. One line per problem, naming the rank, the step, what
    the model says and what DeepSpeed did."""
    expected = ScalerModel(case.settings).run(list(case.pattern))
    problems: list[str] = _missing_ranks(results, case.world_size)
    for res in results:
        r, steps = res["rank"], res["steps"]
        diverged = False
        for e, got in zip(expected, steps):
            what = (f"overflow ({case.inject}) injected on rank {case.inject_rank}" if e.overflow
                    else "clean")
            found = _check_step(case, e, got, f"rank {r} ({res['wrapper']}), step {got['step']} "
                                              f"({what})")
            if found:
                problems += found
                if got is not steps[-1]:
                    problems.append(f"rank {r}: steps after {got['step']} not compared (they "
                                    f"follow from this one)")
                diverged = True
                break
        if diverged:
            continue
        if len(steps) < len(expected):
            problems.append(f"rank {r}: ran {len(steps)} steps, the model expects "
                            f"{len(expected)}")
        elif len(steps) > len(expected):
            problems.append(f"rank {r}: ran on to step {len(steps) - 1}; the model ended the run "
                            f"at step {len(expected) - 1} (overflow at min_loss_scale)")
    return problems + (_cross_rank(results) if results else [])


def _check_step(case: ScalingCase, e: Any, got: dict, where: str) -> list[str]:
    s = case.settings
    problems = []
    if got["scale_used"] != e.scale_used:
        problems.append(f"{where}: loss scale {got['scale_used']}, the model's {e.scale_used}")
    outcome = _outcome(got)
    if outcome != e.outcome:
        if e.outcome == "error":
            problems.append(f"{where}: an overflow at min_loss_scale={s.min_loss_scale:g} must "
                            f"end the run with an error; DeepSpeed {outcome} the step and went "
                            f"on")
        else:
            problems.append(f"{where}: the model says {e.outcome}, DeepSpeed {outcome} it"
                            f"{': ' + got['error'] if got['error'] else ''}")
        return problems
    if outcome == "error":
        return problems
    state = got["state"]
    if state["scale"] != e.scale_after:
        problems.append(f"{where}: loss scale after the step {state['scale']}, the model's "
                        f"{e.scale_after} ({s.describe()})")
    if state["dynamic"] != s.dynamic:
        problems.append(f"{where}: scaler dynamic={state['dynamic']}, config {s.describe()}")
    if outcome == "skipped":
        if got["local_changed"]:
            problems.append(f"{where}: skipped, yet changed this rank's state: "
                            f"{', '.join(got['local_changed'][:4])}")
        moved = sorted(set(got.get("masters", ())) - set(got.get("masters_unchanged", ())))
        if moved:
            problems.append(f"{where}: skipped, yet changed the gathered fp32 masters of "
                            f"{', '.join(moved)}")
    elif got.get("masters_unchanged"):
        problems.append(f"{where}: applied, yet left the fp32 masters of "
                        f"{', '.join(got['masters_unchanged'])} bit-identical")
    return problems


def _cross_rank(results: list[dict]) -> list[str]:
    """Overflow consensus seen from outside: after every step every rank holds the same fp32
    masters, bit for bit. On stage 0 each rank keeps masters of its own, so a rank that steps
    alone shows here; on ZeRO 1-3 the gathered masters are one collective's output and agree by
    construction: there consensus is proven by each rank's own record (its skip counter and its
    partition's bit-identity on a skipped step, ``_check_step``), not by this comparison."""
    from suites.loss_scaling_ranks import bits_equal

    problems = []
    first = results[0]
    for other in results[1:]:
        for a, b in zip(first["steps"], other["steps"]):
            if "masters" not in a or "masters" not in b:
                continue
            differ = [n for n in a["masters"] if not bits_equal(a["masters"][n], b["masters"][n])]
            if differ:
                problems.append(f"step {a['step']}: the gathered fp32 masters of rank "
                                f"{first['rank']} and rank {other['rank']} differ in "
                                f"{', '.join(differ)}")
                break
    return problems


def engine_call(case: ScalingCase, accelerator: str) -> RankCall:
    timeout = OP_TIMEOUT_S if case.optimizer == "fused_adam" else TIMEOUT_S
    return RankCall(train_with_overflows, case.world_size, timeout, args=(case,),
                    accelerator=accelerator)


@pytest.mark.parametrize("accelerator, case", _scaling_params(
    engine_matrix(), engine_tier(), engine_one_rank_tier(), consensus_cells()))
@batched(lambda params, workdir, run: engine_call(params["case"], params["accelerator"]))
def test_overflow_handling(accelerator: str, case: ScalingCase, request):
    """LOSS-SCALE-4: every step MUST scale, skip and apply as the model says, on every rank.

    A node with one GPU runs the one-rank tier and skips the two-rank cells of
    ``consensus_cells`` (GPUs>=2): they need two ranks, for overflow consensus across ranks."""
    problems = check_engine_run(case, cell_results(request))
    pattern = overflow_flags(list(case.pattern))
    assert not problems, (f"{accelerator}-{case.id} ({case.settings.describe()}, overflow "
                          f"pattern {pattern}):\n  " + "\n  ".join(problems))


# ---------------------------------------------------------------------------------------------
# LOSS-SCALE-7: every applied step is as large as fp32's
# ---------------------------------------------------------------------------------------------

def step_size_matrix() -> list[ScalingCase]:
    """Every (stage, world size, scaler, optimizer) cell, overflows injected into the loss (how
    an overflow arrives does not change the steps around it; LOSS-SCALE-4 covers that): the
    nightly tier, 80 cells."""
    return [ScalingCase(stage=stage, world_size=ws, scaler=scaler, inject="loss_inf",
                        optimizer=opt)
            for stage in STAGES for ws in WORLD_SIZES for scaler in SCALERS
            for opt in OPTIMIZERS]


# The acceptance tier: a scaler whose scale rises during the run ("h1"), one that only falls
# ("h2c") and a static one; every pair with stage, world size and optimizer.
STEP_SIZE_AXES = {"stage": list(STAGES), "world_size": [2, 1], "scaler": ["h1", "static", "h2c"],
                  "optimizer": list(OPTIMIZERS)}


def step_size_tier() -> set[str]:
    """The acceptance tier of LOSS-SCALE-7: every pair of ``STEP_SIZE_AXES`` values."""
    return {ScalingCase(**cell).id for cell in pairwise(STEP_SIZE_AXES)}


def step_size_one_rank_tier() -> set[str]:
    """The acceptance tier of LOSS-SCALE-7 on a node with one GPU: every pair of the values of
    ``STEP_SIZE_AXES`` other than the world size, at one rank (the loss scale undone is the
    same check there; the two-rank cells are left out)."""
    return {ScalingCase(**cell).id for cell in pairwise(one_rank(STEP_SIZE_AXES))}


def check_step_sizes(case: ScalingCase, results: list[dict], tol: Any
                     ) -> tuple[list[str], dict[str, float]]:
    """Every rank's gathered fp32 masters against the fp32 replica the rank trained beside them
    (``loss_scaling_ranks.Replica``): each step the model applies must move them as the
    replica's step moved it (``tol.update``, ``tol.gain``), and so must the run as a whole (a
    skipped step that moved the masters shows there). Returns the problems and the worst
    values found (``update``: norm-relative difference, ``gain``: |gain - 1|)."""
    expected = ScalerModel(case.settings).run(list(case.pattern))
    applied = [i for i, e in enumerate(expected) if e.outcome == "applied"]
    problems = _missing_ranks(results, case.world_size)
    worst = {"update": 0.0, "gain": 0.0}
    for res in results:
        where = f"rank {res['rank']} ({res['wrapper']})"
        if "init" not in res:
            problems.append(f"{where}: no initial masters: nothing to measure the steps from")
            continue
        before, ref_before = res["init"], res["init"]
        compared, failed, last = 0, False, None
        for got in res["steps"]:
            if "masters" not in got or "replica" not in got:
                break  # the run ended here (LOSS-SCALE-4 judges whether it should have)
            last = got
            if got["step"] in applied:
                cmp = compare_update(before, got["masters"], ref_before, got["replica"], tol,
                                     step=got["step"], where=where)
                _fold(worst, cmp)
                compared += 1
                if not cmp.ok and not failed:
                    problems.append(_step_problem(cmp, f"{where}, step {got['step']} (scale "
                                                       f"{got['scale_used']:g})"))
                    failed = True
            before, ref_before = got["masters"], got["replica"]
        if compared != len(applied):
            problems.append(f"{where}: {compared} applied steps compared, the model applies "
                            f"{len(applied)} (steps {applied})")
        elif not failed and last is not None and compared:
            cmp = compare_update(res["init"], last["masters"], res["init"], last["replica"],
                                 tol, step=last["step"], where=where)
            _fold(worst, cmp)
            if not cmp.ok:
                problems.append(_step_problem(cmp, f"{where}, the whole run to step "
                                                   f"{last['step']}"))
    return problems, worst


def _fold(worst: dict[str, float], cmp: Any) -> None:
    worst["update"] = max(worst["update"], cmp.worst("update")[1])
    worst["gain"] = max(worst["gain"], cmp.worst("gain")[0])


def _step_problem(cmp: Any, where: str) -> str:
    if cmp.problems:
        return f"{where}: cannot compare the update: {'; '.join(cmp.problems[:3])}"
    found = {d.quantity: d for d in cmp.differences}
    gain, update = found.get("gain"), found.get("update")
    said = []
    if gain is not None:
        said.append(f"moved the fp32 masters {gain.value:.4g}x as far as the fp32 replica "
                    f"(<delta, delta_ref> / |delta_ref|^2)")
    if update is not None:
        said.append(f"|delta - delta_ref| / |delta_ref| = {update.max_rel:.3g}")
    tol = cmp.tol
    return (f"{where}: {', '.join(said)}; exceeds update<={tol.update:g} gain=1+/-{tol.gain:g} "
            f"({tol.why})")


@pytest.mark.parametrize("accelerator, case", _scaling_params(
    step_size_matrix(), step_size_tier(), step_size_one_rank_tier()))
@batched(lambda params, workdir, run: engine_call(params["case"], params["accelerator"]))
def test_applied_steps_match_fp32(accelerator: str, case: ScalingCase, profile, metrics,
                                  request):
    """LOSS-SCALE-7: every step the model applies MUST move the fp32 masters as far as fp32
    training moves them (the loss scale undone exactly, the gradients averaged over ranks)."""
    tol = tolerance("loss_scaling", "fp16", case.optimizer, profile.tolerances,
                    accelerator=accelerator)
    problems, worst = check_step_sizes(case, cell_results(request), tol)
    params = {**case.params(), "accelerator": accelerator}
    metrics.record("loss_scaling.step_update_rel_diff", worst["update"], unit="1",
                   better="lower", bound=tol.update, **params)
    metrics.record("loss_scaling.step_gain_dev", worst["gain"], unit="1", better="lower",
                   bound=tol.gain, **params)
    pattern = overflow_flags(list(case.pattern))
    assert not problems, (f"{accelerator}-{case.id} ({case.settings.describe()}, overflow "
                          f"pattern {pattern}):\n  " + "\n  ".join(problems))


# ---------------------------------------------------------------------------------------------
# LOSS-SCALE-5: bf16 has no scaler
# ---------------------------------------------------------------------------------------------

def _bf16_params() -> list:
    """Acceptance (and CPU) tier: every stage on two ranks, one rank nightly; a node with one
    GPU runs every stage on one rank instead."""
    return [accel_cell(accel, stage, ws, id=f"z{stage}-ws{ws}", world_size=ws,
                       marks=[requires(bf16=True)], slow=ws != 2,
                       one_gpu="tier" if ws == 1 else "covered")
            for accel in ACCELERATORS for stage in STAGES for ws in WORLD_SIZES]


def _missing_ranks(results: list[dict], world_size: int) -> list[str]:
    """A check over fewer rank results than ranks would pass on what is missing."""
    if len(results) == world_size:
        return []
    return [f"{len(results)} rank result(s) for {world_size} ranks: nothing to judge the "
            f"missing ones by"]


def check_bf16_run(results: list[dict], world_size: int | None = None) -> list[str]:
    problems = _missing_ranks(results, world_size if world_size is not None
                              else max(len(results), 1))
    for res in results:
        steps, where = res["steps"], f"rank {res['rank']} ({res['wrapper']})"
        for i, step in enumerate(steps):
            state = step["state"]
            if state["dynamic"] or state["scale"] not in (None, 1.0):
                problems.append(f"{where}, step {i}: bf16 has a loss scaler (dynamic="
                                f"{state['dynamic']}, scale {state['scale']}); it needs none")
                break
        bad = [i for i, step in enumerate(steps)
               if not (math.isfinite(step["loss"]) and step["masters_finite"])]
        if bad:
            problems.append(f"{where}: loss or fp32 masters not finite from step {bad[0]} on "
                            f"(losses {[round(s['loss'], 4) for s in steps]})")
        elif steps[-1]["skipped"]:
            problems.append(f"{where}: skipped {steps[-1]['skipped']} of {len(steps)} steps of "
                            f"finite bf16 training")
        head = statistics.mean(s["loss"] for s in steps[:3])
        tail = statistics.mean(s["loss"] for s in steps[-3:])
        if not bad and not tail < head:
            problems.append(f"{where}: the loss did not fall in {len(steps)} steps (first three "
                            f"{head:.4g}, last three {tail:.4g})")
    return problems


@pytest.mark.parametrize("accelerator, stage, world_size", _bf16_params())
@batched(lambda params, workdir, run: RankCall(
    train_bf16, params["world_size"], TIMEOUT_S, args=(params["stage"], params["world_size"]),
    accelerator=params["accelerator"]))
def test_bf16_has_no_scaler(accelerator: str, stage: int, world_size: int, request):
    """LOSS-SCALE-5: bf16 MUST train with no loss scaler, to finite losses and weights."""
    results = cell_results(request)  # run at once with other cells (dsconform.plugin.batch)
    problems = check_bf16_run(results, world_size)
    assert not problems, f"{accelerator}-z{stage}-ws{world_size} bf16:\n  " + "\n  ".join(problems)


# ---------------------------------------------------------------------------------------------
# LOSS-SCALE-6: convergence against fp32
# ---------------------------------------------------------------------------------------------

CURVE_TIER = {(2, "fp16"), (2, "bf16")}
# Skipped steps a convergence run may have: fp16 from DeepSpeed's initial 2**16 may overflow a few
# times before the scale settles (the convergence entry's margin allows for 10;
# docs/findings.md#loss-scaling); bf16 has no scaler and never skips. A scale that keeps
# overflowing can still end within the margin, so the count is held on its own.
MAX_SKIPPED_STEPS = {"fp16": 10, "bf16": 0}


def _curve_params() -> list:
    params = []
    for accel in ACCELERATORS:
        for stage in STAGES:
            for dtype in ("fp16", "bf16"):
                case = CurveCase(stage=stage, dtype=dtype)
                # 2x200 steps take minutes on 2 CPU cores: the CPU runs them nightly only.
                nightly = accel == "cpu" or (stage, dtype) not in CURVE_TIER
                params.append(accel_cell(accel, case, id=case.id, world_size=case.world_size,
                                         marks=[requires(**{dtype: True})], slow=nightly,
                                         one_gpu="covered" if not nightly else None))
    # A node with one GPU runs the acceptance tier's curves on one rank (nightly elsewhere).
    for stage, dtype in sorted(CURVE_TIER):
        case = CurveCase(stage=stage, dtype=dtype, world_size=1)
        params.append(accel_cell("cuda", case, id=case.id, world_size=1,
                                 marks=[requires(**{dtype: True})], slow=True, one_gpu="tier"))
    return params


def rank_mean_curve(results: list[dict], key: str) -> list[float]:
    """The loss of every step averaged over the ranks (each rank sees its own data)."""
    curves = [r[key]["losses"] for r in results]
    return [statistics.mean(step) for step in zip(*curves)]


def curve_summary(losses: list[float], window: int = 10) -> dict[str, float]:
    return {"first_mean": statistics.mean(losses[:window]),
            "last_mean": statistics.mean(losses[-window:]), "min": min(losses)}


def check_convergence(case: CurveCase, results: list[dict], tol: Any) -> tuple[dict, list[str]]:
    """The low-precision run's final loss (mean of the last 10 steps) against fp32's: it may be
    at most ``tol.atol + tol.rtol * fp32`` away, on either side. Ending higher is the usual
    failure (updates too small, steps lost); ending clearly lower on the same task, weights and
    data is no bonus either: its updates were larger than fp32's (an lr 10% high ends 3.8%
    lower, plain torch on the CPU machine)."""
    curves = {key: curve_summary(rank_mean_curve(results, key)) for key in ("fp32", case.dtype)}
    ref, low = curves["fp32"]["last_mean"], curves[case.dtype]["last_mean"]
    problems = []
    if not all(math.isfinite(v) for c in curves.values() for v in c.values()):
        problems.append(f"non-finite loss: {curves}")
    allowed = tol.atol + tol.rtol * abs(ref)
    most = MAX_SKIPPED_STEPS.get(case.dtype, 0)
    for r in results:
        skipped = r[case.dtype]["skipped"]
        if not skipped <= most:
            problems.append(f"rank {r.get('rank', '?')}: {case.dtype} skipped {skipped} of "
                            f"{case.steps} steps (overflows); at most {most} are allowed for")
    if not abs(low - ref) <= allowed:
        run = results[0][case.dtype]
        problems.append(
            f"{case.dtype} ({run['wrapper']}) ended at loss {low:.5g} (mean of the last 10 of "
            f"{case.steps} steps), fp32 at {ref:.5g}: {low - ref:+.3g} exceeds the allowed "
            f"{allowed:.3g} ({tol}: {tol.why}); mean of the first 10: "
            f"{curves[case.dtype]['first_mean']:.4g} ({case.dtype}), "
            f"{curves['fp32']['first_mean']:.4g} (fp32); {run['skipped']} skipped steps")
    return curves, problems


@pytest.mark.parametrize("accelerator, case", _curve_params())
@batched(lambda params, workdir, run: RankCall(
    train_curve, params["case"].world_size, CURVE_TIMEOUT_S, args=(params["case"],),
    accelerator=params["accelerator"]))
def test_fp16_bf16_converge(accelerator: str, case: CurveCase, profile, metrics, request):
    """LOSS-SCALE-6: fp16 and bf16 MUST reach fp32's final loss within the table's margin."""
    results = cell_results(request)  # run at once with other cells (dsconform.plugin.batch)
    tol = tolerance("convergence", case.dtype, "sgd", profile.tolerances,
                    accelerator=accelerator)
    curves, problems = check_convergence(case, results, tol)
    params = {**case.params(), "accelerator": accelerator}
    for key, summary in curves.items():
        for stat, value in summary.items():
            metrics.record(f"loss_scaling.curve.{key}.{stat}", value, unit="1", better="lower",
                           **params)
    metrics.record(f"loss_scaling.curve.{case.dtype}.skipped_steps",
                   results[0][case.dtype]["skipped"], unit="steps", better="lower", **params)
    assert not problems, f"{accelerator}-{case.id}:\n  " + "\n  ".join(problems)
