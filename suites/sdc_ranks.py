"""Code run inside the ranks of suites/test_sdc.py: the known-answer kernels and the HBM pattern
test, on every GPU at once.

``known_answers``: each kernel's inputs are drawn on the CPU from fixed seeds (the same bits on
every node), copied to the GPU and the kernel run ``reps`` times under pinned math (TF32 off
except for the tf32 GEMM, no reduced-precision reductions, deterministic algorithms). Every
repetition's bits are compared with the first's on the GPU; the first is hashed (sha256 of its
bytes), compared bit for bit with rank 0's (a broadcast), and sampled against a CPU float64
evaluation of the same inputs.

``soak``: the burn-in (``--soak MINUTES``): the known-answer kernels, the ZeRO training cells
against DDP, a sustained matmul and a slice of the HBM patterns, in a loop on every GPU at once
until the deadline; each iteration's hashes are held to the GPU's first iteration's and to rank
0's, and every rank writes its count of iterations and mismatches to a progress file after each.

``hbm_patterns``: one block of most of the GPU's free memory, written with a pattern and read
back, for every pattern in turn: walking ones (32 passes, each word one bit set, the bit moving
with the address and the pass), the word's own byte address and its inverse, and two seeded
pseudo-random fills. The expected word is recomputed from its index on the read, so nothing
else of the GPU's memory holds a copy.

Fault injection for the project's red tests, off by default: ``tamper`` flips one bit of one
element of one kernel's output in one repetition on one rank, after the real kernel computed
it (``{"rank", "kernel", "rep", "index", "bit"}``; ``rep`` None: every repetition), or
overwrites one word of the HBM block after the real write of one pattern (``{"rank",
"pattern", "word"}``); in ``soak`` either one, or ``"perturb"``: DeepSpeed's loss scaled by that
factor inside its backward on every rank (the ZeRO suite's fault), in one iteration only
(``"iteration"``).

Ranks are pooled and reused: every call restores the math settings it changed and frees what
it allocated.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dsconform.suite import (
    collective_calls,
    compare_rank_results,
    device,
    gpu_health,
    rank,
    train_zero_and_ddp,
    world,
)

SEED = 20261204
REF_ROWS = 32            # rows of a GEMM / elementwise output held to the CPU reference
MLP = (256, 1024, 256)   # the training step's model
MLP_BATCH, MLP_LR = 512, 0.1
_TORCH = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
          "tf32": torch.float32}
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@contextlib.contextmanager
def pinned_math() -> Iterator[None]:
    """TF32 and reduced-precision reductions off, deterministic algorithms on (cuBLAS needs a
    fixed workspace for that); everything restored on exit."""
    m = torch.backends.cuda.matmul
    saved = (m.allow_tf32, m.allow_bf16_reduced_precision_reduction,
             m.allow_fp16_reduced_precision_reduction, torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(),
             os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    m.allow_tf32 = False
    m.allow_bf16_reduced_precision_reduction = False
    m.allow_fp16_reduced_precision_reduction = False
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        (m.allow_tf32, m.allow_bf16_reduced_precision_reduction,
         m.allow_fp16_reduced_precision_reduction) = saved[:3]
        torch.use_deterministic_algorithms(saved[3], warn_only=saved[4])
        if saved[5] is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


def cublas_version() -> str:
    """cuBLAS's MAJOR.MINOR.PATCH as the loaded library reports it (cublasGetProperty), after
    a GEMM loaded it; "none" on the CPU, "unknown" where it cannot be read."""
    if device().type != "cuda":
        return "none"
    try:
        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps if "libcublas.so" in line), None)
        if path is None:
            return "unknown"
        lib = ctypes.CDLL(path)
        parts = []
        for prop in (0, 1, 2):  # MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL
            value = ctypes.c_int()
            if lib.cublasGetProperty(prop, ctypes.byref(value)) != 0:
                return "unknown"
            parts.append(str(value.value))
        return ".".join(parts)
    except (OSError, AttributeError):
        return "unknown"


def board_serial(bus_id: str | None) -> str | None:
    """NVML's board serial of the GPU at ``bus_id``, None where NVML gives none."""
    with contextlib.ExitStack() as stack:
        nvml, handle, _ = gpu_health.nvml_handle(stack, bus_id)
        if handle is None:
            return None
        try:
            serial = nvml.nvmlDeviceGetSerial(handle)
        except Exception:  # boards without a serial answer NOT_SUPPORTED
            return None
        serial = serial.decode() if isinstance(serial, bytes) else str(serial)
        return serial.strip() or None


def _inputs(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED + size)
    return torch.randn(size, size, generator=g), torch.randn(size, size, generator=g)


def _rows(n: int) -> torch.Tensor:
    return torch.arange(0, n, max(1, n // REF_ROWS))[:REF_ROWS]


Kernel = tuple[Callable[[], torch.Tensor], Callable[[torch.Tensor], torch.Tensor],
               torch.Tensor, float]


def _gemm(dtype: str, a: torch.Tensor, b: torch.Tensor, dev: torch.device) -> Kernel:
    a, b = a.to(_TORCH[dtype]), b.to(_TORCH[dtype])
    rows = _rows(a.shape[0])
    ref = (a[rows].double() @ b.double()).flatten()
    da, db = a.to(dev), b.to(dev)

    def run() -> torch.Tensor:
        torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
        try:
            return torch.matmul(da, db)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = False
    return run, lambda out: out[rows.to(dev)].flatten(), ref, math.sqrt(a.shape[1])


def _reduce(a: torch.Tensor, dev: torch.device) -> Kernel:
    x = a.to(dev)
    return (lambda: x.sum(dim=1)), (lambda out: out), a.double().sum(dim=1), \
        math.sqrt(a.shape[1])


def _chain(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * torch.exp(-0.5 * x * x) + 0.25 * torch.sin(3.0 * x)


def _elementwise(a: torch.Tensor, dev: torch.device) -> Kernel:
    x, rows = a.to(dev), _rows(a.shape[0])
    return (lambda: _chain(x)), (lambda out: out[rows.to(dev)].flatten()), \
        _chain(a[rows].double()).flatten(), 1.0


def _step(params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One SGD step of the MLP from ``params``: the new parameters, flattened into one."""
    w1, b1, w2, b2 = (p.detach().clone().requires_grad_(True) for p in params)
    loss = F.mse_loss(F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2), y)
    grads = torch.autograd.grad(loss, (w1, b1, w2, b2))
    return torch.cat([(p - MLP_LR * g).detach().flatten() for p, g in zip((w1, b1, w2, b2),
                                                                           grads)])


def _train(dev: torch.device) -> Kernel:
    g = torch.Generator().manual_seed(SEED)
    n_in, hidden, n_out = MLP
    params = [torch.randn(hidden, n_in, generator=g) / math.sqrt(n_in),
              torch.randn(hidden, generator=g) * 0.1,
              torch.randn(n_out, hidden, generator=g) / math.sqrt(hidden),
              torch.randn(n_out, generator=g) * 0.1]
    x, y = torch.randn(MLP_BATCH, n_in, generator=g), torch.randn(MLP_BATCH, n_out, generator=g)
    ref = _step([p.double() for p in params], x.double(), y.double())
    before = torch.cat([p.double().flatten() for p in params])
    scale = float((ref - before).abs().max())
    on_dev = [p.to(dev) for p in params]
    xd, yd = x.to(dev), y.to(dev)
    return (lambda: _step(on_dev, xd, yd)), (lambda out: out), ref, scale


def _kernel(kind: str, a: torch.Tensor, b: torch.Tensor, dev: torch.device) -> Kernel:
    family, dtype = kind.split(".")
    if family == "gemm":
        return _gemm(dtype, a, b, dev)
    if family == "reduce":
        return _reduce(a, dev)
    if family == "elementwise":
        return _elementwise(a, dev)
    if family == "train":
        return _train(dev)
    raise ValueError(f"unknown known-answer kernel {kind!r}")


def kernel_name(kind: str, size: int) -> str:
    """The stable name a kernel's hash is recorded under: its kind and size."""
    return f"{kind}.mlp{MLP[1]}" if kind.startswith("train.") else f"{kind}.{size}"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(_BITS[t.element_size()])


def _flip(out: torch.Tensor, index: int, bit: int) -> torch.Tensor:
    """``out`` with one bit of one element flipped (the red tests' corrupt GPU)."""
    flat = _bits(out)
    mask = torch.tensor(1 << bit, dtype=torch.int64).to(flat.dtype)
    flat[index] = flat[index] ^ mask.to(flat.device)
    return out


def _worst(sampled: torch.Tensor, ref: torch.Tensor, scale: float, tol: tuple[float, float]
           ) -> dict[str, Any]:
    """The sampled element farthest outside ``atol * scale + rtol * |ref|`` (NaN first), and
    the largest share of that bound any sampled element used (``used``: 1 is at the bound)."""
    rtol, atol = tol
    diff = (sampled.double().cpu() - ref).abs()
    bound = atol * scale + rtol * ref.abs()
    excess = torch.nan_to_num(diff - bound, nan=math.inf)
    used = torch.nan_to_num(torch.where(diff == 0, 0.0, diff / bound), nan=math.inf)
    i = int(excess.argmax())
    return {"index": i, "value": float(sampled.view(-1)[i]), "reference": float(ref[i]),
            "scale": scale, "used": float(used.max())}


def _supported(kind: str, dev: torch.device) -> bool:
    if dev.type != "cuda":
        return True
    major = torch.cuda.get_device_capability(dev)[0]
    return not (kind.endswith((".bf16", ".tf32")) and major < 8)


def known_answers(kinds: list[str], size: int, reps: int, tols: dict[str, tuple[float, float]],
                  tamper: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every kernel of ``kinds`` at ``size``, ``reps`` times, on this rank's device, all ranks at
    once: its first result's hash, how many elements each later repetition and rank 0's result
    differ in, and its worst sampled element against the CPU float64 reference (``tols``:
    kind -> (rtol, atol))."""
    dev = device()
    me = collective_calls.identity()
    a, b = _inputs(size)
    out: dict[str, Any] = {}
    # Every rank runs the kernels every rank supports (each one's result is broadcast).
    ok = torch.tensor([int(_supported(k, dev)) for k in kinds], dtype=torch.int32, device=dev)
    if world() > 1:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    skipped = [k for k, flag in zip(kinds, ok.tolist()) if not flag]
    with pinned_math():
        for kind in kinds:
            if kind in skipped:
                continue
            name = kernel_name(kind, size)
            run, sample, ref, scale = _kernel(kind, a, b, dev)
            first, differ = None, {}
            for rep in range(reps):
                result = run()
                if tamper and (tamper["rank"], tamper["kernel"]) == (rank(), kind) \
                        and tamper["rep"] in (rep, None):
                    result = _flip(result, tamper["index"], tamper["bit"])
                if first is None:
                    first = result
                else:
                    differ[str(rep)] = int((_bits(result) != _bits(first)).sum())
                del result
            peer = None
            if world() > 1:
                theirs = first.clone().contiguous().view(-1).view(torch.uint8).view(torch.int32)
                dist.broadcast(theirs, src=0)
                peer = int((theirs.view(torch.uint8).view(_BITS[first.element_size()])
                            != _bits(first)).sum())
            host = first.detach().contiguous().cpu()
            out[name] = {"hash": hashlib.sha256(host.view(-1).view(torch.uint8).numpy()
                                                ).hexdigest(),
                         "elements": first.numel(), "reps": reps, "rep_differ": differ,
                         "peer_differ": peer,
                         "reference": _worst(sample(first), ref, scale, tols[kind])}
            del first, run, sample
    versions = {"torch": torch.__version__, "cuda": torch.version.cuda or "none",
                "cublas": cublas_version()}
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return {"identity": me, "serial": board_serial(me["bus_id"]), "name": name,
            "versions": versions, "kernels": out, "skipped": skipped}


# ------------------------------------------------------------------------------ HBM patterns

_M32 = 0xFFFFFFFF


def _as_i32(x: torch.Tensor) -> torch.Tensor:
    """The low 32 bits of an int64 tensor as int32 words (two's complement)."""
    x = x & _M32
    return torch.where(x >= 1 << 31, x - (1 << 32), x).to(torch.int32)


def _pattern(name: str, idx: torch.Tensor) -> torch.Tensor:
    """The word pattern ``name`` holds at word indices ``idx`` (int64)."""
    kind, _, arg = name.rpartition("-")
    if kind == "walking-ones":
        return _as_i32(torch.ones_like(idx) << ((idx + int(arg)) % 32))
    if kind == "address":
        addr = idx * 4
        word = addr ^ (addr >> 32)  # blocks 4 GiB apart differ too
        return _as_i32(word if arg == "plain" else ~word)
    if kind == "random":
        x = (idx * 0x9E3779B1 + int(arg) * 0x85EBCA77) & _M32
        x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & _M32
        x = ((x ^ (x >> 12)) * 0x297A2D39) & _M32
        return _as_i32(x ^ (x >> 15))
    raise ValueError(f"unknown pattern {name!r}")


def _repeating(name: str, local: torch.Tensor) -> torch.Tensor | None:
    """The one chunk a pattern repeats at every chunk of ``len(local)`` words, else None:
    walking ones repeat every 32 words."""
    if name.startswith("walking-ones") and len(local) % 32 == 0:
        return _pattern(name, local)
    return None


def _expected(name: str, local: torch.Tensor, same: torch.Tensor | None, start: int,
              end: int) -> torch.Tensor:
    """The words ``start:end`` of pattern ``name`` (``same``: the chunk every chunk repeats)."""
    return same[:end - start] if same is not None else _pattern(name, local[:end - start] + start)


PATTERNS = ([f"walking-ones-{b}" for b in range(32)]
            + ["address-plain", "address-inverted", "random-1", "random-2"])


def hbm_patterns(fraction: float, reserve_bytes: int, patterns: list[str],
                 max_bytes: int | None = None, chunk_words: int = 1 << 26,
                 shown: int = 8, tamper: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write and read back every pattern over ``fraction`` of this GPU's free memory less
    ``reserve_bytes`` (at most ``max_bytes``; on the CPU accelerator ``max_bytes`` of host
    memory), all ranks at once: per pattern the words read back wrong and the first ``shown``
    of them (byte offset in the block, device address, word written, word read)."""
    dev = device()
    me = collective_calls.identity()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        free = torch.cuda.mem_get_info(dev)[0]
    else:
        free = max_bytes or 0
    nbytes = int(free * fraction) - reserve_bytes if dev.type == "cuda" else free
    nbytes = min(nbytes, max_bytes or nbytes)
    words = max(0, nbytes // 4 // chunk_words * chunk_words) or max(0, nbytes // 4)
    chunk = min(chunk_words, words) or 1
    buf = torch.empty(words, dtype=torch.int32, device=dev)
    base = buf.data_ptr()
    local = torch.arange(chunk, dtype=torch.int64, device=dev)
    found = []
    dist.barrier()
    for name in patterns:
        want = functools.partial(_expected, name, local, _repeating(name, local))
        for start in range(0, words, chunk):
            end = min(start + chunk, words)
            buf[start:end] = want(start, end)
        if tamper and (tamper["rank"], tamper["pattern"]) == (rank(), name):
            buf[tamper["word"]] ^= 1  # the real write, then one word wrong
        counts = []
        for start in range(0, words, chunk):
            end = min(start + chunk, words)
            counts.append((buf[start:end] != want(start, end)).sum())
        total = torch.stack(counts).cpu() if counts else torch.zeros(0, dtype=torch.int64)
        first: list[dict[str, int]] = []
        for c in torch.nonzero(total).flatten().tolist():
            start = c * chunk
            end = min(start + chunk, words)
            expected = want(start, end)
            wrong = torch.nonzero(buf[start:end] != expected).flatten()
            for i in wrong[:shown - len(first)].tolist():
                first.append({"offset": 4 * (start + i), "address": base + 4 * (start + i),
                              "expected": int(expected[i]), "found": int(buf[start + i])})
            if len(first) >= shown:
                break
        found.append({"name": name, "words": words, "errors": int(total.sum()),
                      "first": first})
    del buf, local
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
    dist.barrier()
    return {"identity": me, "serial": board_serial(me["bus_id"]), "free_bytes": free,
            "tested_bytes": 4 * words, "patterns": found}


# ------------------------------------------------------------------------------ the soak

SOAK_SHOWN = 4   # problems an iteration reports; the rest are counted


def _agree(flag: bool) -> bool:
    """True where every rank says so: all ranks take the same number of iterations (each one
    runs collectives)."""
    t = torch.tensor([int(flag)], dtype=torch.int32, device=device())
    if world() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def sustained_matmul(size: int, seconds: float) -> float:
    """bf16 (fp32 on the CPU) ``size``^3 products for about ``seconds``: TFLOPS."""
    dev = device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(SEED)
    a = torch.randn(size, size, generator=g).to(dev, dtype)
    b = torch.randn(size, size, generator=g).to(dev, dtype)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.matmul(a, b)
    sync()
    n, t0 = 0, time.perf_counter()
    while n == 0 or time.perf_counter() - t0 < seconds:
        for _ in range(8):
            torch.matmul(a, b)
        sync()
        n += 8
    elapsed = time.perf_counter() - t0
    del a, b
    return gpu_health.matmul_flops(size, size, size) * n / elapsed / 1e12


def _describe(cmp: Any) -> str:
    first = cmp.first_divergence
    return first.describe() if first is not None else "no comparison"


def _ka_problems(ka: dict[str, Any], first: dict[str, str] | None) -> list[str]:
    out = []
    for name, k in sorted(ka["kernels"].items()):
        if first is not None and first.get(name) != k["hash"]:
            out.append(f"{name}: result sha256:{k['hash'][:12]} differs from iteration 0's "
                       f"sha256:{first.get(name, '')[:12]} (same inputs, same GPU)")
        if k.get("peer_differ"):
            out.append(f"{name}: {k['peer_differ']} of {k['elements']} elements differ from "
                       "rank 0's")
        if not k["reference"]["used"] <= 1.0:  # NaN fails
            out.append(f"{name}: element {k['reference']['index']} is "
                       f"{k['reference']['value']!r}, the CPU float64 reference "
                       f"{k['reference']['reference']!r}: {k['reference']['used']:.3g} of its "
                       "bound")
    return out


def soak(seconds: float, kinds: list[str], size: int, tols: dict[str, tuple[float, float]],
         train: list[tuple[Any, Any]], matmul: tuple[int, float],
         hbm: tuple[float, int, int | None], patterns_per_iteration: int,
         progress_dir: str, max_iterations: int | None = None,
         tamper: dict[str, Any] | None = None) -> dict[str, Any]:
    """The burn-in loop on this rank's GPU, all ranks at once, for ``seconds`` (at least one
    iteration; at most ``max_iterations``). ``train``: (ZeroCase, Tol) pairs, each trained with
    ZeRO and DDP and compared; ``matmul``: (size, seconds); ``hbm``: (fraction, reserve bytes,
    max bytes), ``patterns_per_iteration`` of PATTERNS in turn. Per iteration: its mismatches,
    the first of them, and the matmul's TFLOPS; and iteration 0's kernel hashes and versions
    (``kernels``, ``versions``, as ``known_answers`` reports them) for the recorded answers."""
    me = collective_calls.identity()
    deadline = time.monotonic() + seconds
    t0 = time.monotonic()
    first: dict[str, str] | None = None
    iterations: list[dict[str, Any]] = []
    mismatches = 0
    opening: dict[str, Any] = {}  # iteration 0's kernels and versions: the catalogue's check
    progress = os.path.join(progress_dir, f"rank{rank()}.json")
    while _agree(not iterations or (time.monotonic() < deadline and (
            max_iterations is None or len(iterations) < max_iterations))):
        i = len(iterations)
        hit = tamper if tamper and tamper.get("iteration") == i else None
        ka = known_answers(kinds, size, 1, tols,
                           tamper=hit if hit and "kernel" in hit else None)
        hashes = {n: k["hash"] for n, k in ka["kernels"].items()}
        problems = _ka_problems(ka, first)
        first = first or hashes
        opening = opening or {"versions": ka["versions"],
                              "kernels": {n: {"hash": h} for n, h in hashes.items()}}
        for case, tol in train:
            factor = hit.get("perturb", 1.0) if hit else 1.0  # every rank's DeepSpeed side
            cmp = compare_rank_results([train_zero_and_ddp(case, perturb=factor)], tol,
                                       label=f"zero-{case.id}")
            if not cmp.ok:
                problems.append(f"ZeRO {case.id} off DDP: "
                                + "; ".join(cmp.problems[:1] or [_describe(cmp)]))
        tflops = sustained_matmul(*matmul)
        start = (i * patterns_per_iteration) % len(PATTERNS)
        names = (PATTERNS * 2)[start:start + patterns_per_iteration]
        mem = hbm_patterns(hbm[0], hbm[1], names, max_bytes=hbm[2],
                           tamper=hit if hit and "pattern" in hit else None)
        for p in mem["patterns"]:
            if p["errors"]:
                e = p["first"][0]
                problems.append(f"HBM {p['name']}: {p['errors']} of {p['words']} words read "
                                f"back wrong, first at offset {e['offset']:#x} (address "
                                f"{e['address']:#x})")
        mismatches += len(problems)
        iterations.append({"iteration": i, "elapsed_s": round(time.monotonic() - t0, 2),
                           "tflops": tflops, "mismatches": len(problems),
                           "problems": problems[:SOAK_SHOWN]})
        with open(progress + ".tmp", "w") as f:
            json.dump({"iterations": len(iterations), "mismatches": mismatches,
                       "bus_id": me["bus_id"]}, f)
        os.replace(progress + ".tmp", progress)
    return {"identity": me, "serial": board_serial(me["bus_id"]),
            "name": torch.cuda.get_device_name(device()) if device().type == "cuda" else "cpu",
            "iterations": iterations, **opening}
