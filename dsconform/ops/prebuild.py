"""Build the profile's promised ops in parallel when a run starts.

Built one after another, the four ops the h200-x2 profile promises took 169 s cold on 2xH200; in
parallel 56 s (docs/findings.md#op-builds). A run therefore starts one process per promised op as
soon as collection is done, with the machine's cores shared out among them (MAX_JOBS), building into
the same extensions cache every later load uses. Tests go on meanwhile: the promise tests and the
collectives need no op. The op tests then wait for their op's build and only load and check it; a
build that failed is reported by its op's test, with the diagnosis, from this build's result (no
second attempt). Ranks that need an op (FusedAdam in the ZeRO suite) wait for the build in torch's
own lock, which the build process holds open while it works (see dsconform.ops.buildlock).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

_MARK = "@@dsconform-build@@"
_CHILD = f"""
import json, sys
from dsconform.ops.load import load_op
from dsconform.ops.diagnose import format_failure
r = load_op(sys.argv[1])
out = {{**r.summary(), "failure": None if r.loaded else format_failure(r), "log_tail": r.log_tail}}
print({_MARK!r} + json.dumps(out, default=str), flush=True)
"""


@dataclass
class Build:
    op: str
    proc: subprocess.Popen
    started: float
    result: dict[str, Any] | None = None
    output: str = ""
    chunks: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None

    def drain(self) -> None:
        """Read the build's output as it comes: a build that prints more than a pipe holds
        (64 KiB of compiler warnings) would otherwise stop until its op's test reads it, and
        hold the extension lock that ranks needing the op wait on."""
        for line in self.proc.stdout:
            self.chunks.append(line)


@dataclass
class ParallelBuilds:
    """One build process per op; ``wait(op)`` returns its result (``loaded``, ``build_seconds``,
    ``built_now``, ``failure`` ...)."""
    jobs_per_op: int
    builds: dict[str, Build] = field(default_factory=dict)

    @classmethod
    def start(cls, ops: list[str], cores: int | None = None) -> ParallelBuilds:
        cores = cores or os.cpu_count() or 1
        self = cls(jobs_per_op=max(1, cores // max(1, len(ops))))
        env = {**os.environ, "MAX_JOBS": str(self.jobs_per_op), "PYTHONUNBUFFERED": "1"}
        for op in ops:
            proc = subprocess.Popen([sys.executable, "-c", _CHILD, op], env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            b = self.builds[op] = Build(op, proc, time.monotonic())
            b.reader = threading.Thread(target=b.drain, name=f"dsconform-build-{op}", daemon=True)
            b.reader.start()
        return self

    def wait(self, op: str, timeout_s: float = 900) -> dict[str, Any] | None:
        """The build's result; None when this run did not start a build of ``op``. A build
        that dies or runs past ``timeout_s`` is a result too (``loaded`` False, the reason)."""
        b = self.builds.get(op)
        if b is None:
            return None
        if b.result is None:
            try:
                b.proc.wait(timeout=max(1.0, timeout_s))
                b.output = self._output(b)
            except subprocess.TimeoutExpired:
                b.proc.kill()
                b.proc.wait()
                b.output = self._output(b)
                b.result = {"op": op, "loaded": False, "log_tail": b.output[-4000:],
                            "failure": f"op {op}: the parallel build did not finish within "
                                       f"{timeout_s:.0f} s"}
                return b.result
            line = next((ln for ln in b.output.splitlines() if ln.startswith(_MARK)), None)
            if line is None:
                b.result = {"op": op, "loaded": False, "log_tail": b.output[-4000:],
                            "failure": f"op {op}: the build process exited {b.proc.returncode} "
                                       f"without a result (a crash while building or loading)"}
            else:
                b.result = json.loads(line[len(_MARK):])
            b.result["wall_seconds"] = time.monotonic() - b.started
            b.result["jobs"] = self.jobs_per_op
        return b.result

    @staticmethod
    def _output(b: Build) -> str:
        if b.reader is not None:
            b.reader.join(timeout=10)  # the pipe closes when the process (group) has exited
        return "".join(b.chunks)

    def finished(self, op: str) -> bool:
        """Whether ``wait(op)`` would return at once (no build of op, or it has ended)."""
        b = self.builds.get(op)
        return b is None or b.result is not None or b.proc.poll() is not None

    def close(self) -> None:
        """Stop builds still running (the run ended or was interrupted). A killed build leaves
        its lock behind; the next run removes it (dsconform.ops.buildlock)."""
        for b in self.builds.values():
            if b.proc.poll() is None:
                b.proc.kill()
                b.proc.wait()
                self._output(b)
