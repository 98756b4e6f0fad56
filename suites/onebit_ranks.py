"""Code that runs inside the ranks of suites/test_onebit.py (2 GPUs, nccl, DeepSpeed 0.19.6).

Nothing here imports DeepSpeed's 1-bit modules at import time: on DeepSpeed >= 0.19.7 they do
not exist, and the suite reports that through its gate, never as an ImportError.

The task is deterministic: a fixed teacher network labels a fixed batch per rank (no label noise,
no sampling), and each step is one full-batch step on it. So a loss curve depends only on the
optimizer, the dtype and the 1-bit compression, and two runs of the same case give the same
curve.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import nn

from dsconform.suite import ds_config

_TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
# Which attribute of each 1-bit optimizer says "compressed stage" (DeepSpeed 0.19.6 source).
_STAGE_FLAG = {"OnebitAdam": "adam_freeze_key", "ZeroOneAdam": "freeze_key",
               "OnebitLamb": "lamb_freeze_key"}


@dataclass(frozen=True)
class OnebitRun:
    """One training run; everything a rank needs to reproduce it."""
    optimizer: str         # ds_config's: "adam" (baseline), "onebit_adam", "zero_one_adam",
    #                        "onebit_lamb" (its own baseline with freeze_step past the run)
    dtype: str             # "fp32" or "fp16"
    lr: float
    steps: int
    freeze_step: int       # onebit_adam/onebit_lamb: freeze_step; zero_one_adam: var_freeze_step
    seed: int = 20261130
    d_in: int = 32
    width: int = 64
    d_out: int = 8
    batch: int = 128       # per rank, fixed for the whole run
    world_size: int = 2

    @property
    def id(self) -> str:
        return f"{self.optimizer}-{self.dtype}-lr{self.lr:g}-freeze{self.freeze_step}"

    def with_(self, **changes: Any) -> OnebitRun:
        return replace(self, **changes)

    def params(self) -> dict[str, Any]:
        return asdict(self)

    def config(self) -> dict[str, Any]:
        fp16: dict[str, Any] = {}
        if self.dtype == "fp16":
            # Dynamic (1-bit LAMB asserts it), starting at scale 1 and never growing within a run
            # (window 1000 > steps): DeepSpeed 0.19.6 never scales the loss on stage 0 yet divides
            # the gradients by the scale (docs/findings.md#loss-scaling, upstream #8393); at 1
            # that cannot change the maths, so this suite measures compression, not that bug.
            fp16 = {"loss_scale": 0.0, "initial_scale_power": 0, "loss_scale_window": 1000}
        onebit: dict[str, Any] = {}
        if self.optimizer in ("onebit_adam", "onebit_lamb"):
            onebit = {"freeze_step": self.freeze_step}
        elif self.optimizer == "zero_one_adam":
            onebit = {"var_freeze_step": self.freeze_step}
        return ds_config(stage=0, dtype=self.dtype, optimizer=self.optimizer, lr=self.lr,
                         micro_batch=self.batch, grad_accum=1, world_size=self.world_size,
                         gradient_clipping=0.0, weight_decay=0.0, **fp16, **onebit)


class MLP(nn.Module):
    def __init__(self, d_in: int, width: int, d_out: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, width)
        self.fc2 = nn.Linear(width, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def task(run: OnebitRun, rank_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's fixed batch: inputs N(0, 1), targets from a fixed teacher (an MLP of the
    student's shape with its own seed), on the CPU in fp32."""
    g = torch.Generator().manual_seed(run.seed * 7919 + rank_index)
    torch.manual_seed(run.seed + 1)  # the teacher: the same on every rank
    teacher = MLP(run.d_in, run.width, run.d_out)
    with torch.no_grad():
        for p in teacher.parameters():
            p.mul_(2.0)  # a teacher the student's initialisation is far from
        x = torch.randn(run.batch, run.d_in, generator=g)
        y = teacher(x)
    return x, y


def squared_error(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Squared error summed over a sample's outputs, averaged over the batch, in fp32: per-output
    gradients 2 (out - y) / batch stay well inside fp16's normal range where the loss is small
    (DeepSpeed 0.19.6 does not scale the loss on stage 0)."""
    return ((out.float() - y) ** 2).sum(dim=1).mean()


def student(run: OnebitRun) -> nn.Module:
    torch.manual_seed(run.seed)  # every rank starts from the same weights
    return MLP(run.d_in, run.width, run.d_out)


def _stage(engine: Any) -> dict[str, Any]:
    opt = engine.basic_optimizer
    flag = _STAGE_FLAG.get(type(opt).__name__)
    return {"optimizer_class": type(opt).__name__,
            "compressed": bool(getattr(opt, flag)) if flag else False,
            "backward_allreduce": bool(engine.enable_backward_allreduce)}


class Compressed:
    """A pass-through counter on an engine's compressed allreduce: how many calls, and how many
    elements went through it in each optimizer step (``end_step`` closes a step). Proves the
    compressed stage really communicated every parameter's momentum compressed, every step."""

    def __init__(self) -> None:
        self.calls = 0
        self.elements = 0            # in the step under way
        self.per_step: list[int] = []

    def attach(self, engine: Any) -> Compressed:
        handle = getattr(engine.basic_optimizer, "comm_backend_handle", None)
        if handle is None:
            return self
        original = handle.compressed_allreduce

        def counted(buffer: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            self.elements += buffer.numel()
            return original(buffer, *args, **kwargs)

        handle.compressed_allreduce = counted
        return self

    def end_step(self) -> None:
        self.per_step.append(self.elements)
        self.elements = 0

    def result(self, engine: Any) -> dict[str, Any]:
        return {"compressed_calls": self.calls, "compressed_elements": self.per_step,
                "param_elements": sum(p.numel() for p in engine.module.parameters()
                                      if p.requires_grad)}


def _train(engine: Any, x: torch.Tensor, y: torch.Tensor, steps: int,
           trace: dict[str, list], counter: Compressed | None = None) -> None:
    for _ in range(steps):
        start = time.perf_counter()
        out = engine(x)
        loss = squared_error(out, y)
        engine.backward(loss)
        engine.step()
        trace["losses"].append(loss.item())  # .item() waits for the step's kernels too
        trace["seconds"].append(time.perf_counter() - start)
        if counter is not None:
            counter.end_step()


def _digest(engine: Any) -> torch.Tensor:
    """The model's weights, flat, on the CPU: replicas must be identical."""
    return torch.cat([p.detach().float().reshape(-1).cpu() for p in engine.module.parameters()])


@contextlib.contextmanager
def _engine(run: OnebitRun) -> Iterator[tuple[Any, torch.Tensor, torch.Tensor]]:
    import deepspeed

    from dsconform.suite import device, rank

    dev = torch.device(device())
    model = student(run).to(dev)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=run.config())
    try:
        x, y = task(run, rank())
        yield engine, x.to(dev, _TORCH_DTYPES[run.dtype]), y.to(dev)
    finally:
        engine.destroy()
        del engine
        gc.collect()


def train(run: OnebitRun) -> dict[str, Any]:
    """Rank entry point: one run from scratch. Returns this rank's losses and step times, its
    weights at the end, the optimizer's stage and how many compressed allreduces it made."""
    from dsconform.suite import seed_everything

    seed_everything(run.seed)
    trace: dict[str, list] = {"losses": [], "seconds": []}
    with _engine(run) as (engine, x, y):
        counter = Compressed().attach(engine)
        _train(engine, x, y, run.steps, trace, counter)
        return {**trace, "weights": _digest(engine), "stage": _stage(engine),
                **counter.result(engine)}


def error_buffers(engine: Any) -> dict[str, Any]:
    """Where each 1-bit optimizer keeps its compression errors (DeepSpeed 0.19.6): OneBitAdam and
    ZeroOneAdam per parameter state ("worker_error", "server_error"; 0/1 Adam also its local
    step buffer "momentum_accumulator"), OneBitLamb in the lists worker_errors/server_errors.
    Returns how many buffers exist and the largest magnitude in them."""
    opt = engine.basic_optimizer
    tensors = []
    if type(opt).__name__ == "OnebitLamb":
        tensors = list(opt.worker_errors) + list(opt.server_errors)
    else:
        for state in opt.state.values():
            tensors += [state[k] for k in ("worker_error", "server_error",
                                           "momentum_accumulator") if k in state]
    largest = max((float(t.abs().max()) for t in tensors if t.numel()), default=0.0)
    return {"count": len(tensors), "max_abs": largest}


def train_save_resume(run: OnebitRun, save_at: int, checkpoint_dir: str) -> dict[str, Any]:
    """Rank entry point: train ``save_at`` steps (into the compressed stage) and save a
    checkpoint; continue the same engine to ``run.steps`` (the uninterrupted run); then a fresh
    engine loads the checkpoint and trains the same remaining steps (the resumed run).

    Returns both runs' losses (the resumed run's first is the loss of the loaded weights on the
    step the uninterrupted run took after the save), the error buffers at the save, right after
    the load and at the end, the stage after the load, the weights at the save and right after
    the load, both runs' weights at the end, and what the resumed run compressed per step.
    """
    import deepspeed.comm as dist

    from dsconform.suite import seed_everything

    seed_everything(run.seed)
    first: dict[str, list] = {"losses": [], "seconds": []}
    with _engine(run) as (engine, x, y):
        _train(engine, x, y, save_at, first)
        at_save = error_buffers(engine)
        stage_at_save = _stage(engine)
        weights_at_save = _digest(engine)
        engine.save_checkpoint(checkpoint_dir, tag="compressed")
        dist.barrier()
        _train(engine, x, y, run.steps - save_at, first)
        uninterrupted = {**first, "weights": _digest(engine), "errors_end": error_buffers(engine)}
    resumed: dict[str, list] = {"losses": [], "seconds": []}
    with _engine(run) as (engine, x, y):
        load_path, _ = engine.load_checkpoint(checkpoint_dir, tag="compressed")
        after_load = error_buffers(engine)
        stage_after_load = _stage(engine)
        step_after_load = int(engine.global_steps)
        weights_after_load = _digest(engine)
        counter = Compressed().attach(engine)
        _train(engine, x, y, run.steps - save_at, resumed, counter)
        resumed_out = {**resumed, "weights": _digest(engine), "errors_end": error_buffers(engine),
                       "stage_end": _stage(engine), **counter.result(engine)}
    return {"uninterrupted": uninterrupted, "resumed": resumed_out, "errors_at_save": at_save,
            "stage_at_save": stage_at_save, "errors_after_load": after_load,
            "stage_after_load": stage_after_load, "step_after_load": step_after_load,
            "weights_at_save": weights_at_save, "weights_after_load": weights_after_load,
            "loaded": load_path is not None}


# ------------------------------------------------------------------ the compressed allreduce

def round_input(seed: int, round_index: int, rank_index: int, shape: tuple[int, ...]
                ) -> torch.Tensor:
    """Rank ``rank_index``'s buffer in round ``round_index``: N(0, 1), from a CPU generator, so
    the parent can tell what every rank had."""
    g = torch.Generator().manual_seed(seed * 104729 + round_index * 1009 + rank_index)
    return torch.randn(shape, generator=g)


def _nccl_backend() -> Any:
    from deepspeed.runtime.comm.nccl import NcclBackend

    return NcclBackend(mpu=None)


def compressed_allreduce_rounds(shape: tuple[int, ...], rounds: int, seed: int) -> list[dict]:
    """Rank entry point: ``rounds`` calls of DeepSpeed's NcclBackend.compressed_allreduce on
    N(0, 1) buffers, with the error buffers carried from round to round as the optimizers carry
    them. Returns, per round, this rank's error buffers before and after and its output."""
    from dsconform.suite import device, onebit_reference, rank, world

    dev = torch.device(device())
    backend = _nccl_backend()
    numel = 1
    for n in shape:
        numel *= n
    padded = onebit_reference.padded_numel(numel, world())
    worker = torch.zeros(padded, device=dev)
    server = torch.zeros(padded // world(), device=dev)
    trace = []
    for t in range(rounds):
        before = (worker.cpu().clone(), server.cpu().clone())
        buf = round_input(seed, t, rank(), shape).to(dev)
        out = backend.compressed_allreduce(buf, worker, server, dev.index)
        trace.append({"worker_before": before[0], "server_before": before[1],
                      "output": out.detach().cpu().clone(), "worker": worker.cpu().clone(),
                      "server": server.cpu().clone()})
    return trace


class WireCount:
    """Counts the bytes each torch.distributed collective puts on the wire from this rank while
    the ``with`` block runs (nccl-tests' bus factors: all_to_all sends (n-1)/n of its input,
    all_gather n-1 times its input, all_reduce 2(n-1)/n), whoever calls it: deepspeed.comm
    passes through torch.distributed's functions, and a call straight to torch.distributed is
    seen too. A collective without a factor here is listed in ``uncounted`` (the caller fails
    on it rather than report a ratio that missed bytes). Only the outermost collective of a
    nested call counts. Everything is passed through unchanged."""

    # name -> (the argument whose bytes travel, bytes on the wire per byte of it, world size n)
    FACTORS = {"all_to_all_single": ("input", lambda n: (n - 1) / n),
               "all_gather": ("tensor", lambda n: n - 1),
               "all_gather_into_tensor": ("input_tensor", lambda n: n - 1),
               "all_reduce": ("tensor", lambda n: 2 * (n - 1) / n),
               "broadcast": ("tensor", lambda n: 1.0),
               "send": ("tensor", lambda n: 1.0),
               "isend": ("tensor", lambda n: 1.0)}
    OTHERS = ("all_to_all", "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather",
              "scatter", "recv", "irecv", "batch_isend_irecv", "all_gather_object",
              "broadcast_object_list", "gather_object", "scatter_object_list",
              "all_reduce_coalesced", "all_gather_coalesced", "_all_gather_base",
              "_reduce_scatter_base")

    def __init__(self, world_size: int) -> None:
        self._n = world_size
        self.bytes = 0.0
        self.calls: dict[str, int] = {}
        self.uncounted: set[str] = set()
        self._depth = 0
        self._saved: list[tuple[Any, str, Any]] = []

    def _wrap(self, name: str, original: Any) -> Any:
        import functools
        import inspect

        factor = self.FACTORS.get(name)
        signature = inspect.signature(original)

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._depth == 0:
                self.calls[name] = self.calls.get(name, 0) + 1
                if factor is None:
                    self.uncounted.add(name)
                else:
                    tensor = signature.bind(*args, **kwargs).arguments[factor[0]]
                    self.bytes += tensor.numel() * tensor.element_size() * factor[1](self._n)
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    def __enter__(self) -> WireCount:
        import torch.distributed as tdist
        import torch.distributed.distributed_c10d as c10d

        wrapped: dict[int, Any] = {}
        for module in (tdist, c10d):
            for name in (*self.FACTORS, *self.OTHERS):
                original = getattr(module, name, None)
                if original is None:
                    continue
                if id(original) not in wrapped:
                    wrapped[id(original)] = self._wrap(name, original)
                self._saved.append((module, name, original))
                setattr(module, name, wrapped[id(original)])
        return self

    def __exit__(self, *exc: Any) -> None:
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved.clear()


def _timed(op: Any, iters: int, rounds: int, dev: torch.device) -> list[float]:
    """Seconds per call, one value per round, the slowest rank's (every rank returns the same)."""
    import torch.distributed as tdist

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    for _ in range(2):  # warm-up: cupy compiles its kernels, NCCL sets up its channels
        op()
    sync()
    per_call = []
    for _ in range(rounds):
        tdist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            op()
        sync()
        elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64,
                               device=dev)
        tdist.all_reduce(elapsed, op=tdist.ReduceOp.MAX)
        per_call.append(float(elapsed.item()))
    return per_call


def allreduce_cost(numel: int, iters: int, rounds: int) -> dict[str, Any]:
    """Rank entry point: seconds per call of DeepSpeed's compressed allreduce and of a plain
    fp32 all_reduce of the same buffer, and the bytes each put on the wire from this rank (the
    compressed one counted on one untimed call, see WireCount)."""
    import torch.distributed as tdist

    from dsconform.suite import device, onebit_reference, world

    dev = torch.device(device())
    backend = _nccl_backend()
    n = world()
    padded = onebit_reference.padded_numel(numel, n)
    source = torch.randn(numel, device=dev)
    buf = torch.empty_like(source)
    worker = torch.zeros(padded, device=dev)
    server = torch.zeros(padded // n, device=dev)

    with WireCount(n) as counting:
        buf.copy_(source)
        backend.compressed_allreduce(buf, worker, server, dev.index)

    def compressed() -> None:
        # The call works in place on its input: both timings include the same refill.
        buf.copy_(source)
        backend.compressed_allreduce(buf, worker, server, dev.index)

    def plain() -> None:
        buf.copy_(source)
        tdist.all_reduce(buf)

    seconds_compressed = _timed(compressed, iters, rounds, dev)
    seconds_plain = _timed(plain, iters, rounds, dev)
    return {"compressed_seconds": seconds_compressed, "plain_seconds": seconds_plain,
            "compressed_bytes": counting.bytes, "calls": counting.calls,
            "uncounted": sorted(counting.uncounted),
            "plain_bytes": 2 * (n - 1) / n * numel * 4}
