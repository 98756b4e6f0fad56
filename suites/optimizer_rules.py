"""The references of suites/test_optimizers.py: each optimizer's published update rule written
out (Lion, LAMB in FusedLamb's form, Muon with its AdamW), and ``Reference``, which steps them or
torch's own optimizer beside DeepSpeed's (suites/optimizer_ranks.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

# The suite these rules belong to (suites/test_optimizers.py).
CAPABILITY = "optimizers"

# The config "type" of each kind, and the hyperparameters every group shares. A group's own lr
# and weight_decay come from the model's parameter groups (optimizer_ranks.GROUPS).
BETAS = (0.9, 0.99)
EPS = 1e-8


def lion_step(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, *, lr: float,
              betas: tuple[float, float], weight_decay: float) -> None:
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2),
    in place: c = b1 m + (1 - b1) g; p <- p (1 - lr wd) - lr sign(c); m <- b2 m + (1 - b2) g.
    The weight decay is decoupled (AdamW's way), applied before the signed step.

    c and m are evaluated in fp32, the precision of DeepSpeed's Lion state, each as one product
    and one fused multiply-add: sign(c) has no tolerance, and bf16 gradients meet exact ties
    (b1 m = -(1 - b1) g in exact arithmetic) that another precision breaks the other way. An
    exact zero stays sign 0."""
    b1, b2 = (torch.tensor(b, dtype=torch.float32) for b in betas)

    def fma(a: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # a * x + y rounded once to fp32 (the fp32 product is exact in float64)
        return (a.double() * x.double() + y.double()).float()

    g32, m32 = g.float(), m.float()
    c = fma(g32, 1 - b1, m32 * b1)
    p.mul_(1 - lr * weight_decay).add_(torch.sign(c).to(p.dtype), alpha=-lr)
    m.copy_(fma(g32, 1 - b2, m32 * b2))


def lamb_step(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int, *,
              lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
              max_coeff: float, min_coeff: float) -> float:
    """LAMB (You et al. 2020, "Large Batch Optimization for Deep Learning", Algorithm 2) in the
    form DeepSpeed's FusedLamb computes it (csrc/lamb/fused_lamb_cuda_kernel.cu, bias correction
    on, eps outside the root), in place:
    m <- b1 m + (1 - b1) g; v <- b2 v + (1 - b2) g^2; u = m / (sqrt(v) + eps) + wd p;
    r = ||p|| / ||u|| clamped to [min_coeff, max_coeff] (1 where either norm is 0);
    p <- p - lr sqrt(1 - b2^t) / (1 - b1^t) r u.
    Where the paper divides the moments by their bias corrections before u, FusedLamb folds the
    corrections into the step size: eps then meets the uncorrected root, and the trust ratio and
    the decay term are those of the uncorrected u. Without decay and with eps far below sqrt(v)
    the two forms agree (the ratio cancels the scale of u); otherwise they differ by more than
    rounding (docs/suites.md, OPT-RULE-1). Returns the trust ratio r."""
    u = lamb_update(p, g, m, v, betas=betas, eps=eps, weight_decay=weight_decay)
    r = trust_ratio(float(p.norm()), float(u.norm()), max_coeff=max_coeff, min_coeff=min_coeff)
    p.add_(u, alpha=-lamb_step_size(lr, betas, step) * r)
    return r


def lamb_update(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *,
                betas: tuple[float, float], eps: float, weight_decay: float) -> torch.Tensor:
    """LAMB's moments updated in place, and its uncorrected update u (lamb_step)."""
    b1, b2 = betas
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    return m / (v.sqrt() + eps) + weight_decay * p


def trust_ratio(w_norm: float, u_norm: float, *, max_coeff: float, min_coeff: float) -> float:
    """LAMB's trust ratio ||p|| / ||u||, clamped; 1 where either norm is 0."""
    if w_norm == 0 or u_norm == 0:
        return 1.0
    return min(max(w_norm / u_norm, min_coeff), max_coeff)


def lamb_step_size(lr: float, betas: tuple[float, float], step: int) -> float:
    """lr with FusedLamb's bias corrections folded in."""
    return lr * (1 - betas[1] ** step) ** 0.5 / (1 - betas[0] ** step)


def zero_partitions(sizes: Sequence[int], stage: int, world_size: int,
                    alignment_factor: int = 2) -> list[list[tuple[int, int, int]]]:
    """The flat fp32 partitions ZeRO hands its optimizer for one parameter group of tensors of
    ``sizes`` elements (in the group's order), one per rank, each as (tensor index, start,
    end) element ranges of the flattened tensors. Stages 1/2 flatten the group, pad it to a
    multiple of alignment_factor x world size and split it evenly; stage 3 splits each tensor
    evenly (padded to a multiple of the world size) and joins a rank's pieces. Padding holds
    zeros, which no norm sees."""
    parts: list[list[tuple[int, int, int]]] = [[] for _ in range(world_size)]
    if stage == 3:
        for i, n in enumerate(sizes):
            chunk = -(-n // world_size)
            for r in range(world_size):
                lo, hi = min(n, r * chunk), min(n, (r + 1) * chunk)
                if hi > lo:
                    parts[r].append((i, lo, hi))
        return parts
    align = alignment_factor * world_size
    total = sum(sizes)
    chunk = -(-total // align) * align // world_size
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    for r in range(world_size):
        lo, hi = r * chunk, (r + 1) * chunk
        for i, (off, n) in enumerate(zip(offsets, sizes)):
            a, b = max(lo, off), min(hi, off + n)
            if b > a:
                parts[r].append((i, a - off, b - off))
    return parts


# Muon's quintic Newton-Schulz coefficients (a, b, c), its iteration count and momentum.
NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
MUON_MOMENTUM = 0.95


def newton_schulz5(g: torch.Tensor, steps: int = NS_STEPS,
                   coeffs: tuple[float, float, float] = NS_COEFFS) -> torch.Tensor:
    """Muon's orthogonalisation (Keller Jordan, https://kellerjordan.github.io/posts/muon/ ,
    ``zeropower_via_newtonschulz5``), in float64: X = G / (||G||_F + 1e-7), transposed when tall;
    ``steps`` times A = X X^T, X <- a X + (b A + c A^2) X."""
    a, b, c = coeffs
    x = g.to(torch.float64)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        A = x @ x.mT
        x = a * x + (b * A + c * A @ A) @ x
    return x.mT if tall else x


def muon_step(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, *, lr: float, momentum: float,
              weight_decay: float, ns_steps: int = NS_STEPS) -> None:
    """Muon (Keller Jordan 2024, https://kellerjordan.github.io/posts/muon/ ,
    https://github.com/KellerJordan/Muon ``muon_update``), for a 2-D weight, in place:
    m <- beta m + (1 - beta) g; u = (1 - beta) g + beta m (Nesterov); u <- NS5(u)
    sqrt(max(1, rows / cols)); p <- p (1 - lr wd) - lr u."""
    m.lerp_(g, 1 - momentum)
    u = newton_schulz5(g.lerp(m, momentum), ns_steps)
    u = u * max(1.0, p.size(-2) / p.size(-1)) ** 0.5
    p.mul_(1 - lr * weight_decay).add_(u, alpha=-lr)


def aux_adam_step(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int,
                  *, lr: float, betas: tuple[float, float], eps: float,
                  weight_decay: float) -> None:
    """The AdamW Muon's published ``MuonWithAuxAdam`` applies to every parameter Muon does not
    take (biases, gains, embeddings; ``adam_update`` there), in place: bias-corrected moments,
    eps outside the root, decoupled weight decay."""
    b1, b2 = betas
    m.lerp_(g, 1 - b1)
    v.lerp_(g * g, 1 - b2)
    u = (m / (1 - b1 ** step)) / ((v / (1 - b2 ** step)).sqrt() + eps)
    p.mul_(1 - lr * weight_decay).add_(u, alpha=-lr)


def takes_muon(name: str, shape: Sequence[int]) -> bool:
    """Which parameters Muon takes (deepspeed.set_optimizer_flags): matrices (2-D or more) but
    embeddings and the output head ("embed" / "lm_head" in the name); Adam takes the rest."""
    return len(shape) >= 2 and not any(k in name.lower() for k in ("embed", "lm_head"))


class Reference:
    """One optimizer's reference over named fp32 parameters in parameter groups.

    ``groups``: [{"names": [...], "lr": ..., "weight_decay": ...}]; ``initial``: name -> tensor.
    ``kind`` picks the rule: "adam" (torch Adam, L2 decay), "adamw" (torch AdamW), "adagrad"
    (torch Adagrad), "client" (torch RAdam, the client optimizer's own class), "lion", "lamb"
    and "muon" (written out above).
    """

    WRITTEN_OUT = ("lion", "lamb", "muon")

    def __init__(self, kind: str, groups: Sequence[Mapping[str, Any]],
                 initial: Mapping[str, torch.Tensor], hyper: Mapping[str, Any],
                 flat_partitions: tuple[int, int] | None = None):
        self.kind = kind
        #: (ZeRO stage, world size): LAMB's trust ratio taken over each rank's flat partition of
        #: a group (zero_partitions), the way FusedLamb sees ZeRO's partitions, not per tensor.
        self.flat_partitions = flat_partitions
        #: With flat_partitions: per step, the trust ratios it took, one per partition (in
        #: the groups' order), and those LAMB takes, one per tensor; for a diagnosis.
        self.ratios: list[dict[str, list[float]]] = []
        self.hyper = dict(hyper)
        dtype = torch.float64 if kind in self.WRITTEN_OUT else torch.float32
        self.params = {n: t.detach().to("cpu", dtype).clone() for n, t in initial.items()}
        self.groups = [dict(g) for g in groups]
        self.steps = 0
        self.state: dict[str, dict[str, torch.Tensor]] = {
            n: {"exp_avg": torch.zeros_like(t), "exp_avg_sq": torch.zeros_like(t),
                "momentum_buffer": torch.zeros_like(t)}
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
        if self.kind == "lamb" and self.flat_partitions is not None:
            self.ratios.append({"flat": [], "per_tensor": []})
        for g in self.groups:
            if self.kind == "lamb" and self.flat_partitions is not None:
                self._flat_lamb_step(g, grads)
                continue
            for n in g["names"]:
                p, s = self.params[n], self.state[n]
                grad = grads[n].detach().to("cpu", torch.float64)
                with torch.no_grad():
                    if self.kind == "muon" and takes_muon(n, p.shape):
                        muon_step(p, grad, s["momentum_buffer"], lr=g["lr"],
                                  momentum=self.hyper["momentum"],
                                  weight_decay=g["weight_decay"])
                    elif self.kind == "muon":
                        aux_adam_step(p, grad, s["exp_avg"], s["exp_avg_sq"], self.steps,
                                      lr=g["lr"], betas=self.hyper["betas"],
                                      eps=self.hyper["eps"], weight_decay=g["weight_decay"])
                    elif self.kind == "lion":
                        lion_step(p, grad, s["exp_avg"], lr=g["lr"], betas=self.hyper["betas"],
                                  weight_decay=g["weight_decay"])
                    else:
                        lamb_step(p, grad, s["exp_avg"], s["exp_avg_sq"], self.steps,
                                  lr=g["lr"], betas=self.hyper["betas"], eps=self.hyper["eps"],
                                  weight_decay=g["weight_decay"],
                                  max_coeff=self.hyper["max_coeff"],
                                  min_coeff=self.hyper["min_coeff"])

    def _flat_lamb_step(self, g: Mapping[str, Any], grads: Mapping[str, torch.Tensor]) -> None:
        """One LAMB step of group g with one trust ratio per flat ZeRO partition."""
        names = list(g["names"])
        updates = {}
        with torch.no_grad():
            for n in names:
                s = self.state[n]
                updates[n] = lamb_update(
                    self.params[n], grads[n].detach().to("cpu", torch.float64), s["exp_avg"],
                    s["exp_avg_sq"], betas=self.hyper["betas"], eps=self.hyper["eps"],
                    weight_decay=g["weight_decay"]).flatten()
            stage, world_size = self.flat_partitions
            size = lamb_step_size(g["lr"], self.hyper["betas"], self.steps)
            coeffs = {"max_coeff": self.hyper["max_coeff"], "min_coeff": self.hyper["min_coeff"]}
            self.ratios[-1]["per_tensor"] += [
                trust_ratio(float(self.params[n].norm()), float(updates[n].norm()), **coeffs)
                for n in names]
            flat = {n: self.params[n].view(-1) for n in names}
            for part in zero_partitions([flat[n].numel() for n in names], stage, world_size):
                w = torch.cat([flat[names[i]][a:b] for i, a, b in part])
                u = torch.cat([updates[names[i]][a:b] for i, a, b in part])
                ratio = trust_ratio(float(w.norm()), float(u.norm()), **coeffs)
                self.ratios[-1]["flat"].append(ratio)
                for i, a, b in part:
                    flat[names[i]][a:b] -= size * ratio * updates[names[i]][a:b]

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
