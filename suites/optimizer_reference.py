"""The references of suites/test_optimizers.py: what each optimizer DeepSpeed configures from the
config's ``"optimizer"`` section must do to a parameter, given the gradient DeepSpeed gave it.

Where torch has the optimizer (Adam, AdamW, Adagrad, the client optimizer), the reference IS
torch's: ``torch.optim`` stepped on fp32 copies of the parameters. Where torch has none (Lion,
LAMB), the published update rule is written out below in plain tensor arithmetic, one parameter
at a time, in float64 so the reference adds no rounding of its own worth comparing.

Both kinds share one interface (``Reference``): built from parameter groups of named fp32
tensors, stepped with a gradient per name, read back as parameters and as optimizer state under
the state names DeepSpeed's optimizers use.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

# The config "type" of each kind, and the hyperparameters every group shares. A group's own lr
# and weight_decay come from the model's parameter groups (optimizer_ranks.GROUPS).
BETAS = (0.9, 0.99)
EPS = 1e-8


def lion_step(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, *, lr: float,
              betas: tuple[float, float], weight_decay: float) -> None:
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2),
    in place: c = b1 m + (1 - b1) g; p <- p (1 - lr wd) - lr sign(c); m <- b2 m + (1 - b2) g.
    The weight decay is decoupled (AdamW's way), applied before the signed step."""
    b1, b2 = betas
    c = b1 * m + (1 - b1) * g
    p.mul_(1 - lr * weight_decay).add_(torch.sign(c), alpha=-lr)
    m.mul_(b2).add_(g, alpha=1 - b2)


def lamb_step(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int, *,
              lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
              max_coeff: float, min_coeff: float) -> None:
    """LAMB (You et al. 2020, "Large Batch Optimization for Deep Learning", Algorithm 2) as
    DeepSpeed's FusedLamb documents it (bias correction on, eps outside the root, the trust ratio
    ||p|| / ||u|| clamped to [min_coeff, max_coeff], 1 where either norm is 0), in place:
    m <- b1 m + (1 - b1) g; v <- b2 v + (1 - b2) g^2; u = m^ / (sqrt(v^) + eps) + wd p;
    p <- p - lr r u."""
    b1, b2 = betas
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    m_hat = m / (1 - b1 ** step)
    v_hat = v / (1 - b2 ** step)
    u = m_hat / (v_hat.sqrt() + eps) + weight_decay * p
    w_norm, u_norm = float(p.norm()), float(u.norm())
    ratio = 1.0 if w_norm == 0 or u_norm == 0 else min(max(w_norm / u_norm, min_coeff),
                                                         max_coeff)
    p.add_(u, alpha=-lr * ratio)


class Reference:
    """One optimizer's reference over named fp32 parameters in parameter groups.

    ``groups``: [{"names": [...], "lr": ..., "weight_decay": ...}]; ``initial``: name -> tensor.
    ``kind`` picks the rule: "adam" (torch Adam, L2 decay), "adamw" (torch AdamW), "adagrad"
    (torch Adagrad), "client" (torch RAdam, the client optimizer's own class), "lion" and
    "lamb" (written out above).
    """

    WRITTEN_OUT = ("lion", "lamb")

    def __init__(self, kind: str, groups: Sequence[Mapping[str, Any]],
                 initial: Mapping[str, torch.Tensor], hyper: Mapping[str, Any]):
        self.kind = kind
        self.hyper = dict(hyper)
        dtype = torch.float64 if kind in self.WRITTEN_OUT else torch.float32
        self.params = {n: t.detach().to("cpu", dtype).clone() for n, t in initial.items()}
        self.groups = [dict(g) for g in groups]
        self.steps = 0
        self.state: dict[str, dict[str, torch.Tensor]] = {
            n: {"exp_avg": torch.zeros_like(t), "exp_avg_sq": torch.zeros_like(t)}
            for n, t in self.params.items()}
        self.torch_opt = None
        if kind not in self.WRITTEN_OUT:
            for p in self.params.values():
                p.requires_grad_(True)
            torch_groups = [{"params": [self.params[n] for n in g["names"]], "lr": g["lr"],
                             "weight_decay": g["weight_decay"]} for g in groups]
            self.torch_opt = torch_optimizer(kind, torch_groups, self.hyper)

    def step(self, grads: Mapping[str, torch.Tensor]) -> None:
        self.steps += 1
        if self.torch_opt is not None:
            for n, p in self.params.items():
                p.grad = grads[n].detach().to("cpu", torch.float32).clone()
            self.torch_opt.step()
            return
        for g in self.groups:
            for n in g["names"]:
                p, s = self.params[n], self.state[n]
                grad = grads[n].detach().to("cpu", torch.float64)
                with torch.no_grad():
                    if self.kind == "lion":
                        lion_step(p, grad, s["exp_avg"], lr=g["lr"], betas=self.hyper["betas"],
                                  weight_decay=g["weight_decay"])
                    else:
                        lamb_step(p, grad, s["exp_avg"], s["exp_avg_sq"], self.steps,
                                  lr=g["lr"], betas=self.hyper["betas"], eps=self.hyper["eps"],
                                  weight_decay=g["weight_decay"],
                                  max_coeff=self.hyper["max_coeff"],
                                  min_coeff=self.hyper["min_coeff"])

    def parameters(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().to(torch.float32).clone() for n, p in self.params.items()}

    def optimizer_state(self, keys: Sequence[str]) -> dict[str, torch.Tensor]:
        """"<param>/<key>" -> the reference's state tensor, for each state key DeepSpeed's
        optimizer of this kind keeps (torch's own names where torch is the reference)."""
        out = {}
        for n, p in self.params.items():
            for k in keys:
                if self.torch_opt is not None:
                    value = self.torch_opt.state[p][TORCH_STATE_KEYS.get((self.kind, k), k)]
                else:
                    value = self.state[n][k]
                out[f"{n}/{k}"] = value.detach().to(torch.float32).clone()
        return out


# A DeepSpeed state name whose torch counterpart is named otherwise: DeepSpeedCPUAdagrad keeps
# torch Adagrad's "sum" as "exp_avg_sq".
TORCH_STATE_KEYS = {("adagrad", "exp_avg_sq"): "sum"}


def torch_optimizer(kind: str, groups: list[dict[str, Any]],
                    hyper: Mapping[str, Any]) -> torch.optim.Optimizer:
    """The torch optimizer of a kind, built on ``groups`` with the suite's hyperparameters:
    the reference of DeepSpeed's Adam (L2) / AdamW / Adagrad, and the client optimizer itself.
    foreach=False: torch's single-tensor loop, the plainest evaluation of its rule."""
    if kind == "adam":
        return torch.optim.Adam(groups, betas=hyper["betas"], eps=hyper["eps"], foreach=False)
    if kind == "adamw":
        return torch.optim.AdamW(groups, betas=hyper["betas"], eps=hyper["eps"], foreach=False)
    if kind == "adagrad":
        return torch.optim.Adagrad(groups, eps=hyper["eps"], lr_decay=0.0,
                                   initial_accumulator_value=0.0, foreach=False)
    if kind == "client":
        return torch.optim.RAdam(groups, betas=hyper["betas"], eps=hyper["eps"], foreach=False)
    raise ValueError(f"no torch optimizer for kind {kind!r}")

