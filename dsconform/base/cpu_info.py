"""py-cpuinfo's answer about this node's CPU, asked once per process tree.

DeepSpeed asks py-cpuinfo (``cpuinfo.get_cpu_info()``) each time it constructs a
DeepSpeedCPUAdam or DeepSpeedCPULion, and twice each time a process first loads an op whose
compiler flags name the CPU (``OpBuilder.cpu_arch()``, ``simd_width()``: cpu_adam, async_io,
gds ...), even when the op is in the extensions cache. Each answer costs a second and more:
py-cpuinfo runs in a new interpreter, which times the CPU's clock across a one-second sleep
while the asking process polls for it on a core. A checkpoint round trip with CPU Adam asks
four times in a fresh rank
(docs/performance.md#what-dominates-cold-and-warm-1xh200-pytest-suites--m-gpu-auto).

The answer describes the node, so every process of a run can share it: ``install()`` makes
``cpuinfo.get_cpu_info`` return the first answer this process tree got (a copy each time),
from DSC_CPUINFO_JSON where a parent put it, else from py-cpuinfo itself. The value DeepSpeed
reads is py-cpuinfo's own, unchanged; only the repetition goes.

Only a usable answer is shared: one that names the CPU's ``arch`` (DeepSpeed's
``OpBuilder.cpu_arch()`` reads that key outside its try block). Anything else (a query that
failed, printed nothing or was cut short) is handed to that one caller and asked for again
by the next, as py-cpuinfo itself would. The query runs as ``python -m cpuinfo --json``, the
command line every release of py-cpuinfo and of its fork py-cpuinfo2 supports.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import threading
from typing import Any

#: The first answer, as JSON, for the processes this one starts (ranks, op builds).
ENV = "DSC_CPUINFO_JSON"

_STATE: dict[str, Any] = {"answer": None, "asking": None, "original": None}
_LOCK = threading.Lock()


def _module() -> Any:
    try:
        import cpuinfo
    except ImportError:  # DeepSpeed then falls back to lscpu itself
        return None
    return cpuinfo


def install() -> bool:
    """Make cpuinfo.get_cpu_info answer once per process tree; False without py-cpuinfo."""
    mod = _module()
    if mod is None:
        return False
    if mod.get_cpu_info is not remembered:  # installed already: its original stays
        _STATE["original"] = mod.get_cpu_info
    mod.get_cpu_info = remembered
    inner = getattr(mod, "cpuinfo", None)  # the package re-exports cpuinfo.cpuinfo's names
    if inner is not None and hasattr(inner, "get_cpu_info"):
        inner.get_cpu_info = remembered
    return True


def start_asking() -> None:
    """Start py-cpuinfo's own query now (the command its get_cpu_info runs) without waiting
    for it: the first ``remembered()`` reads its answer. For processes that import torch next,
    so the query's second overlaps the imports."""
    mod = _module()
    if mod is None or _STATE["answer"] is not None or _STATE["asking"] is not None \
            or os.environ.get(ENV):
        return
    try:
        _STATE["asking"] = subprocess.Popen(
            [sys.executable, "-m", "cpuinfo", "--json"], stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    except OSError:  # remembered() asks py-cpuinfo itself
        _STATE["asking"] = None


def usable(answer: Any) -> bool:
    """An answer DeepSpeed can read: a mapping that names the CPU's architecture."""
    return isinstance(answer, dict) and bool(answer.get("arch"))


def _parse(text: str | bytes | None) -> dict | None:
    if not text:
        return None
    try:
        found = json.loads(text)
    except ValueError:
        return None
    return found if usable(found) else None


def _answer_of_query(proc: subprocess.Popen) -> dict | None:
    """The started query's answer; None where it failed or named no architecture."""
    out, _ = proc.communicate()
    return _parse(out) if proc.returncode == 0 else None


def remembered() -> dict:
    """What ``cpuinfo.get_cpu_info()`` answered first in this process tree (a copy); while no
    usable answer came, each call asks py-cpuinfo again and returns what it said."""
    with _LOCK:
        if _STATE["answer"] is None:
            answer = _first_answer()
            if not usable(answer):
                return answer
            _STATE["answer"] = answer
            os.environ[ENV] = json.dumps(answer)
        return copy.deepcopy(_STATE["answer"])


def _first_answer() -> Any:
    answer = _parse(os.environ.get(ENV))
    proc, _STATE["asking"] = _STATE["asking"], None
    if answer is None and proc is not None:
        answer = _answer_of_query(proc)
    if answer is None:
        original = _STATE["original"]
        answer = original() if original is not None else {}
    return answer


def share() -> None:
    """Settle this process's answer and put it in its environment, for processes it starts
    next (their first question then costs nothing)."""
    if install():
        remembered()
