"""Mixture of Experts: DeepSpeed's MoE layer MUST compute what its documented gating computes,
expert parallelism MUST train like the same model without it, an MoE checkpoint MUST come back
bit for bit, and the all_to_all an MoE layer sends is measured with the collectives.

- MOE-LAYER-1 (``test_layer_matches_reference``): ``deepspeed.moe.layer.MoE`` (top-1 and top-2
  gating, ``drop_tokens`` off and on, capacity factors 1.0 and 0.5, the residual variant) MUST
  give, from the same gate and expert weights, the output, the auxiliary loss, the per-expert
  counts, the capacity and the set of (token, expert) routes that keep their slot that the
  plain-PyTorch reference in ``suites/moe_ranks.py`` computes. Top-1 keeps the tokens Random
  Token Selection prefers (the layer's own draw, replayed); top-2 cells turn the second
  expert's Gumbel sampling off (``top2_2nd_expert_sampling=False``), so both choices are the
  gate's.
- MOE-EP-1 (``test_expert_parallel_trains_like_ep1``): a model with an MoE layer (4 experts,
  top-1, and top-2 on ZeRO 2, a capacity that drops tokens) with ``ep_size`` = world size MUST
  train like the same model with ``ep_size`` = 1 from the same weights and data, under ZeRO
  0-2, with the parameter groups of ``split_params_into_different_moe_groups_for_optimizer`` and
  gradient clipping that bites: every rank's losses, the expert and non-expert gradients of
  every step and the final parameters (each expert read from the rank that holds it).
- MOE-EP-2 (``test_clip_norm_counts_every_expert_once``): the global gradient norm the engine
  clips with MUST be the norm of every gradient with each expert counted exactly once (computed
  from the gradients the engine holds), on every rank, at every step.
- MOE-CKPT-1 (``test_checkpoint_round_trip``): an MoE checkpoint with ``ep_size`` = world size
  MUST write one expert file per expert, MUST load back every weight, SGD momentum buffer and
  the step counter bit for bit, and training resumed from it MUST continue exactly as the
  uninterrupted run (losses, final weights and momentum).
- MOE-A2A-1 (``test_all_to_all_busbw``, GPU): all_to_all at the sizes an MoE layer sends MUST
  return the exact result; its bus bandwidth (nccl-tests' factor (n-1)/n, GB/s = 1e9 bytes/s,
  3 rounds of back-to-back calls, as the collectives suite times them) is recorded with the
  collectives and held to the profile's ``[[nccl.floors]]`` entry of collective ``all_to_all``
  at that size where the profile states one.

Two-rank checks: MOE-EP-1/2 and MOE-A2A-1 need two ranks by nature (experts spread over ranks,
tokens exchanged between them) and skip on a one-GPU node; MOE-CKPT-1 runs there at one rank.
Tolerances: ``dsconform/checks/tolerances.py`` "moe_layer", "moe_ep" and "checkpoint".

Upstream: https://www.deepspeed.ai/tutorials/mixture-of-experts/ ,
https://deepspeed.readthedocs.io/en/latest/moe.html

Stable ids: MOE-LAYER-1, MOE-EP-1, MOE-EP-2, MOE-CKPT-1, MOE-A2A-1; case ids (``cpu-top2-drop-
cf0.5-residual``, ``cpu-z2-top2``) name their cell and do not change.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from dsconform.suite import (
    ACCELERATORS,
    GB,
    accel_cell,
    collectives,
    compare_states,
    compare_traces,
    requires,
    run_ranks,
    tensor_difference,
    tolerance,
)
from suites import moe_ranks

CAPABILITY = "moe"
TIMEOUT_S = 300
WORLD_SIZE = 2
EP_STEPS = 5
MICRO_BATCH = 16
# Below the model's first gradient norms (0.7 and 0.6 at steps 0 and 2): clipping changes the
# update, so a norm that miscounts an expert moves the trajectory.
CLIP = 0.3
LR = 0.1
TWO_RANKS = "experts are spread over ranks and tokens exchanged between them"


# ------------------------------------------------------------------ MOE-LAYER-1

def _layer_cell(k: int, drop: bool, cf: float, residual: bool) -> dict[str, Any]:
    name = f"top{k}-{'drop' if drop else 'nodrop'}" + (f"-cf{cf}" if drop else "") + \
        ("-residual" if residual else "")
    return {"id": name, "k": k, "drop_tokens": drop, "capacity_factor": cf, "min_capacity": 1,
            "residual": residual, "seed": 3, "gate_scale": 3.0}


LAYER_CELLS = [_layer_cell(k, drop, cf, residual) for k in (1, 2)
               for drop, cf in ((False, 1.0), (True, 1.0), (True, 0.5))
               for residual in (False, True)]
_LAYER_RUNS: dict[str, list[dict[str, Any]]] = {}


def layer_results(accelerator: str, misroute: bool = False) -> dict[str, dict[str, Any]]:
    """Every layer cell in one one-rank run (seconds), by cell id."""
    if misroute or accelerator not in _LAYER_RUNS:
        got = run_ranks(moe_ranks.layer_cells, 1, timeout_s=TIMEOUT_S, args=(LAYER_CELLS,),
                        kwargs={"misroute": misroute}, accelerator=accelerator)[0]
        if misroute:
            return {c["id"]: c for c in got}
        _LAYER_RUNS[accelerator] = got
    return {c["id"]: c for c in _LAYER_RUNS[accelerator]}


def layer_problems(result: dict[str, Any], cell: dict[str, Any], accelerator: str) -> list[str]:
    """MOE-LAYER-1's judgement of one cell: DeepSpeed's layer against the reference."""
    ref, cid = result["reference"], cell["id"]
    tol = tolerance("moe_layer", "fp32", "sgd", accelerator=accelerator)
    problems = []
    if cell["drop_tokens"] and cell["capacity_factor"] <= 1.0 and \
            len(ref["routed"]) == len(ref["kept"]):
        problems.append(f"{cid}: the reference drops no token: the cell checks no capacity")
    if result["kept"] != ref["kept"]:
        extra = sorted(set(map(tuple, result["kept"])) - set(map(tuple, ref["kept"])))
        missing = sorted(set(map(tuple, ref["kept"])) - set(map(tuple, result["kept"])))
        problems.append(f"{cid}: routes (token, expert) kept by DeepSpeed and not by the "
                        f"reference: {extra[:8]}; kept by the reference only: {missing[:8]}")
    if result["exp_counts"] != ref["exp_counts"]:
        problems.append(f"{cid}: exp_counts {result['exp_counts']}, reference "
                        f"{ref['exp_counts']}")
    if ref["capacity"] is not None and result["capacity"] != ref["capacity"]:
        problems.append(f"{cid}: capacity {result['capacity']}, reference {ref['capacity']}")
    abs_d, rel_d, ok = tensor_difference(result["output"], ref["output"], tol)
    if not ok:
        rows = (result["output"] - ref["output"]).abs().amax(dim=1)
        problems.append(f"{cid}: output differs, max abs diff {abs_d:.3g}, max rel diff "
                        f"{rel_d:.3g}, worst token {int(rows.argmax())}; exceeds tolerance "
                        f"{tol} ({tol.why})")
    l_abs, _, l_ok = tensor_difference(torch.tensor(result["l_aux"]),
                                       torch.tensor(ref["l_aux"]), tol)
    if not l_ok:
        problems.append(f"{cid}: l_aux {result['l_aux']:.9g}, reference {ref['l_aux']:.9g} "
                        f"(diff {l_abs:.3g}); exceeds tolerance {tol}")
    return problems


@pytest.mark.parametrize("accelerator, cell", [
    accel_cell(accel, cell, id=cell["id"]) for accel in ACCELERATORS for cell in LAYER_CELLS])
def test_layer_matches_reference(accelerator: str, cell: dict[str, Any], metrics):
    """MOE-LAYER-1: the MoE layer MUST compute the reference's output, l_aux and kept routes."""
    result = layer_results(accelerator)[cell["id"]]
    metrics.record("moe.layer_output_max_abs_diff",
                   float((result["output"] - result["reference"]["output"]).abs().max()),
                   unit="1", better="lower")
    problems = layer_problems(result, cell, accelerator)
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------ MOE-EP-1 / MOE-EP-2

def _ep_cells() -> list:
    """Top-1 on ZeRO 0-2 and top-2 on ZeRO 2; on GPUs top-1 ZeRO 2 in the acceptance tier."""
    return [accel_cell(accel, stage, k, id=f"z{stage}" + ("-top2" if k == 2 else ""),
                       world_size=WORLD_SIZE, marks=[requires(two_ranks=TWO_RANKS)],
                       slow=accel == "cuda" and (stage, k) != (2, 1))
            for accel in ACCELERATORS for stage, k in ((0, 1), (1, 1), (2, 1), (2, 2))]


EP_CELLS = _ep_cells()
_EP_RUNS: dict[tuple[str, int, int], dict[int, list[dict[str, Any]]]] = {}


def ep_runs(accelerator: str, stage: int, k: int = 1, double_count_expert: bool = False
            ) -> dict[int, list[dict[str, Any]]]:
    """{ep_size: per-rank results} for ep_size 1 and the world size, each run once."""
    key = (accelerator, stage, k)
    if double_count_expert or key not in _EP_RUNS:
        runs = {ep: run_ranks(moe_ranks.train_ep, WORLD_SIZE, timeout_s=TIMEOUT_S,
                              args=(ep, stage, EP_STEPS, MICRO_BATCH, CLIP, LR),
                              kwargs={"double_count_expert": double_count_expert and ep > 1,
                                      "k": k},
                              accelerator=accelerator)
                for ep in (1, WORLD_SIZE)}
        if double_count_expert:
            return runs
        _EP_RUNS[key] = runs
    return _EP_RUNS[key]


def merged_trace(per_rank: list[dict[str, Any]], r: int) -> dict[str, Any]:
    """Rank ``r``'s losses with every rank's gradients and parameters under their ep_size = 1
    names: an expert from the rank that holds it, the rest from rank ``r``."""
    grads = [dict(g) for g in per_rank[r]["grads"]]
    params = dict(per_rank[r]["params"])
    for other in per_rank:
        for step, g in enumerate(other["grads"]):
            grads[step].update({n: v for n, v in g.items() if n not in grads[step]})
        params.update({n: v for n, v in other["params"].items() if n not in params})
    return {"losses": per_rank[r]["losses"], "grads": grads, "params": params}


def ep_comparisons(runs: dict[int, list[dict[str, Any]]], label: str, accelerator: str
                   ) -> list[Any]:
    """Every rank's ep_size = world size trace against its ep_size = 1 trace."""
    tol = tolerance("moe_ep", "fp32", "sgd", accelerator=accelerator)
    return [compare_traces(merged_trace(runs[WORLD_SIZE], r), merged_trace(runs[1], r), tol,
                           label=label, where=f"rank {r}") for r in range(WORLD_SIZE)]


def ep_problems(runs: dict[int, list[dict[str, Any]]], label: str, accelerator: str
                ) -> list[str]:
    """MOE-EP-1's judgement: the comparisons, and clipping that bit (the cell checks what it
    says)."""
    problems = [cmp.report() for cmp in ep_comparisons(runs, label, accelerator) if not cmp.ok]
    norms = [_true_norm(merged_trace(runs[1], 0)["grads"][s]) for s in range(EP_STEPS)]
    if not any(n > CLIP for n in norms):
        problems.append(f"{label}: no step's gradient norm exceeds gradient_clipping {CLIP} "
                        f"(norms {[round(n, 4) for n in norms]}): the cell checks no clipping")
    return problems


def _true_norm(grads: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))


def norm_problems(runs: dict[int, list[dict[str, Any]]], label: str) -> list[str]:
    """MOE-EP-2's judgement: the norm each rank clipped with against the norm of the gradients
    the engine held, every expert once (ep_size = world size; from ep_size = 1 where the
    engine does not report its norm)."""
    problems = []
    for ep, per_rank in runs.items():
        for r, result in enumerate(per_rank):
            trace = merged_trace(per_rank, r)
            for step, reported in enumerate(result["norms"]):
                if reported is None:
                    continue
                expected = _true_norm(trace["grads"][step])
                if not math.isclose(reported, expected, rel_tol=1e-5):
                    problems.append(
                        f"{label} ep_size={ep} rank {r} step {step}: the engine clipped with a "
                        f"global norm of {reported:.9g}, the gradients' norm with every expert "
                        f"counted once is {expected:.9g} ({reported / expected:.6f}x)")
    if all(n is None for per_rank in runs.values() for res in per_rank for n in res["norms"]):
        problems.append(f"{label}: the engine reports no global norm "
                        f"(get_global_grad_norm() is None): judged by MOE-EP-1's trajectory")
    return problems


@pytest.mark.parametrize("accelerator, stage, k", EP_CELLS)
def test_expert_parallel_trains_like_ep1(accelerator: str, stage: int, k: int, metrics):
    """MOE-EP-1: ep_size = world size MUST train like ep_size = 1 (ZeRO 0-2, clipping on)."""
    runs = ep_runs(accelerator, stage, k)
    for quantity in ("loss", "grad", "param"):  # what an upgrade moves, inside the bound too
        worst = max(cmp.worst(quantity)[0] for cmp in ep_comparisons(runs, "", accelerator))
        metrics.record(f"moe.ep_{quantity}_max_abs_diff", worst, unit="1", better="lower",
                       stage=stage, k=k)
    problems = ep_problems(runs, f"z{stage}", accelerator)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("accelerator, stage, k", [c for c in EP_CELLS if c.values[1] > 0])
def test_clip_norm_counts_every_expert_once(accelerator: str, stage: int, k: int):
    """MOE-EP-2: the clipping norm MUST count every expert's gradient exactly once."""
    problems = norm_problems(ep_runs(accelerator, stage, k), f"z{stage}")
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------ MOE-CKPT-1

CKPT_STEPS, CKPT_MORE = 3, 3
CKPT_CELLS = [accel_cell(accel, stage, ws, id=f"z{stage}-ws{ws}", world_size=ws,
                         one_gpu=("tier" if ws == 1 else "covered") if accel == "cuda" else None,
                         slow=accel == "cuda" and ws == 1)
              for accel in ACCELERATORS for stage, ws in ((1, 2), (2, 1))
              if not (accel == "cpu" and ws == 1)]


def checkpoint_problems(results: list[dict[str, Any]], ep_size: int, accelerator: str
                        ) -> list[str]:
    """MOE-CKPT-1's judgement: one expert file per expert and layer, weights back bit for bit,
    and the resumed steps equal to the uninterrupted ones."""
    tol = tolerance("checkpoint", "fp32", "sgd", accelerator=accelerator)
    files = results[0]["files"]
    problems = []
    expert_ids = sorted({int(f.split("expert_")[1].split("_")[0]) for f in files})
    if expert_ids != list(range(moe_ranks.EXPERTS)):
        problems.append(f"the checkpoint holds expert files for experts {expert_ids}, not one "
                        f"for each of the {moe_ranks.EXPERTS} experts (files: {files})")
    for r, res in enumerate(results):
        if res["load_error"]:
            problems.append(f"rank {r}: the load failed: {res['load_error']}")
            continue
        if not any(k.startswith("momentum/") and v is not None for k, v in res["saved"].items()):
            problems.append(f"rank {r}: the saved engine holds no momentum buffer: the check "
                            f"could not see a load that drops the optimizer state")
        for label, a, b in (("loaded weights", res["loaded"], res["saved"]),
                            ("weights after the resumed steps", res["resumed_final"],
                             res["straight_final"])):
            cmp = compare_states(a, b, tol, label=f"ep_size={ep_size} {label}",
                                 where=f"rank {r}")
            if not cmp.ok:
                problems.append(cmp.report())
        if res["resumed"] != res["straight"]:
            problems.append(f"rank {r}: resumed losses {res['resumed']}, uninterrupted "
                            f"{res['straight']}")
    return problems


@pytest.mark.parametrize("accelerator, stage, world_size", CKPT_CELLS)
def test_checkpoint_round_trip(accelerator: str, stage: int, world_size: int, scratch):
    """MOE-CKPT-1: an MoE checkpoint MUST round-trip bit for bit and resume on its trajectory
    (ep_size = world size)."""
    results = run_ranks(moe_ranks.checkpoint_round_trip, world_size, timeout_s=TIMEOUT_S,
                        args=(world_size, stage, CKPT_STEPS, CKPT_MORE, MICRO_BATCH,
                              str(scratch / "moe_ckpt")), accelerator=accelerator)
    problems = checkpoint_problems(results, world_size, accelerator)
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------ MOE-A2A-1

# The dispatch buffer of one MoE layer per rank, fp32 [experts, capacity, hidden]: 8 experts x
# 512 slots x 1024 (16 MiB) and x 4096 (64 MiB), the sizes of a small and a large GPT-MoE layer.
A2A_SIZES = (8 * 512 * 1024 * 4, 8 * 512 * 4096 * 4)
A2A_ROUNDS = 3


@pytest.mark.parametrize("accelerator", [
    accel_cell("cuda", world_size=WORLD_SIZE, marks=[requires(two_ranks=TWO_RANKS)])])
def test_all_to_all_busbw(accelerator: str, profile, metrics):
    """MOE-A2A-1: all_to_all at MoE sizes MUST be exact and reach the profile's floor."""
    points = run_ranks(moe_ranks.all_to_all_busbw, WORLD_SIZE, timeout_s=TIMEOUT_S,
                       args=([(b, collectives.iterations(b, accelerator)) for b in A2A_SIZES],
                             A2A_ROUNDS, 2), accelerator=accelerator)[0]
    wrong = [p["bytes"] for p in points if not p["exact"]]
    factor = collectives.bus_factor("all_to_all", WORLD_SIZE)
    for p in points:
        floor = next((f.busbw_gbps for f in profile.nccl_floors
                      if f.collective == "all_to_all" and f.bytes == p["bytes"]
                      and f.world_size in (None, WORLD_SIZE)), None)
        metrics.record_rate("all_to_all.busbw", p["seconds"], amount=p["bytes"] * factor,
                            unit="GB/s", scale=GB, floor=floor, bytes=p["bytes"],
                            world_size=WORLD_SIZE, source="moe")
        metrics.record_rate("all_to_all.algbw", p["seconds"], amount=p["bytes"], unit="GB/s",
                            scale=GB, bytes=p["bytes"], world_size=WORLD_SIZE, source="moe")
    assert not wrong, f"all_to_all returned a wrong result at {wrong} bytes"
