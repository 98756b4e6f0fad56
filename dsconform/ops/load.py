"""Build and load a DeepSpeed op for real, with the compiler's output captured: ds_report's
"compatible" is only a probe (docs/findings.md#op-builds). `load_op` never raises and says why an
op did not load (dsconform.ops.diagnose); `require_op` raises OpUnavailable."""

from __future__ import annotations

import functools
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

from dsconform.base.fdcapture import FdCapture
from dsconform.node.detect import shm_bytes
from dsconform.node.dsreport import strip_ansi
from dsconform.ops.cache import ensure_extensions_dir
from dsconform.ops.diagnose import Diagnosis, diagnose, format_failure

LOG_TAIL_LINES = 40
LOG_LINE_CHARS = 600  # verbose ninja prints compiler command lines thousands of characters long

# Lines that start the story of a failed build; not "\berror\b", which matches -Wno-error.
ERROR_LINE_RE = re.compile(r"\berror:|fatal error|FAILED:|undefined reference|cannot find -l|"
                           r": not found$", re.I)


def op_builders() -> dict[str, str]:
    """op name -> builder class name for this process's accelerator (DeepSpeed's ALL_OPS: on CPU
    `fused_adam` is a CPU implementation and there is no `gds`)."""
    from deepspeed.ops.op_builder.all_ops import ALL_OPS
    return {name: type(builder).__name__ for name, builder in ALL_OPS.items()}


def _create_builder(name: str) -> Any:
    from deepspeed.accelerator import get_accelerator
    builders = op_builders()
    if name not in builders:
        raise KeyError(f"op {name!r} is not provided by DeepSpeed's "
                       f"{get_accelerator()._name} accelerator "
                       f"(its ops: {', '.join(sorted(builders))})")
    return get_accelerator().create_op_builder(builders[name])


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


def _error_text(exc: BaseException) -> str:
    """The exception chain, innermost cause first (traceback order)."""
    chain: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in chain:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    return "\n".join(f"{type(e).__name__}: {e}" for e in reversed(chain))


def log_tail(text: str, n: int = LOG_TAIL_LINES) -> str:
    """The last `n` lines; when the first compiler error is earlier, its lines lead the tail
    (ninja runs the jobs in flight after the first failure, burying the error that matters)."""
    lines = [ln if len(ln) <= LOG_LINE_CHARS else ln[:LOG_LINE_CHARS] + " [...]"
             for ln in strip_ansi(text).splitlines()]
    first_err = next((i for i, ln in enumerate(lines) if ERROR_LINE_RE.search(ln)), None)
    if first_err is None or first_err >= len(lines) - n:
        return "\n".join(lines[-n:])
    head = lines[max(0, first_err - 1):first_err + n // 2]
    rest = n - len(head) - 1
    return "\n".join(head + ["[...]"] + lines[len(lines) - rest:])


def load_op(name: str) -> OpLoad:
    """Build (if needed) and load DeepSpeed op `name`; compiler output and failures are recorded."""
    from dsconform.base import cpu_info
    cpu_info.install()  # the builder's CPU flags: py-cpuinfo asked once per process tree
    ext_dir = ensure_extensions_dir()
    so = ext_dir / name / f"{name}.so"  # where torch.utils.cpp_extension.load builds `name`
    existed = so.exists()
    out = FdCapture()
    compatible, module, error, builder_name, already, seconds = False, None, None, None, False, 0.0
    with out.capture():
        try:
            # A lock left by a killed build would make this build wait forever.
            from dsconform.base.buildlock import clear_stale
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
                    built_now=loaded and not existed and not already and so.exists(),
                    module=module, error=error, log_tail=log_tail(out.text), builder=builder_name)
    if error is not None:
        result.diagnosis = diagnose(error, out.text, os.environ, shm_bytes=shm_bytes())
    return result


@functools.cache  # a failure raises, and functools.cache keeps no exception: the next call retries
def require_op(name: str) -> OpLoad:
    """The loaded op `name`, built and loaded once per process (a warm load still costs seconds:
    py-cpuinfo, probes); OpUnavailable when it does not load. For the checks, and for library
    code that calls an op's module (dsconform.storage.io)."""
    load = load_op(name)
    if not load.loaded:
        raise OpUnavailable(load)
    return load
