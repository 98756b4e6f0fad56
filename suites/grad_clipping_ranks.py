"""The code that runs inside the ranks of suites/test_grad_clipping.py: DeepSpeed's gradient-norm
and clipping helpers (``deepspeed.runtime.utils``) and torch's ``clip_grad_norm_`` on the same
gradients, side by side.

Gradients are drawn from the cell's seed, the same on every rank, with sizes that are no
multiple of anything (1, 53, 13 x 7, 4103) and magnitudes over six decades, one element far
above the rest so the inf-norm has a clear maximum. With ``sharded``, every rank keeps only its
slice (dim 0) of each tensor, marked model-parallel, and DeepSpeed is handed a model-parallel
unit over all ranks: its norm over the slices must be torch's norm over the whole tensors.
"""

from __future__ import annotations

import math
from typing import Any

import torch

SIZES = ((1,), (53,), (13, 7), (4103,))


def gradients(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape in SIZES:
        t = torch.randn(shape, generator=g, dtype=torch.float32)
        t *= 10.0 ** torch.randint(-3, 3, shape, generator=g).float()
        out.append(t)
    out[2].view(-1)[5] = 250.0  # the inf-norm's maximum, in a 2-D tensor
    return out


class WorldModelParallel:
    """A model-parallel unit spanning every rank (as Megatron's mpu exposes it)."""

    def get_model_parallel_group(self) -> Any:
        import torch.distributed as dist

        return dist.group.WORLD

    def get_model_parallel_rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank()

    def get_model_parallel_world_size(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size()

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size


def _params(grads: list[torch.Tensor], dev: torch.device, shard: tuple[int, int] | None) -> list:
    params = []
    for g in grads:
        if shard is not None:
            if g.shape[0] < shard[1] and shard[0] != 0:
                continue  # too short to slice: rank 0 holds all of it
            g = g.chunk(shard[1], dim=0)[shard[0]] if g.shape[0] >= shard[1] else g
        p = torch.nn.Parameter(torch.zeros_like(g, device=dev))
        p.grad = g.to(dev).clone()
        if shard is not None:
            p.model_parallel = True  # DeepSpeed's is_model_parallel_parameter
            p.tensor_model_parallel = True
        params.append(p)
    return params


def _flat(params: list) -> torch.Tensor:
    return torch.cat([p.grad.detach().reshape(-1).to("cpu", torch.float64) for p in params])


def norms(norm_type: float, seed: int, sharded: bool = False,
          tamper: str | None = None) -> dict[str, Any]:
    """Rank entry point: {"torch": (total norm, clipped gradients as one float64 vector),
    "helpers": {name: total norm}, "clipped": {name: clipped gradients}} for one norm type.
    DeepSpeed's helpers see this rank's gradients (its slices, where ``sharded``); torch sees
    the whole tensors. ``tamper="wrong_norm_type"`` hands DeepSpeed the 2-norm whatever was asked
    (what a helper that ignores its argument does)."""
    from deepspeed.runtime import utils as ds_utils

    from dsconform.suite import device, rank, world

    dev = device()
    grads = gradients(seed)
    reference = _params(grads, dev, None)
    total = float(torch.linalg.vector_norm(_flat(reference), norm_type))
    max_norm = total / 2  # every helper must clip, by 0.5
    torch_total = float(torch.nn.utils.clip_grad_norm_(reference, max_norm, norm_type=norm_type))
    ds_type = 2.0 if tamper == "wrong_norm_type" else norm_type
    shard = (rank(), world()) if sharded else None
    mpu = WorldModelParallel() if sharded else None

    helpers: dict[str, float] = {}
    clipped: dict[str, torch.Tensor] = {}
    ps = _params(grads, dev, shard)
    helpers["get_flattened_grad_norm"] = float(ds_utils.get_flattened_grad_norm(
        ps, norm_type=ds_type, mpu=mpu))
    helpers["get_global_norm_of_tensors"] = float(ds_utils.get_global_norm_of_tensors(
        [p.grad for p in ps], norm_type=ds_type, mpu=mpu))
    helpers["clip_grad_norm_"] = float(ds_utils.clip_grad_norm_(ps, max_norm, norm_type=ds_type,
                                                                mpu=mpu))
    clipped["clip_grad_norm_"] = _flat(ps)
    if norm_type == 2 and not sharded:
        # The 2-norm-only helpers: a global norm from per-tensor norms, and clipping by it.
        helpers["get_global_norm"] = float(ds_utils.get_global_norm(
            [float(p.grad.norm()) for p in _params(grads, dev, None)]))
        tensors = [p.grad for p in _params(grads, dev, None)]
        helpers["clip_tensors_by_global_norm"] = float(ds_utils.clip_tensors_by_global_norm(
            tensors, max_norm=max_norm))
        clipped["clip_tensors_by_global_norm"] = torch.cat(
            [t.reshape(-1).to("cpu", torch.float64) for t in tensors])
    want = _flat(reference)
    if sharded:  # the slices this rank holds, in the same order
        want = _flat(_params([p.grad.cpu() for p in reference], torch.device("cpu"), shard))
    return {"rank": rank(), "torch_norm": torch_total, "max_norm": max_norm,
            "helpers": helpers, "clipped": clipped, "torch_clipped": want,
            "finite": math.isfinite(torch_total)}
