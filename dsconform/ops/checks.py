"""Every op check, one entry point: check_op (load, then the op's functional check), each run
in a child process so that a crash in native code fails one test, not the run
(IsolatedOpCheck), and scheduled for a run beside the parallel builds (OpChecks: compute
ops together, I/O ops one at a time)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsconform.checks.op_compute import (
    check_adam_modes,
    check_cpu_adagrad,
    check_cpu_adam,
    check_cpu_lion,
    check_fused_adam,
)
from dsconform.checks.op_io import check_async_io, check_gds
from dsconform.ops.load import OpLoad, log_tail, require_op

if TYPE_CHECKING:
    from dsconform.ops.prebuild import ParallelBuilds


#: Ops whose check reads and writes the disk (under scratch_dir) and records its rates: their
#: checks run one at a time, so a rate is never measured while another op's check does I/O.
IO_OPS = frozenset({"async_io", "gds"})

# (the op as loaded, device, scratch) -> the check's result. The Adam ops run in both of their
# modes: AdamW, and Adam with L2 weight decay.
FUNCTIONAL_CHECKS: dict[str, Callable[[OpLoad, str, Any], dict[str, Any]]] = {
    "cpu_adam": lambda load, device, scratch: check_adam_modes(check_cpu_adam),
    "fused_adam": lambda load, device, scratch: check_adam_modes(check_fused_adam, device),
    "cpu_adagrad": lambda load, device, scratch: check_cpu_adagrad(),
    "cpu_lion": lambda load, device, scratch: check_cpu_lion(),
    "async_io": lambda load, device, scratch: check_async_io(load.module, scratch),
    "gds": lambda load, device, scratch: check_gds(load.module),
}


def check_op(name: str, *, device: str = "cpu",
             scratch_dir: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Load op `name` and, where one exists, run its functional check (a benchmark record);
    OpUnavailable when the op does not build or load, AssertionError when its result is wrong."""
    load = require_op(name)
    result: dict[str, Any] = load.summary()
    check = FUNCTIONAL_CHECKS.get(name)
    result["checked"] = "functional" if check else "load only"
    if name in IO_OPS and scratch_dir is None:
        raise ValueError(f"check_op({name!r}) writes a file: "
                         "pass scratch_dir (the suite's --scratch DIR)")
    if check:
        result.update(check(load, device, scratch_dir))
    return result


class OpCrashed(RuntimeError):
    """The child process running an op check died (signal, abort, non-JSON exit)."""


_MARK = "@@dsconform-op-result@@"
_CHILD = f"""
import json, sys, traceback
from dsconform.ops.checks import check_op
from dsconform.ops.load import OpUnavailable
name, device, scratch = sys.argv[1], sys.argv[2], sys.argv[3] or None
try:
    out = {{"status": "ok", "result": check_op(name, device=device, scratch_dir=scratch)}}
except OpUnavailable as e:
    out = {{"status": "unavailable", "message": str(e)}}
except AssertionError as e:
    out = {{"status": "wrong", "message": str(e)}}
except Exception as e:
    out = {{"status": "error", "message": "".join(traceback.format_exception(e))}}
sys.stdout.flush()
print("\\n" + {_MARK!r} + json.dumps(out, default=str))
"""


class IsolatedOpCheck:
    """check_op in a child Python process, started now and read later, so that several ops'
    checks (each mostly the child's import of torch and deepspeed) run at once. Native code can
    abort the process (DeepSpeed's aio asserts on an unaligned read; GDS I/O on a non-GDS disk,
    docs/findings.md#deepnvme): the child's death becomes OpCrashed naming the signal and its
    output."""

    def __init__(self, name: str, proc: Any) -> None:
        self.name = name
        self.proc = proc
        self._out: tuple[str, str] | None = None
        self._timed_out: float | None = None

    @classmethod
    def start(cls, name: str, *, device: str = "cpu",
              scratch_dir: str | os.PathLike[str] | None = None) -> IsolatedOpCheck:
        from dsconform.base import cpu_info

        cpu_info.share()  # the child's op load asks py-cpuinfo: answered from here
        cmd = [sys.executable, "-c", _CHILD, name, device, os.fspath(scratch_dir or "")]
        # The child runs in scratch_dir: gds_handle writes local_cufile.json into its working
        # directory, which must not be the user's checkout. This dsconform stays importable.
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
        if self._out is None:
            try:
                self._out = self.proc.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self._timed_out = timeout_s
                self._out = tuple(str(out or "") for out in self.proc.communicate())

    def result(self, timeout_s: float = 900) -> dict[str, Any]:
        """The check's result (a dict); raises OpUnavailableText, AssertionError or OpCrashed."""
        name, proc = self.name, self.proc
        self.wait(timeout_s)
        stdout, stderr = self._out
        output = stdout + stderr
        if self._timed_out is not None:
            raise OpCrashed(f"op {name}: check did not finish within {self._timed_out:.0f} s\n"
                            f"{log_tail(output)}")
        marker = stdout.rfind(_MARK)
        if marker < 0:
            how = (f"killed by {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
                   else f"exited {proc.returncode}")
            raise OpCrashed(f"op {name}: the process running its check {how} before reporting "
                            f"(a crash in native code)\noutput (tail):\n{log_tail(output)}")
        out = json.loads(stdout[marker + len(_MARK):].strip().splitlines()[0])
        if out["status"] == "ok":
            return out["result"]
        if exc := {"unavailable": OpUnavailableText, "wrong": AssertionError}.get(out["status"]):
            raise exc(out["message"])
        raise OpCrashed(f"op {name}: the check raised unexpectedly:\n{out['message']}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


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

    def start_all(self) -> None:
        """Start every check in the background, each once its build has ended, the I/O ones one
        by one (a run with a background cell batch: the ops tests then only read the results)."""
        def run() -> None:
            for op in self.ops:
                if self.closed:
                    return
                with contextlib.suppress(Exception):  # the op's own test calls get() and reports it
                    self.get(op)
        threading.Thread(target=run, name="dsconform-op-checks", daemon=True).start()

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


def checks_for_run(ops: Sequence[str], device: str, builds: ParallelBuilds | None,
                   scratch_root: str | os.PathLike[str]) -> OpChecks:
    """The checks of ``ops`` on ``device`` for this run, each started as its parallel build
    (``builds``; None: no builds were started) ends, their scratch under scratch_root."""
    return OpChecks(list(ops), device=device, scratch_root=scratch_root,
                    build_result=(builds.wait if builds is not None else lambda op: None),
                    build_done=(builds.finished if builds is not None else lambda op: True))


class OpUnavailableText(RuntimeError):
    """OpUnavailable as reported by a child process: the formatted failure."""
