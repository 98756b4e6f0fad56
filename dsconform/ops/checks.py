"""Build, load and exercise DeepSpeed ops for real.

ds_report's "compatible" only says a probe passed: on the reference H200 node every op printed
[OKAY] while every JIT build failed (TORCH_CUDA_ARCH_LIST=9.0a). So the suite builds each op it
cares about, loads it, makes one small real call and compares the result with a reference.

- `extensions_dir` / `ensure_extensions_dir`: a torch-extensions cache per environment. torch keys
  its cache by directory only, so two environments sharing one rebuild each other's ops.
- `load_op`: build + load with the compiler's output captured; never raises.
- `check_*` / `check_op`: minimal real calls with measured numbers; AssertionError with values on a
  wrong result, `OpUnavailable` when the op does not load.

Units: bytes and seconds; GB/s means 1e9 bytes per second.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import json
import os
import re
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsconform.node.detect import dist_version, shm_bytes
from dsconform.ops.diagnose import Diagnosis, diagnose, format_failure
from dsconform.ops.dsreport import strip_ansi

GB = 1e9  # GB/s is 1e9 bytes per second everywhere in dsconform
LOG_TAIL_LINES = 40
LOG_LINE_CHARS = 600  # verbose ninja prints compiler command lines thousands of characters long
# Lines that start the story of a failed build; not "\berror\b", which matches flags like
# -Wno-error.
ERROR_LINE_RE = re.compile(r"\berror:|fatal error|FAILED:|undefined reference|cannot find -l|"
                           r": not found$", re.I)

# --------------------------------------------------------------------------------------------
# The extensions cache, keyed by environment


def _torch_variant(torch_version: str | None, *, installed: bool = True) -> str:
    """cpu / cuXYZ / rocmX.Y / xpu, read without importing torch.

    Wheels from download.pytorch.org carry it as the local version ("2.13.0+cpu", "2.11.0+cu130");
    the default PyPI wheel does not ("2.11.0"), so fall back to torch/version.py, read as text.
    """
    if torch_version and "+" in torch_version:
        return torch_version.split("+", 1)[1]
    if not installed:  # a version string of some other environment, without its label
        return "unknown"
    try:
        text = Path(importlib.metadata.distribution("torch")
                    .locate_file("torch/version.py")).read_text()
    except (importlib.metadata.PackageNotFoundError, OSError):
        return "unknown"
    for attr, prefix in (("hip", "rocm"), ("cuda", "cu")):
        m = re.search(rf"^{attr}\s*(?::[^=]*)?=\s*['\"]([\d.]+)['\"]", text, re.M)
        if m:
            return prefix + "".join(m[1].split(".")[:2])
    return "cpu"


def environment_key(*, torch_version: str | None = None, deepspeed_version: str | None = None,
                    python: tuple[int, int] | None = None) -> str:
    """py311-torch2.13.0-ds0.19.8-cpu: what an op binary built here depends on.

    The arguments describe another environment (default: this one, from package metadata, without
    importing torch or DeepSpeed).
    """
    torch_v = torch_version or dist_version("torch")
    ds_v = deepspeed_version or dist_version("deepspeed") or "none"
    major, minor = python or sys.version_info[:2]
    # abiflags: a free-threaded 3.13t interpreter cannot load a 3.13 build
    py = f"py{major}{minor}{sys.abiflags}"
    key = (f"{py}-torch{(torch_v or 'none').split('+')[0]}-ds{ds_v}-"
           f"{_torch_variant(torch_v, installed=torch_version is None)}")
    if deepspeed_version is None:
        # Two installs of one version (two virtualenvs, a tox env, an offline --target site)
        # rebuilt each other's ops and timed out at rank start-up: the install's location is
        # part of what a build belongs to.
        key += f"-{_install_tag('deepspeed')}"
    return re.sub(r"[^A-Za-z0-9._-]", "_", key)


def _install_tag(dist: str) -> str:
    """Eight hex digits naming where ``dist`` is installed (its package directory)."""
    import hashlib
    import importlib.util

    spec = importlib.util.find_spec(dist)
    where = str(Path(spec.origin).resolve().parent) if spec and spec.origin else "none"
    return hashlib.sha256(where.encode()).hexdigest()[:8]


def extensions_dir() -> Path:
    """$DSCONFORM_CACHE (default ~/.cache/dsconform)/torch_extensions/<environment_key()>."""
    root = os.environ.get("DSCONFORM_CACHE") or Path.home() / ".cache" / "dsconform"
    return Path(root) / "torch_extensions" / environment_key()


def ensure_extensions_dir() -> Path:
    """Point TORCH_EXTENSIONS_DIR at `extensions_dir()` unless the user set it; create;
    return it."""
    if not os.environ.get("TORCH_EXTENSIONS_DIR"):
        os.environ["TORCH_EXTENSIONS_DIR"] = str(extensions_dir())
    path = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    path.mkdir(parents=True, exist_ok=True)
    return path


# --------------------------------------------------------------------------------------------
# Builders


def op_builders() -> dict[str, str]:
    """op name -> builder class name, for the accelerator DeepSpeed picked in this process.

    From DeepSpeed's ALL_OPS, which holds what `get_accelerator().create_op_builder` gives for every
    builder of that accelerator: on the CPU accelerator `fused_adam` is a CPU implementation and
    there is no `gds`.
    """
    from deepspeed.ops.op_builder.all_ops import ALL_OPS
    return {name: type(builder).__name__ for name, builder in ALL_OPS.items()}


def __getattr__(name: str) -> Any:
    # OP_BUILDERS is computed on first use: importing deepspeed (and torch) costs seconds, and
    # extensions_dir() must work without them.
    if name == "OP_BUILDERS":
        return op_builders()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _create_builder(name: str) -> Any:
    from deepspeed.accelerator import get_accelerator
    builders = op_builders()
    if name not in builders:
        raise KeyError(f"op {name!r} is not provided by DeepSpeed's "
                       f"{get_accelerator()._name} accelerator "
                       f"(its ops: {', '.join(sorted(builders))})")
    return get_accelerator().create_op_builder(builders[name])


# --------------------------------------------------------------------------------------------
# load_op


@dataclass
class OpLoad:
    name: str
    compatible: bool
    loaded: bool
    seconds: float  # build + load wall time
    built_now: bool  # a cold build: the cached binary did not exist before
    module: Any = None
    error: str | None = None
    log_tail: str = ""
    diagnosis: list[Diagnosis] = field(default_factory=list)
    builder: str | None = None
    extensions_dir: str | None = None

    def summary(self) -> dict[str, Any]:
        """JSON-friendly fields for benchmark records (no module object)."""
        return {"op": self.name, "compatible": self.compatible, "loaded": self.loaded,
                "build_seconds": self.seconds, "built_now": self.built_now, "builder": self.builder,
                "error": self.error, "diagnosis": [d.__dict__ for d in self.diagnosis]}


class OpUnavailable(RuntimeError):
    """The op did not build or load; the message is `format_failure` of the attempt."""

    def __init__(self, load: OpLoad) -> None:
        super().__init__(format_failure(load))
        self.load = load


class _Redirect(io.TextIOBase):
    """A sys.stdout/sys.stderr stand-in: writes to the capture while it lasts, then to `fallback`.

    Loggers created during the capture (importing DeepSpeed creates its handlers) keep a reference
    to whatever sys.stdout was; this object stays valid after the capture ends.
    """

    def __init__(self, target: io.TextIOBase, fallback: Any, fd: int) -> None:
        super().__init__()
        self._target: io.TextIOBase | None = target
        self._fallback = fallback
        self._fd = fd

    def detach_capture(self) -> None:
        self._target = None

    def _out(self) -> Any:
        return self._target if self._target is not None else self._fallback

    def write(self, s: str) -> int:
        return self._out().write(s)

    def flush(self) -> None:
        with contextlib.suppress(Exception):
            self._out().flush()

    def fileno(self) -> int:
        return self._fd if self._target is not None else self._fallback.fileno()

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"


class _FdCapture:
    """Send fds 1 and 2, and sys.stdout/sys.stderr, to one temporary file.

    ninja and the compiler write to fd 1 (torch runs them with stdout=1 when verbose), DeepSpeed's
    warnings go through print(); pytest may have replaced sys.stdout, so both levels are redirected.
    """

    def __init__(self) -> None:
        self.text = ""

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        with tempfile.TemporaryFile() as sink:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            saved = [os.dup(1), os.dup(2)]
            text = io.TextIOWrapper(os.fdopen(os.dup(sink.fileno()), "wb"), encoding="utf-8",
                                    errors="replace", line_buffering=True)
            out, err = _Redirect(text, sys.stdout, 1), _Redirect(text, sys.stderr, 2)
            try:
                os.dup2(sink.fileno(), 1)
                os.dup2(sink.fileno(), 2)
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                    yield
            finally:
                text.flush()
                out.detach_capture()
                err.detach_capture()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                for fd in saved:
                    os.close(fd)
                text.close()
                sink.seek(0)
                self.text = sink.read().decode("utf-8", errors="replace")


def _error_text(exc: BaseException) -> str:
    """The exception chain, innermost cause first and the raised exception last
    (traceback order)."""
    chain: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in chain:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    return "\n".join(f"{type(e).__name__}: {e}" for e in reversed(chain))


def log_tail(text: str, n: int = LOG_TAIL_LINES) -> str:
    """The last `n` lines; when the first compiler error is earlier, its lines lead the tail.

    ninja keeps running the jobs in flight after the first failure, so the error that matters is
    often buried under later compiler command lines.
    """
    lines = [ln if len(ln) <= LOG_LINE_CHARS else ln[:LOG_LINE_CHARS] + " [...]"
             for ln in strip_ansi(text).splitlines()]
    first_err = next((i for i, ln in enumerate(lines) if ERROR_LINE_RE.search(ln)), None)
    if first_err is None or first_err >= len(lines) - n:
        return "\n".join(lines[-n:])
    head = lines[max(0, first_err - 1):first_err + n // 2]
    rest = n - len(head) - 1
    return "\n".join(head + ["[...]"] + lines[len(lines) - rest:])


def _so_path(ext_dir: Path, name: str) -> Path:
    # torch.utils.cpp_extension.load builds `name` in TORCH_EXTENSIONS_DIR/name/name.so
    return ext_dir / name / f"{name}{'.pyd' if os.name == 'nt' else '.so'}"


def load_op(name: str) -> OpLoad:
    """Build (if needed) and load DeepSpeed op `name`; compiler output and failures are recorded."""
    ext_dir = ensure_extensions_dir()
    existed = _so_path(ext_dir, name).exists()
    out = _FdCapture()
    compatible, module, error, builder_name, already, seconds = False, None, None, None, False, 0.0
    with out.capture():
        try:
            # A lock left by a killed build would make this build wait forever.
            from dsconform.ops.buildlock import clear_stale
            for line in clear_stale(ext_dir):
                print(line)
            builder = _create_builder(name)
            builder_name = type(builder).__name__
            from deepspeed.ops.op_builder.builder import OpBuilder
            already = name in OpBuilder._loaded_ops  # loaded earlier in this process: no build
            start = time.perf_counter()
            try:
                compatible = bool(builder.is_compatible(verbose=True))
                module = builder.load(verbose=True)
            finally:
                seconds = time.perf_counter() - start
        except Exception as exc:  # a build failure is a result, never an exception out of here
            error = _error_text(exc)
    loaded = module is not None
    result = OpLoad(name=name, compatible=compatible, loaded=loaded, seconds=seconds,
                    built_now=(loaded and not existed and not already
                               and _so_path(ext_dir, name).exists()),
                    module=module, error=error, log_tail=log_tail(out.text), builder=builder_name,
                    extensions_dir=str(ext_dir))
    if error is not None:
        result.diagnosis = diagnose(error, out.text, os.environ, shm_bytes=shm_bytes())
    return result


_LOADED: dict[str, OpLoad] = {}


def _require(name: str) -> OpLoad:
    """load_op once per process for the checks: a warm load still costs seconds
    (py-cpuinfo, probes)."""
    if name not in _LOADED:
        load = load_op(name)
        if not load.loaded:
            raise OpUnavailable(load)
        _LOADED[name] = load
    return _LOADED[name]


def require_op(name: str) -> OpLoad:
    """The loaded op `name`, built and loaded once per process; OpUnavailable when it does not
    load. For library code that calls an op's module (dsconform.storage.io)."""
    return _require(name)


# --------------------------------------------------------------------------------------------
# Comparisons


def _assert_close_step(check: str, step: int, params: Sequence[Any], refs: Sequence[Any],
                       tol: Any) -> tuple[float, float]:
    """Compare every parameter after `step` with the one comparator (dsconform.checks.equivalence)
    under
    the one tolerance table's entry; AssertionError naming step, parameter and numbers."""
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


def _assert_moved(check: str, params: Sequence[Any], initial: Sequence[Any]) -> float:
    """A no-op optimizer would match a no-op reference: make sure the parameters moved."""
    moved = max(float((p.detach().cpu() - p0).abs().max()) for p, p0 in zip(params, initial))
    if moved == 0.0:
        raise AssertionError(f"{check}: parameters did not change after the steps")
    return moved


def _gradient(n: int, gen: Any) -> Any:
    """N(0, 1) gradients whose magnitudes span 10 decades (each element times 10**-u, u uniform
    in [0, 10)): about a fifth of them sit at or below Adam's eps (1e-8) and Adagrad's (1e-10),
    where the update depends on eps, so an optimizer that gets eps wrong (or drops it) fails;
    N(0, 1) alone moves such updates by far less than the tolerance (eps 0 passed it)."""
    import torch

    return torch.randn(n, generator=gen) * torch.pow(10.0, -10.0 * torch.rand(n, generator=gen))


def _run_optimizer_pair(check: str, make_opt: Callable[[list], Any],
                        make_ref: Callable[[list], Any] | None,
                        ref_step: Callable[[list, list, int], None] | None, *, steps: int,
                        sizes: Sequence[int], device: str = "cpu", seed: int = 0) -> dict[str, Any]:
    """Step an optimizer and its reference on identical parameters and gradients; compare each step.

    Sizes default to uneven element counts so that SIMD tails and partition padding are exercised.
    """
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
    moved = _assert_moved(check, params, initial)
    return {"steps": steps, "elements": list(sizes), "device": str(device),
            "max_abs_diff": worst_abs, "max_rel_diff": worst_rel, "rtol": tol.rtol,
            "atol": tol.atol, "max_param_change": moved}


# --------------------------------------------------------------------------------------------
# Functional checks


def check_cpu_adam(*, steps: int = 5, adamw_mode: bool = True, weight_decay: float = 0.01,
                   lr: float = 1e-2, sizes: Sequence[int] = (53, 4103)) -> dict[str, Any]:
    """DeepSpeedCPUAdam against torch.optim.AdamW (adamw_mode) or Adam, same hyperparameters.

    weight_decay and adamw_mode are passed explicitly on both sides: DeepSpeed defaults to
    AdamW with
    weight_decay 0, torch's AdamW to weight_decay 0.01.
    """
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    load = _require("cpu_adam")
    hp = dict(lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay)
    ref_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    result = _run_optimizer_pair(
        "cpu_adam",
        lambda ps: DeepSpeedCPUAdam(ps, adamw_mode=adamw_mode, bias_correction=True, **hp),
        lambda ps: ref_cls(ps, **hp), None, steps=steps, sizes=sizes)
    return {"op": "cpu_adam", "reference": ref_cls.__name__, "adamw_mode": adamw_mode, **hp,
            "load_seconds": load.seconds, **result}


def check_fused_adam(device: str = "cpu", *, steps: int = 5, adamw_mode: bool = True,
                     weight_decay: float = 0.01,
                     lr: float = 1e-2, sizes: Sequence[int] = (53, 4103)) -> dict[str, Any]:
    """deepspeed.ops.adam.FusedAdam on `device` against torch Adam/AdamW on the same device."""
    import torch
    from deepspeed.ops.adam import FusedAdam
    load = _require("fused_adam")
    hp = dict(lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay)
    ref_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    result = _run_optimizer_pair(
        "fused_adam", lambda ps: FusedAdam(ps, adam_w_mode=adamw_mode, bias_correction=True, **hp),
        lambda ps: ref_cls(ps, **hp), None, steps=steps, sizes=sizes, device=device)
    return {"op": "fused_adam", "reference": ref_cls.__name__, "adamw_mode": adamw_mode, **hp,
            "load_seconds": load.seconds, **result}


def check_cpu_adagrad(*, steps: int = 5, weight_decay: float = 0.01, lr: float = 1e-2,
                      sizes: Sequence[int] = (53, 4103)) -> dict[str, Any]:
    """DeepSpeedCPUAdagrad against torch.optim.Adagrad (lr_decay 0, initial accumulator 0)."""
    import torch
    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    load = _require("cpu_adagrad")
    hp = dict(lr=lr, eps=1e-10, weight_decay=weight_decay)
    result = _run_optimizer_pair(
        "cpu_adagrad", lambda ps: DeepSpeedCPUAdagrad(ps, **hp),
        lambda ps: torch.optim.Adagrad(ps, lr_decay=0, initial_accumulator_value=0, **hp), None,
        steps=steps, sizes=sizes)
    return {"op": "cpu_adagrad", "reference": "Adagrad", **hp, "load_seconds": load.seconds,
            **result}


def check_cpu_lion(*, steps: int = 5, weight_decay: float = 0.01, lr: float = 1e-3,
                   betas: tuple[float, float] = (0.9, 0.99),
                   sizes: Sequence[int] = (53, 4103)) -> dict[str, Any]:
    """DeepSpeedCPULion against Lion written out (Chen et al. 2023, Algorithm 2);
    torch has no Lion."""
    import torch
    from deepspeed.ops.lion import DeepSpeedCPULion
    load = _require("cpu_lion")
    momenta: dict[int, Any] = {}

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
        None, lion_reference, steps=steps, sizes=sizes)
    return {"op": "cpu_lion", "reference": "Lion (written out)", "lr": lr, "betas": betas,
            "weight_decay": weight_decay, "load_seconds": load.seconds, **result}


def _first_mismatch(a: Any, b: Any) -> str:
    import torch
    diff = torch.nonzero(a != b).flatten()
    if diff.numel() == 0:
        return "no differing byte"
    i = int(diff[0])
    return (f"{diff.numel()} differing bytes, first at offset {i} "
            f"(wrote {int(a[i])}, read {int(b[i])})")


def _io_roundtrip(handle: Any, wbuf: Any, rbuf: Any, path: Path,
                  tamper: Callable[[Path], None] | None) -> tuple[float, float]:
    """Synchronous write then read of one file; returns (write_s, read_s)."""
    t0 = time.perf_counter()
    handle.sync_pwrite(wbuf, str(path))
    write_s = time.perf_counter() - t0
    size = path.stat().st_size
    if size != wbuf.numel():
        raise AssertionError(f"wrote {wbuf.numel()} bytes to {path}, the file has {size}")
    if tamper is not None:
        tamper(path)
    t0 = time.perf_counter()
    handle.sync_pread(rbuf, str(path))
    read_s = time.perf_counter() - t0
    return write_s, read_s


def _handle_args(block_size: int, queue_depth: int, intra_op_parallelism: int) -> tuple:
    # aio_handle / gds_handle(block_size, queue_depth, single_submit, overlap_events,
    # intra_op_parallelism)
    return block_size, queue_depth, False, True, intra_op_parallelism


def _check_aligned(op: str, handle: Any, nbytes: int) -> None:
    # Measured on DeepSpeed 0.19.8 (CPU, ext4-backed overlay): sync_pwrite of a size that is not a
    # multiple of the handle's alignment returns success but leaves the unaligned tail block out of
    # the file (4103 bytes -> 0, 1 MiB + 7 -> 1 MiB), and sync_pread of that size then aborts the
    # whole process (C assert in is_valid_bytes_to_read). Refuse such sizes instead.
    align = handle.get_alignment()
    if nbytes <= 0 or nbytes % align:
        raise ValueError(f"{op}: nbytes={nbytes} is not a positive multiple of the handle's "
                         f"alignment ({align} bytes); DeepSpeed silently drops an unaligned tail "
                         "on write and aborts on read")


def check_async_io(scratch_dir: str | os.PathLike[str], nbytes: int = 64 * 1024**2, *,
                   block_size: int = 1024**2, queue_depth: int = 32, intra_op_parallelism: int = 1,
                   tamper: Callable[[Path], None] | None = None) -> dict[str, Any]:
    """aio_handle: write random bytes from a page-locked CPU tensor to a file under scratch_dir,
    read
    them back into another, compare every byte; report GB/s (1e9 bytes/s). The file is removed.

    `tamper(path)` runs between write and read; tests use it to prove the comparison goes red.
    """
    import torch
    load = _require("async_io")
    handle = load.module.aio_handle(*_handle_args(block_size, queue_depth, intra_op_parallelism))
    _check_aligned("async_io", handle, nbytes)
    path = Path(scratch_dir) / f"dsconform-aio-{os.getpid()}-{uuid.uuid4().hex[:8]}.bin"
    example = torch.empty(0, dtype=torch.uint8)
    wbuf = handle.new_cpu_locked_tensor(nbytes, example)
    rbuf = handle.new_cpu_locked_tensor(nbytes, example)
    try:
        wbuf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                                 generator=torch.Generator().manual_seed(0)))
        rbuf.zero_()
        write_s, read_s = _io_roundtrip(handle, wbuf, rbuf, path, tamper)
        if not torch.equal(wbuf, rbuf):
            raise AssertionError(f"async_io: data read back from {path} differs from what was "
                                 f"written: {_first_mismatch(wbuf, rbuf)} of {nbytes}")
    finally:
        handle.free_cpu_locked_tensor(wbuf)
        handle.free_cpu_locked_tensor(rbuf)
        path.unlink(missing_ok=True)
    return {"op": "async_io", "bytes": nbytes, "file_dir": str(scratch_dir),
            "block_size": block_size,
            "queue_depth": queue_depth, "intra_op_parallelism": intra_op_parallelism,
            "write_s": write_s, "read_s": read_s, "write_gbps": nbytes / write_s / GB,
            "read_gbps": nbytes / read_s / GB, "gb": "1e9 bytes", "equal": True,
            "load_seconds": load.seconds}


def check_gds(scratch_dir: str | os.PathLike[str], nbytes: int = 16 * 1024**2, *,
              block_size: int = 1024**2,
              queue_depth: int = 32, intra_op_parallelism: int = 1, io: bool = True,
              tamper: Callable[[Path], None] | None = None) -> dict[str, Any]:
    """gds_handle creation; with CUDA and io=True, a write/read of a registered CUDA tensor compared
    byte for byte. I/O needs a GDS-capable file system: on the 2xH200 node's virtio disk the write
    killed the process (2026-11-30), so the ops suite asks for the handle only and I/O is left to
    paths a profile marks gds = true."""
    import torch
    load = _require("gds")
    handle = load.module.gds_handle(*_handle_args(block_size, queue_depth, intra_op_parallelism))
    result: dict[str, Any] = {"op": "gds", "handle": True, "load_seconds": load.seconds}
    if not io:
        return {**result, "io": "not tried: handle only"}
    if not torch.cuda.is_available():
        return {**result, "io": "not tried: no CUDA device"}
    _check_aligned("gds", handle, nbytes)
    path = Path(scratch_dir) / f"dsconform-gds-{os.getpid()}-{uuid.uuid4().hex[:8]}.bin"
    gen = torch.Generator(device="cuda").manual_seed(0)
    wbuf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=gen)
    rbuf = torch.zeros_like(wbuf)
    for buf in (wbuf, rbuf):
        handle.pin_device_tensor(buf)  # GDS needs the buffers registered with cuFile
    try:
        write_s, read_s = _io_roundtrip(handle, wbuf, rbuf, path, tamper)
        torch.cuda.synchronize()
        if not torch.equal(wbuf, rbuf):
            raise AssertionError(f"gds: data read back from {path} differs from what was written: "
                                 f"{_first_mismatch(wbuf.cpu(), rbuf.cpu())} of {nbytes}")
    finally:
        for buf in (wbuf, rbuf):
            handle.unpin_device_tensor(buf)
        path.unlink(missing_ok=True)
    return {**result, "io": "cuda", "bytes": nbytes, "file_dir": str(scratch_dir),
            "write_s": write_s, "read_s": read_s, "write_gbps": nbytes / write_s / GB,
            "read_gbps": nbytes / read_s / GB, "gb": "1e9 bytes", "equal": True}


def _needs_scratch(name: str, scratch_dir: str | os.PathLike[str] | None) -> str | os.PathLike[str]:
    if scratch_dir is None:
        raise ValueError(f"check_op({name!r}) writes a file: "
                         "pass scratch_dir (the suite's --scratch DIR)")
    return scratch_dir


FUNCTIONAL_CHECKS: dict[str, Callable[[str, Any], dict[str, Any]]] = {
    "cpu_adam": lambda device, scratch: check_cpu_adam(),
    "fused_adam": lambda device, scratch: check_fused_adam(device),
    "cpu_adagrad": lambda device, scratch: check_cpu_adagrad(),
    "cpu_lion": lambda device, scratch: check_cpu_lion(),
    "async_io": lambda device, scratch: check_async_io(_needs_scratch("async_io", scratch)),
    "gds": lambda device, scratch: check_gds(_needs_scratch("gds", scratch), io=False),
}


def check_op(name: str, *, device: str = "cpu",
             scratch_dir: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Load op `name` and, where one exists, run its functional check; for other ops, load only.

    Raises OpUnavailable when the op does not build or load, AssertionError when its result is
    wrong.
    The result carries the build time and whether it was a cold build, for the benchmark record.
    """
    load = _require(name)
    result: dict[str, Any] = load.summary()
    check = FUNCTIONAL_CHECKS.get(name)
    result["checked"] = "functional" if check else "load only"
    if check:
        result.update(check(device, scratch_dir))
    return result


def ops_env_report(env: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """The variables that change how ops build, for the report header."""
    env = os.environ if env is None else env
    keys = ("TORCH_EXTENSIONS_DIR", "TORCH_CUDA_ARCH_LIST", "CUDA_HOME", "CXX", "CPATH",
            "LIBRARY_PATH", "LD_LIBRARY_PATH", "CFLAGS", "LDFLAGS", "MAX_JOBS",
            "DS_SKIP_CUDA_CHECK")
    return {k: env.get(k) for k in keys}


# --------------------------------------------------------------------------------------------
# Isolation: a crash in native code must fail one test, not end the run


class OpCrashed(RuntimeError):
    """The child process running an op check died (signal, abort, non-JSON exit)."""


_CHILD = """
import json, sys, traceback
from dsconform import ops
from dsconform.ops.diagnose import format_failure
name, device, scratch = sys.argv[1], sys.argv[2], sys.argv[3] or None
try:
    out = {"status": "ok", "result": ops.check_op(name, device=device, scratch_dir=scratch)}
except ops.OpUnavailable as e:
    out = {"status": "unavailable", "message": str(e), "load": e.load.summary()}
except AssertionError as e:
    out = {"status": "wrong", "message": str(e)}
except Exception as e:
    out = {"status": "error", "message": "".join(traceback.format_exception(e))}
sys.stdout.flush()
print("\\n" + _MARK + json.dumps(out, default=str))
""".replace("_MARK", repr("@@dsconform-op-result@@"))
_MARK = "@@dsconform-op-result@@"


def check_op_isolated(name: str, *, device: str = "cpu",
                      scratch_dir: str | os.PathLike[str] | None = None,
                      timeout_s: float = 900) -> dict[str, Any]:
    """check_op in a child Python process. Native code can abort the process (DeepSpeed's aio
    asserts on an unaligned read; GDS I/O on a non-GDS disk killed the 2xH200 run), and a test
    suite must survive that: the child's death becomes OpCrashed naming the signal and its output.
    Raises OpUnavailable-equivalent RuntimeError text, AssertionError, or OpCrashed."""
    return IsolatedOpCheck.start(name, device=device, scratch_dir=scratch_dir).result(timeout_s)


class IsolatedOpCheck:
    """check_op_isolated, started now and read later, so that several ops' checks (each mostly
    the child's import of torch and deepspeed, 8-12 s on 2xH200) run at once."""

    def __init__(self, name: str, proc: Any) -> None:
        self.name = name
        self.proc = proc
        self._out: tuple[str, str] | None = None
        self._timed_out: float | None = None

    @classmethod
    def start(cls, name: str, *, device: str = "cpu",
              scratch_dir: str | os.PathLike[str] | None = None) -> IsolatedOpCheck:
        import subprocess

        cmd = [sys.executable, "-c", _CHILD, name, device, os.fspath(scratch_dir or "")]
        # The child runs in the scratch directory: gds_handle writes local_cufile.json into its
        # working directory, which must not be the user's checkout. This dsconform stays
        # importable.
        here = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH"))
                                             if p)}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env, cwd=os.fspath(scratch_dir) if scratch_dir else None)
        return cls(name, proc)

    def wait(self, timeout_s: float = 900) -> None:
        """Wait for the check's process, reading its output meanwhile (a bare proc.wait()
        would hang on a child whose output filled the pipe); a check past timeout_s is killed
        and result() says so."""
        import subprocess

        if self._out is not None:
            return
        try:
            self._out = self.proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            stdout, stderr = self.proc.communicate()
            self._timed_out = timeout_s
            self._out = (str(stdout or ""), str(stderr or ""))

    def result(self, timeout_s: float = 900) -> dict[str, Any]:
        """The check's result (a dict) or its exception, as check_op_isolated describes."""
        import signal as _signal

        name, proc = self.name, self.proc
        self.wait(timeout_s)
        stdout, stderr = self._out
        if self._timed_out is not None:
            raise OpCrashed(f"op {name}: check did not finish within {self._timed_out:.0f} s\n"
                            f"{log_tail(stdout + stderr)}")
        output = stdout + stderr
        marker = stdout.rfind(_MARK)
        if marker < 0:
            how = (f"killed by {_signal.Signals(-proc.returncode).name}" if proc.returncode < 0
                   else f"exited {proc.returncode}")
            raise OpCrashed(f"op {name}: the process running its check {how} before reporting "
                            f"(a crash in native code)\noutput (tail):\n{log_tail(output)}")
        out = json.loads(stdout[marker + len(_MARK):].strip().splitlines()[0])
        status = out["status"]
        if status == "ok":
            return out["result"]
        if status == "unavailable":
            raise OpUnavailableText(out["message"], out.get("load", {}))
        if status == "wrong":
            raise AssertionError(out["message"])
        raise OpCrashed(f"op {name}: the check raised unexpectedly:\n{out['message']}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


#: Ops whose check reads and writes the disk and records its rates: their checks run one at a
#: time, so a rate is never measured while another op's check does I/O.
IO_OPS = frozenset({"async_io", "gds"})


class OpChecks:
    """The promised ops' isolated checks, started together: every compute op's check and the
    first I/O op's as soon as its build (if the run started one) has ended; the other I/O ops'
    checks when asked for, after the one before has finished. Nothing here waits for a build
    except ``get`` of that op. ``get(op)`` returns the running or finished IsolatedOpCheck, or
    None when the op's build failed (its test reports the build's own diagnosis)."""

    def __init__(self, ops: list[str], *, device: str, scratch_root: str | os.PathLike[str],
                 build_result: Callable[[str], dict[str, Any] | None] = lambda op: None,
                 build_done: Callable[[str], bool] = lambda op: True,
                 starter: Callable[..., IsolatedOpCheck] = IsolatedOpCheck.start) -> None:
        self.device = device
        self.scratch_root = Path(scratch_root)
        self.build_result = build_result
        self.build_done = build_done
        self.starter = starter
        self.checks: dict[str, IsolatedOpCheck | None] = {}
        io = [op for op in ops if op in IO_OPS]
        self.ops = list(ops)
        self.eager = [op for op in ops if op not in IO_OPS] + io[:1]
        self.lock = threading.RLock()  # get() from a test and from start_all's thread
        self.closed = False
        self._start_ready()

    def start_all(self) -> threading.Thread:
        """Start every check in the background, each once its build has ended, the I/O ones one
        after another (a run with a background cell batch: the ops tests then only read the
        results). Returns the thread doing it."""
        def run() -> None:
            for op in self.ops:
                if self.closed:
                    return
                try:
                    self.get(op)
                except Exception:  # noqa: BLE001 - the op's own test calls get() and reports it
                    pass
        thread = threading.Thread(target=run, name="dsconform-op-checks", daemon=True)
        thread.start()
        return thread

    def _start_ready(self) -> None:
        for op in self.eager:
            if op not in self.checks and self.build_done(op):
                self._start(op)

    def _start(self, op: str) -> IsolatedOpCheck | None:
        build = self.build_result(op)
        if build is not None and not build.get("loaded"):
            self.checks[op] = None
            return None
        scratch = self.scratch_root / op
        scratch.mkdir(parents=True, exist_ok=True)
        self.checks[op] = self.starter(op, device=self.device, scratch_dir=scratch)
        if self.closed:
            self.checks[op].kill()
        return self.checks[op]

    def get(self, op: str) -> IsolatedOpCheck | None:
        with self.lock:
            self._start_ready()
            if op in self.checks:
                return self.checks[op]
            if op in IO_OPS:
                for other, check in self.checks.items():
                    if other in IO_OPS and check is not None:
                        check.wait()
            return self._start(op)  # waits for op's build

    def close(self) -> None:
        self.closed = True  # start_all's thread starts nothing more; _start kills a late one
        for check in list(self.checks.values()):
            if check is not None:
                check.kill()


def checks_for_run(run: Any, scratch_root: str | os.PathLike[str]) -> OpChecks:
    """The profile's promised ops' checks for this run (run: dsconform.plugin.runstate.RunState),
    each
    started as its parallel build (run.op_builds) ends, their scratch under scratch_root."""
    builds = run.op_builds
    return OpChecks(list(run.profile.ops), device=run.node.accelerator, scratch_root=scratch_root,
                    build_result=(builds.wait if builds is not None else lambda op: None),
                    build_done=(builds.finished if builds is not None else lambda op: True))


class OpUnavailableText(RuntimeError):
    """OpUnavailable as reported by a child process: the formatted failure and the load summary."""

    def __init__(self, message: str, load: dict[str, Any]):
        super().__init__(message)
        self.load = load
