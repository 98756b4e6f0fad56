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
            # the gradients by the scale (FINDINGS, upstream #8393); at 1 that cannot change the
            # maths, so this suite measures compression, not that bug.
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


def _count_compressed_calls(engine: Any, counter: list[int]) -> None:
    """A pass-through counter on this engine's compressed allreduce: proves the compressed stage
    really communicated compressed, as often as the run says."""
    handle = getattr(engine.basic_optimizer, "comm_backend_handle", None)
    if handle is None:
        return
    original = handle.compressed_allreduce

    def counted(*args: Any, **kwargs: Any) -> Any:
        counter[0] += 1
        return original(*args, **kwargs)

    handle.compressed_allreduce = counted


def _train(engine: Any, x: torch.Tensor, y: torch.Tensor, steps: int,
           trace: dict[str, list]) -> None:
    for _ in range(steps):
        start = time.perf_counter()
        out = engine(x)
        loss = squared_error(out, y)
        engine.backward(loss)
        engine.step()
        trace["losses"].append(loss.item())  # .item() waits for the step's kernels too
        trace["seconds"].append(time.perf_counter() - start)


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
    calls = [0]
    with _engine(run) as (engine, x, y):
        _count_compressed_calls(engine, calls)
        _train(engine, x, y, run.steps, trace)
        return {**trace, "weights": _digest(engine), "stage": _stage(engine),
                "compressed_calls": calls[0]}


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

    Returns both runs' losses, the error buffers at the save, right after the load and at the
    end, the stage after the load, and both runs' weights at the end.
    """
    import deepspeed.comm as dist

    from dsconform.suite import seed_everything

    seed_everything(run.seed)
    first: dict[str, list] = {"losses": [], "seconds": []}
    with _engine(run) as (engine, x, y):
        _train(engine, x, y, save_at, first)
        at_save = error_buffers(engine)
        stage_at_save = _stage(engine)
        engine.save_checkpoint(checkpoint_dir, tag="compressed")
        dist.barrier()
        _train(engine, x, y, run.steps - save_at, first)
        uninterrupted = {**first, "weights": _digest(engine), "errors_end": error_buffers(engine)}
    resumed: dict[str, list] = {"losses": [], "seconds": []}
    calls = [0]
    with _engine(run) as (engine, x, y):
        load_path, _ = engine.load_checkpoint(checkpoint_dir, tag="compressed")
        after_load = error_buffers(engine)
        stage_after_load = _stage(engine)
        step_after_load = int(engine.global_steps)
        _count_compressed_calls(engine, calls)
        _train(engine, x, y, run.steps - save_at, resumed)
        resumed_out = {**resumed, "weights": _digest(engine), "errors_end": error_buffers(engine),
                       "stage_end": _stage(engine), "compressed_calls": calls[0]}
    return {"uninterrupted": uninterrupted, "resumed": resumed_out, "errors_at_save": at_save,
            "stage_at_save": stage_at_save, "errors_after_load": after_load,
            "stage_after_load": stage_after_load, "step_after_load": step_after_load,
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


class _CountingComm:
    """Stands in front of deepspeed.comm for one call of compressed_allreduce and adds up the
    bytes each collective puts on the wire from this rank (nccl-tests' bus factors: all_to_all
    and all_gather send (n-1)/n of their output). Everything is passed through unchanged."""

    COUNTED = ("all_to_all_single", "all_gather")

    def __init__(self, comm: Any, world_size: int) -> None:
        self._comm = comm
        self._n = world_size
        self.bytes = 0.0
        self.calls: dict[str, int] = {}
        self.uncounted: set[str] = set()

    def _add(self, name: str, nbytes: float) -> None:
        self.bytes += nbytes
        self.calls[name] = self.calls.get(name, 0) + 1

    def all_to_all_single(self, output: torch.Tensor, tensor: torch.Tensor, *args: Any,
                          **kwargs: Any) -> Any:
        self._add("all_to_all_single",
                  tensor.numel() * tensor.element_size() * (self._n - 1) / self._n)
        return self._comm.all_to_all_single(output, tensor, *args, **kwargs)

    def all_gather(self, tensor_list: list, tensor: torch.Tensor, *args: Any,
                   **kwargs: Any) -> Any:
        self._add("all_gather", tensor.numel() * tensor.element_size() * (self._n - 1))
        return self._comm.all_gather(tensor_list, tensor, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._comm, name)
        collective = ("all_", "reduce", "broadcast", "send", "recv", "gather", "scatter")
        if callable(value) and name.startswith(collective) and name not in self.COUNTED:
            self.uncounted.add(name)  # a collective this count does not understand
        return value


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
    compressed one counted on one untimed call, see _CountingComm)."""
    import deepspeed.runtime.comm.nccl as nccl_module
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

    counting = _CountingComm(nccl_module.dist, n)
    nccl_module.dist = counting
    try:
        buf.copy_(source)
        backend.compressed_allreduce(buf, worker, server, dev.index)
    finally:
        nccl_module.dist = counting._comm

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
