"""Code that runs inside the ranks of suites/test_moe.py, and the plain-PyTorch reference of an
MoE layer the suite holds DeepSpeed's to.

The reference (``reference_moe``) computes from the gate's and the experts' weights what
DeepSpeed's ``deepspeed.moe.layer.MoE`` documents (GShard's top-1 and top-2 gating as DeepSpeed
implements it, ``deepspeed/moe/sharded_moe.py``): the softmax gate, each token's expert(s), the
capacity ``max(ceil(tokens / experts * capacity_factor * k), min_capacity)`` when tokens are
dropped, which tokens keep their slot (top-1: Random Token Selection keeps the tokens of highest
uniform priority, the draw ``torch.rand(tokens, experts)`` of the layer's RNG; top-2: first come,
first served, every first choice before any second choice), the combine weights (top-1: the
gate's probability; top-2: both probabilities normalised over the routes that kept their slot),
the auxiliary loss ``E * sum_e mean_gate_e * fraction_of_first_choices_e``, and the residual
variant's ``moe * c0 + mlp * c1`` with ``c = softmax(coefficient(x))``. It shares no code with
DeepSpeed's: loops over tokens and experts, no capacity buffers, no einsum.

Fault injection for the project's red tests, off by default:
- ``misroute=True`` (layer): the DeepSpeed gate sends token 0's first choice to the next expert.
- ``double_count_expert=True`` (expert parallelism, ZeRO 1-2): the optimizer's global gradient
  norm counts the first expert's gradient twice (its squared norm added once more before
  clipping).
- ``drop_expert_file=True`` (checkpoint): one expert file of the saved checkpoint is removed
  before the load; ``skip_optimizer_state=True``: the load leaves the optimizer state out.
"""

from __future__ import annotations

import gc
import math
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from dsconform.suite import (
    compat,
    cpu_fp32,
    device,
    ds_config,
    gather,
    rank,
    seed_everything,
    world,
)

HIDDEN = 8
EXPERTS = 4
FFN = 12
TOKENS = 32


def make_expert() -> nn.Module:
    return nn.Sequential(nn.Linear(HIDDEN, FFN), nn.GELU(), nn.Linear(FFN, HIDDEN))


# ---------------------------------------------------------------------------------------------
# The reference
# ---------------------------------------------------------------------------------------------

def reference_moe(x: torch.Tensor, gate_w: torch.Tensor, experts: list[nn.Module], *, k: int,
                  capacity_factor: float, min_capacity: int, drop_tokens: bool,
                  priority: torch.Tensor | None, mlp: nn.Module | None = None,
                  coefficient: nn.Module | None = None) -> dict[str, Any]:
    """The MoE layer's output, auxiliary loss, per-expert counts and kept routes for tokens
    ``x`` [S, M] (fp32). ``priority`` [S, E]: top-1's Random Token Selection draw."""
    tokens, num_experts = x.shape[0], gate_w.shape[0]
    gates = torch.softmax(x.float() @ gate_w.float().t(), dim=1)
    first = [int(torch.argmax(gates[t])) for t in range(tokens)]
    routes = [[e] for e in first]
    if k == 2:
        for t in range(tokens):
            rest = gates[t].clone()
            rest[first[t]] = -math.inf
            routes[t].append(int(torch.argmax(rest)))
    first_counts = [first.count(e) for e in range(num_experts)]
    capacity = None
    if drop_tokens:
        capacity = max(math.ceil(tokens / num_experts * capacity_factor * k), min_capacity)
    kept = [[True] * k for _ in range(tokens)]
    if capacity is not None and k == 1:
        for e in range(num_experts):
            mine = [t for t in range(tokens) if first[t] == e]
            mine.sort(key=lambda t: -float(priority[t, e]))
            for t in mine[capacity:]:
                kept[t][0] = False
    elif capacity is not None:
        slot = [0] * num_experts
        for choice in range(2):
            for t in range(tokens):
                e = routes[t][choice]
                kept[t][choice] = slot[e] < capacity
                slot[e] += 1
    out = torch.zeros_like(x, dtype=torch.float32)
    for t in range(tokens):
        weights = [float(gates[t, e]) if kept[t][c] else 0.0 for c, e in enumerate(routes[t])]
        if k == 2:
            denom = max(sum(weights), torch.finfo(torch.float32).eps)
            weights = [w / denom for w in weights]
        for c, e in enumerate(routes[t]):
            if kept[t][c]:
                out[t] += weights[c] * experts[e](x[t:t + 1].float())[0]
    mean_gate = gates.mean(dim=0)
    l_aux = num_experts * sum(float(mean_gate[e]) * first_counts[e] / tokens
                              for e in range(num_experts))
    if mlp is not None:
        c = torch.softmax(coefficient(x.float()), dim=-1)
        out = out * c[:, 0:1] + mlp(x.float()) * c[:, 1:]
    counts = [sum(1 for t in range(tokens) for e in routes[t] if e == x_e)
              for x_e in range(num_experts)]
    return {"output": out, "l_aux": l_aux, "exp_counts": counts, "capacity": capacity,
            "kept": {(t, routes[t][c]) for t in range(tokens) for c in range(k) if kept[t][c]},
            "routed": {(t, e) for t in range(tokens) for e in routes[t]}}


# ---------------------------------------------------------------------------------------------
# MOE-LAYER-1: DeepSpeed's layer on the reference's weights
# ---------------------------------------------------------------------------------------------

def _misroute(gate: nn.Module) -> None:
    """Fault injection: token 0's first choice goes to the next expert."""
    original = gate.forward

    def forward(inp, used_token=None, sparse_routes=False, use_tutel=False):
        l_aux, capacity, experts, indices, locations, gates, counts = original(
            inp, used_token, sparse_routes, use_tutel)
        if indices[0, 0] >= 0:
            indices = indices.clone()
            indices[0, 0] = (indices[0, 0] + 1) % experts
        return l_aux, capacity, experts, indices, locations, gates, counts

    gate.forward = forward


def _layer_cell(cell: dict[str, Any], misroute: bool) -> dict[str, Any]:
    from deepspeed.moe.layer import MoE

    dev = device()
    seed_everything(cell["seed"])
    layer = MoE(hidden_size=HIDDEN, expert=make_expert(), num_experts=EXPERTS, ep_size=1,
                k=cell["k"], capacity_factor=cell["capacity_factor"],
                min_capacity=cell["min_capacity"], use_residual=cell["residual"],
                drop_tokens=cell["drop_tokens"], use_rts=True,
                top2_2nd_expert_sampling=False).to(dev)
    gate = layer.deepspeed_moe.gate
    with torch.no_grad():  # a skewed gate: some experts get more than their capacity
        gate.wg.weight.mul_(cell["gate_scale"])
    if misroute:
        _misroute(gate)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(cell["seed"]))
    torch.manual_seed(cell["seed"] + 1)
    output, l_aux, exp_counts = layer(x.to(dev))
    # Which routes kept their slot, as DeepSpeed's gate decided them (the same draw again).
    torch.manual_seed(cell["seed"] + 1)
    with torch.no_grad():
        capacity, kept = compat.moe_gate_routes(gate, x.to(dev).float())
    torch.manual_seed(cell["seed"] + 1)
    priority = torch.rand(TOKENS, EXPERTS, device=dev).cpu()
    experts = [_cpu_copy(e) for e in layer.deepspeed_moe.experts.deepspeed_experts]
    with torch.no_grad():
        ref = reference_moe(
            x, cpu_fp32(gate.wg.weight), experts, k=cell["k"],
            capacity_factor=cell["capacity_factor"], min_capacity=cell["min_capacity"],
            drop_tokens=cell["drop_tokens"], priority=priority,
            mlp=_cpu_copy(layer.mlp) if cell["residual"] else None,
            coefficient=_cpu_copy(layer.coefficient) if cell["residual"] else None)
    return {"id": cell["id"], "output": cpu_fp32(output.detach()), "l_aux": float(l_aux),
            "exp_counts": [int(v) for v in exp_counts], "capacity": int(capacity),
            "kept": sorted(kept), "reference": {**ref, "output": ref["output"],
                                                "kept": sorted(ref["kept"]),
                                                "routed": sorted(ref["routed"])}}


def _cpu_copy(module: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(module).to("cpu", torch.float32)


def layer_cells(cells: list[dict[str, Any]], misroute: bool = False) -> list[dict[str, Any]]:
    """Rank entry point (one rank): every layer cell, DeepSpeed's result beside the
    reference's."""
    return [_layer_cell(cell, misroute) for cell in cells]


# ---------------------------------------------------------------------------------------------
# MOE-EP-1 / MOE-CKPT-1: a model with an MoE layer trained by the engine
# ---------------------------------------------------------------------------------------------

class MoEModel(nn.Module):
    """Linear -> MoE (top-k, a capacity that drops; top-1 with Random Token Selection, top-2
    with the second expert sampled, DeepSpeed's defaults) -> Linear."""

    def __init__(self, ep_size: int, k: int = 1) -> None:
        from deepspeed.moe.layer import MoE

        super().__init__()
        self.inp = nn.Linear(HIDDEN, HIDDEN)
        self.moe = MoE(hidden_size=HIDDEN, expert=make_expert(), num_experts=EXPERTS,
                       ep_size=ep_size, k=k, capacity_factor=1.0, min_capacity=1,
                       drop_tokens=True, use_rts=True)
        self.out = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, l_aux, _ = self.moe(self.inp(x))
        return self.out(y), l_aux


_EXPERT = re.compile(r"^(moe\.deepspeed_moe\.experts\.deepspeed_experts\.)(\d+)(\..*)$")


def global_name(name: str, ep_rank: int, local_experts: int) -> str:
    """A parameter's name in the ep_size = 1 model: local expert j of expert-parallel rank r is
    global expert r * local_experts + j."""
    m = _EXPERT.match(name)
    if not m:
        return name
    return f"{m.group(1)}{ep_rank * local_experts + int(m.group(2))}{m.group(3)}"


def initial_state() -> dict[str, torch.Tensor]:
    """The ep_size = 1 model's initial weights, the same on every rank and every run."""
    torch.manual_seed(1234)
    model = nn.ModuleDict({"inp": nn.Linear(HIDDEN, HIDDEN), "out": nn.Linear(HIDDEN, 1),
                           "gate": nn.Linear(HIDDEN, EXPERTS, bias=False)})
    experts = [make_expert() for _ in range(EXPERTS)]
    state = {f"{n}.{p}": v.detach().clone() for n in ("inp", "out")
             for p, v in model[n].state_dict().items()}
    state["moe.deepspeed_moe.gate.wg.weight"] = model["gate"].weight.detach().clone() * 3.0
    for e, expert in enumerate(experts):
        for p, v in expert.state_dict().items():
            state[f"moe.deepspeed_moe.experts.deepspeed_experts.{e}.{p}"] = v.detach().clone()
    return state


def _load_initial(model: MoEModel, ep_size: int, ep_rank: int) -> None:
    state = initial_state()
    local = EXPERTS // ep_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(state[global_name(name, ep_rank, local)])


def batches(steps: int, micro_batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's data: its own inputs and targets, the same for every ep_size."""
    g = torch.Generator().manual_seed(100 + rank())
    w = torch.randn(HIDDEN, 1, generator=torch.Generator().manual_seed(7))
    out = []
    for _ in range(steps):
        x = torch.randn(micro_batch, HIDDEN, generator=g)
        out.append((x, torch.tanh(x @ w)))
    return out


def _engine(ep_size: int, stage: int, clip: float, lr: float, micro_batch: int,
            momentum: float = 0.0, k: int = 1):
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    model = MoEModel(ep_size, k)
    ep_rank = rank() % ep_size
    _load_initial(model, ep_size, ep_rank)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "parameters"})
    config = ds_config(stage=stage, dtype="fp32", optimizer="sgd", lr=lr,
                       micro_batch=micro_batch, grad_accum=1, world_size=world(),
                       gradient_clipping=clip, momentum=momentum)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    return engine, ep_rank


def _double_count_first_expert(engine: Any) -> None:
    """Fault injection: the global norm the ZeRO 1-2 optimizer clips with counts expert 0's
    gradient twice (its squared norm added once more on the rank that holds it)."""
    from deepspeed.utils import safe_get_full_grad

    opt = engine.optimizer
    if not hasattr(opt, "scaled_global_norm"):
        raise ValueError("double_count_expert needs ZeRO stage 1 or 2 (the optimizer's norm)")
    first = [p for n, p in engine.module.named_parameters()
             if n.startswith("moe.deepspeed_moe.experts.deepspeed_experts.0.")]
    original = opt.scaled_global_norm

    def extra() -> float:
        if rank() % _ep_size(engine) != 0:
            return 0.0
        return sum(float(safe_get_full_grad(p).float().pow(2).sum()) for p in first)

    def scaled_global_norm(norm_type: int = 2):
        norm = original(norm_type)
        return torch.sqrt(norm.float() ** 2 + extra()).to(norm.dtype)

    opt.scaled_global_norm = scaled_global_norm


def _ep_size(engine: Any) -> int:
    return engine.module.moe.ep_size


def train_ep(ep_size: int, stage: int, steps: int, micro_batch: int, clip: float, lr: float,
             double_count_expert: bool = False, k: int = 1) -> dict[str, Any]:
    """Rank entry point: ``steps`` SGD steps of the MoE model with ``ep_size``; this rank's
    losses, its gradients and final weights under their ep_size = 1 names (its own experts
    only), and the norm the engine clipped with."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    seed_everything(0)
    engine, ep_rank = _engine(ep_size, stage, clip, lr, micro_batch, k=k)
    local = EXPERTS // ep_size
    if double_count_expert:
        _double_count_first_expert(engine)
    dev = device()
    named = list(engine.module.named_parameters())
    losses, grads, norms = [], [], []
    try:
        for step, (x, y) in enumerate(batches(steps, micro_batch)):
            # The gate's random draws (Random Token Selection, top-2's second expert).
            torch.manual_seed(1000 * step + rank())
            pred, l_aux = engine(x.to(dev))
            loss = F.mse_loss(pred.float(), y.to(dev)) + 0.01 * l_aux
            engine.backward(loss)
            grads.append({global_name(n, ep_rank, local): cpu_fp32(safe_get_full_grad(p))
                          for n, p in named})
            engine.step()
            norm = engine.get_global_grad_norm()
            norms.append(None if norm is None else float(norm))
            losses.append(loss.item())
        params = {}
        for n, p in named:
            full = safe_get_full_fp32_param(p)
            params[global_name(n, ep_rank, local)] = cpu_fp32(p.data if full is None else full)
        return {"rank": rank(), "ep_rank": ep_rank, "losses": losses, "grads": grads,
                "params": params, "norms": norms}
    finally:
        engine.destroy()
        del engine
        gc.collect()


# ---------------------------------------------------------------------------------------------
# MOE-CKPT-1
# ---------------------------------------------------------------------------------------------

def _state(engine: Any) -> dict[str, Any]:
    """What the checkpoint must carry, by name: every weight (the fp32 master where ZeRO keeps
    one), this rank's SGD momentum buffers (ZeRO's flat partitions, by group), and the step
    counter."""
    from deepspeed.utils import safe_get_full_fp32_param

    out: dict[str, Any] = {"engine/global_steps": engine.global_steps}
    for n, p in engine.module.named_parameters():
        full = safe_get_full_fp32_param(p)
        out[n] = cpu_fp32(p.data if full is None else full).clone()
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    for g, group in enumerate(inner.param_groups):
        for i, p in enumerate(group["params"]):
            buf = inner.state.get(p, {}).get("momentum_buffer")
            out[f"momentum/{g}.{i}"] = None if buf is None else cpu_fp32(buf).clone()
    return out


def expert_files(ckpt_dir: str) -> list[str]:
    """The expert files of a checkpoint's tag directories (``*expert_*_model_states.pt``)."""
    return sorted(str(p.relative_to(ckpt_dir)) for p in Path(ckpt_dir).rglob("*expert_*.pt"))


def checkpoint_round_trip(ep_size: int, stage: int, steps: int, more: int, micro_batch: int,
                          ckpt_dir: str, drop_expert_file: bool = False,
                          skip_optimizer_state: bool = False) -> dict[str, Any]:
    """Rank entry point: train ``steps``, save, train ``more`` (the uninterrupted run), then a
    fresh engine loads the checkpoint and trains the same ``more`` steps."""
    seed_everything(0)
    data = batches(steps + more, micro_batch)
    dev = device()

    def train(engine: Any, part: list, first_step: int) -> list[float]:
        losses = []
        for i, (x, y) in enumerate(part):
            torch.manual_seed(1000 * (first_step + i) + rank())
            pred, l_aux = engine(x.to(dev))
            loss = F.mse_loss(pred.float(), y.to(dev)) + 0.01 * l_aux
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses

    # SGD with momentum: the resumed steps need the optimizer state the checkpoint holds.
    engine, _ = _engine(ep_size, stage, 0.0, 0.05, micro_batch, momentum=0.9)
    try:
        train(engine, data[:steps], 0)
        engine.save_checkpoint(ckpt_dir, tag="moe")
        saved = _state(engine)
        straight = train(engine, data[steps:], steps)
        straight_final = _state(engine)
    finally:
        engine.destroy()
        del engine
    import torch.distributed as tdist

    tdist.barrier()
    files = expert_files(ckpt_dir)
    if drop_expert_file and rank() == 0:
        os.remove(os.path.join(ckpt_dir, files[-1]))
    tdist.barrier()
    fresh, _ = _engine(ep_size, stage, 0.0, 0.05, micro_batch, momentum=0.9)
    try:
        with torch.no_grad():  # the fresh engine must get everything from the checkpoint
            for p in fresh.module.parameters():
                p.add_(0.5)
        error = None
        try:
            fresh.load_checkpoint(ckpt_dir, tag="moe",
                                  load_optimizer_states=not skip_optimizer_state)
        except Exception as e:  # the load refused a damaged checkpoint: say so, compare nothing
            error = f"{type(e).__name__}: {e}"
        if any(gather(error)):  # every rank stops, none waits in a collective for another
            return {"rank": rank(), "files": files, "load_error": error or "another rank's "
                    "load failed"}
        loaded = _state(fresh)
        resumed = train(fresh, data[steps:], steps)
        resumed_final = _state(fresh)
    finally:
        fresh.destroy()
        del fresh
        gc.collect()
    return {"rank": rank(), "files": files, "saved": saved, "loaded": loaded,
            "straight": straight, "resumed": resumed, "straight_final": straight_final,
            "resumed_final": resumed_final, "load_error": None}


# ---------------------------------------------------------------------------------------------
# MOE-A2A-1
# ---------------------------------------------------------------------------------------------

def all_to_all_busbw(points: list[tuple[int, int]], rounds: int, warmup: int
                     ) -> list[dict[str, Any]]:
    """Rank entry point: all_to_all_single of fp32 buffers of each size in bytes (the buffer an
    MoE layer sends: every rank's [experts, capacity, hidden] block) for each (bytes, calls per
    round) point, checked once on known data, then timed ``rounds`` rounds of back-to-back calls
    after ``warmup`` calls. A round's seconds per call are its slowest rank's. The
    suite measures on GPUs; the project's tests run it on the CPU accelerator."""
    import time

    import torch.distributed as tdist

    dev = device()
    n = world()
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    out = []
    for size, iters in points:
        count = size // 4 // n * n
        chunk = count // n

        def values(src: int, first: int, length: int) -> torch.Tensor:
            # Small integers (exact in fp32) that name the sender and the element.
            idx = torch.arange(first, first + length, dtype=torch.int64, device=dev)
            return ((idx * 7 + src * 13) % 4093).to(torch.float32)

        send = values(rank(), 0, count)
        recv = torch.empty_like(send)
        tdist.all_to_all_single(recv, send)
        expected = torch.cat([values(r, rank() * chunk, chunk) for r in range(n)])
        exact = bool(torch.equal(recv, expected))
        for _ in range(warmup):
            tdist.all_to_all_single(recv, send)
        times = []
        for _ in range(rounds):
            sync()
            tdist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                tdist.all_to_all_single(recv, send)
            sync()
            elapsed = torch.tensor([(time.perf_counter() - t0) / iters], device=dev)
            tdist.all_reduce(elapsed, op=tdist.ReduceOp.MAX)
            times.append(float(elapsed))
        out.append({"bytes": count * 4, "seconds": times, "exact": exact})
    return out
