"""Functional checks of the compute ops (cpu_adam, fused_adam, cpu_adagrad, cpu_lion): a few
real steps on real data, each compared after every step with torch's own optimizer under the
one tolerance table (dsconform.checks.tolerances); AssertionError with values on a wrong
result. Each DeepSpeed optimizer loads its op as it is made: dsconform.ops.checks.check_op loads
it first, so that an op that does not load says why."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def _assert_close_step(check: str, step: int, params: Sequence[Any], refs: Sequence[Any],
                       tol: Any) -> tuple[float, float]:
    """Compare every parameter after `step` with the one comparator (dsconform.checks.equivalence)
    under the one tolerance table's entry; AssertionError naming step, parameter and numbers."""
    from dsconform.checks.equivalence import tensor_difference

    worst_abs = worst_rel = 0.0
    for i, (p, r) in enumerate(zip(params, refs)):
        max_abs, max_rel, ok = tensor_difference(p, r, tol)
        worst_abs, worst_rel = max(worst_abs, max_abs), max(worst_rel, max_rel)
        if not ok:
            raise AssertionError(f"{check}: step {step}, parameter {i} ({p.numel()} elements): "
                                 f"max abs diff {max_abs:.3e}, max rel diff {max_rel:.3e} vs the "
                                 f"torch reference; tolerance {tol} ({tol.why})")
    return worst_abs, worst_rel


def _gradient(n: int, gen: Any) -> Any:
    """N(0, 1) gradients whose magnitudes span 10 decades (each element times 10**-u, u uniform
    in [0, 10)): a fifth of them sit at or below eps, so a wrong eps fails
    (docs/findings.md#optimizer-ops); with N(0, 1) alone eps 0 passed."""
    import torch

    return torch.randn(n, generator=gen) * torch.pow(10.0, -10.0 * torch.rand(n, generator=gen))


def _run_optimizer_pair(check: str, make_opt: Callable[[list], Any],
                        make_ref: Callable[[list], Any] | None,
                        ref_step: Callable[[list, list, int], None] | None, *, steps: int,
                        sizes: Sequence[int], device: str = "cpu", seed: int = 0) -> dict[str, Any]:
    """Step an optimizer and its reference on identical parameters and gradients; compare each step
    (uneven ``sizes`` exercise SIMD tails and partition padding)."""
    import torch

    from dsconform.checks.tolerances import tolerance
    tol = tolerance("op", "fp32", check, accelerator="cuda" if str(device).startswith("cuda")
                    else "cpu")
    gen = torch.Generator().manual_seed(seed)
    initial = [torch.randn(n, generator=gen) for n in sizes]
    params = [torch.nn.Parameter(t.clone().to(device)) for t in initial]
    refs = [torch.nn.Parameter(t.clone().to(device)) for t in initial]
    opt = make_opt(params)
    ref_opt = make_ref(refs) if make_ref else None
    worst_abs = worst_rel = 0.0
    for step in range(1, steps + 1):
        grads = [_gradient(n, gen) for n in sizes]
        for p, r, g in zip(params, refs, grads):
            p.grad, r.grad = g.clone().to(device), g.clone().to(device)
        opt.step()
        if ref_opt is not None:
            ref_opt.step()
        else:
            ref_step(refs, grads, step)
        a, r = _assert_close_step(check, step, params, refs, tol)
        worst_abs, worst_rel = max(worst_abs, a), max(worst_rel, r)
    # A no-op optimizer would match a no-op reference: make sure the parameters moved.
    moved = max(float((p.detach().cpu() - p0).abs().max()) for p, p0 in zip(params, initial))
    if moved == 0.0:
        raise AssertionError(f"{check}: parameters did not change after the steps")
    return {"steps": steps, "elements": list(sizes), "device": str(device),
            "max_abs_diff": worst_abs, "max_rel_diff": worst_rel, "rtol": tol.rtol,
            "atol": tol.atol, "max_param_change": moved}


def _check_adam(op: str, make: Callable[..., Any], device: str, adamw_mode: bool,
                weight_decay: float, tamper: Callable[[Any], None] | None) -> dict[str, Any]:
    """``make(params, adamw_mode, **hp)``, a DeepSpeed Adam, against torch.optim.AdamW (adamw_mode:
    decoupled weight decay) or torch.optim.Adam (weight decay as an L2 term added to the
    gradient), same hyperparameters, on ``device``. weight_decay and adamw_mode are passed on both
    sides: DeepSpeed defaults to AdamW with weight_decay 0, torch's AdamW to weight_decay 0.01."""
    import torch
    hp = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay)
    ref_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    def make_opt(ps: list) -> Any:  # the red tests' ``tamper`` perturbs it before its first step
        opt = make(ps, adamw_mode, **hp)
        if tamper is not None:
            tamper(opt)
        return opt

    result = _run_optimizer_pair(op, make_opt, lambda ps: ref_cls(ps, **hp), None, steps=5,
                                 sizes=(53, 4103), device=device)
    return {"op": op, "reference": ref_cls.__name__, "adamw_mode": adamw_mode, **hp, **result}


def check_cpu_adam(*, adamw_mode: bool = True, weight_decay: float = 0.01,
                   tamper: Callable[[Any], None] | None = None) -> dict[str, Any]:
    """DeepSpeedCPUAdam against torch (_check_adam)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    return _check_adam("cpu_adam", lambda ps, adamw, **hp: DeepSpeedCPUAdam(
        ps, adamw_mode=adamw, bias_correction=True, **hp), "cpu", adamw_mode, weight_decay, tamper)


def check_fused_adam(device: str = "cpu", *, adamw_mode: bool = True, weight_decay: float = 0.01,
                     tamper: Callable[[Any], None] | None = None) -> dict[str, Any]:
    """deepspeed.ops.adam.FusedAdam on `device` against torch on the same device (_check_adam)."""
    from deepspeed.ops.adam import FusedAdam
    return _check_adam("fused_adam", lambda ps, adamw, **hp: FusedAdam(
        ps, adam_w_mode=adamw, bias_correction=True, **hp), device, adamw_mode, weight_decay,
        tamper)


def check_adam_modes(check: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """``check`` (check_cpu_adam or check_fused_adam, with ``args``) in both of its modes, each
    with weight decay 0.01: AdamW (decoupled decay) against torch AdamW, and Adam with the decay
    as an L2 term of the gradient (what ZeRO-Offload's ``"type": "Adam"`` with
    ``"weight_decay"`` runs) against torch Adam(weight_decay=...). The result is the AdamW run's
    keys with the worst differences of both, and each run under ``modes``."""
    runs = [check(*args, adamw_mode=True), check(*args, adamw_mode=False)]
    return {**runs[0], "reference": " and ".join(r["reference"] for r in runs),
            "adamw_mode": [r["adamw_mode"] for r in runs],
            "max_abs_diff": max(r["max_abs_diff"] for r in runs),
            "max_rel_diff": max(r["max_rel_diff"] for r in runs),
            "max_param_change": min(r["max_param_change"] for r in runs), "modes": runs}


def check_cpu_adagrad() -> dict[str, Any]:
    """DeepSpeedCPUAdagrad against torch.optim.Adagrad (lr_decay 0, initial accumulator 0)."""
    import torch
    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    hp = dict(lr=1e-2, eps=1e-10, weight_decay=0.01)
    result = _run_optimizer_pair(
        "cpu_adagrad", lambda ps: DeepSpeedCPUAdagrad(ps, **hp),
        lambda ps: torch.optim.Adagrad(ps, lr_decay=0, initial_accumulator_value=0, **hp), None,
        steps=5, sizes=(53, 4103))
    return {"op": "cpu_adagrad", "reference": "Adagrad", **hp, **result}


def check_cpu_lion() -> dict[str, Any]:
    """DeepSpeedCPULion against Lion written out (Chen et al. 2023, Algorithm 2);
    torch has no Lion."""
    import torch
    from deepspeed.ops.lion import DeepSpeedCPULion
    lr, betas, weight_decay, momenta = 1e-3, (0.9, 0.99), 0.01, {}

    def lion_reference(refs: list, grads: list, step: int) -> None:
        b1, b2 = betas
        with torch.no_grad():
            for i, (p, g) in enumerate(zip(refs, grads)):
                m = momenta.setdefault(i, torch.zeros_like(g))
                update = torch.sign(b1 * m + (1 - b1) * g)
                p.mul_(1 - lr * weight_decay).add_(update, alpha=-lr)
                m.mul_(b2).add_(g, alpha=1 - b2)

    result = _run_optimizer_pair(
        "cpu_lion", lambda ps: DeepSpeedCPULion(ps, lr=lr, betas=betas, weight_decay=weight_decay),
        None, lion_reference, steps=5, sizes=(53, 4103))
    return {"op": "cpu_lion", "reference": "Lion (written out)", "lr": lr, "betas": betas,
            "weight_decay": weight_decay, **result}
