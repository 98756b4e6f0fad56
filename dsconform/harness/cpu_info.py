"""py-cpuinfo's answer about this node's CPU, asked once per process tree.

DeepSpeed asks py-cpuinfo (``cpuinfo.get_cpu_info()``) each time it constructs a
DeepSpeedCPUAdam or DeepSpeedCPULion, and twice each time a process first loads an op whose
compiler flags name the CPU (``OpBuilder.cpu_arch()``, ``simd_width()``: cpu_adam, async_io,
gds ...), even when the op is in the extensions cache. Each answer costs a second and more:
py-cpuinfo runs in a new interpreter, which times the CPU's clock across a one-second sleep
while the asking process polls for it on a core. A checkpoint round trip with CPU Adam asks
four times in a fresh rank; on 1xH200 those cells took 9 s where the same cell without offload
took 1.5 s.

The answer describes the node, so every process of a run can share it: ``install()`` makes
``cpuinfo.get_cpu_info`` return the first answer this process tree got (a copy each time),
from DSC_CPUINFO_JSON where a parent put it, else from py-cpuinfo itself. The value DeepSpeed
reads is py-cpuinfo's own, unchanged; only the repetition goes.
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
    script = getattr(getattr(mod, "cpuinfo", None), "__file__", None)
    if not script:
        return
    try:
        _STATE["asking"] = subprocess.Popen(
            [sys.executable, script, "--json"], stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    except OSError:  # remembered() asks py-cpuinfo itself
        _STATE["asking"] = None


def _answer_of_query(proc: subprocess.Popen) -> dict:
    """The query's answer; {} where it failed, as py-cpuinfo's get_cpu_info answers then."""
    out, _ = proc.communicate()
    if proc.returncode != 0:
        return {}
    try:
        found = json.loads(out.decode("utf-8"))
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


def remembered() -> dict:
    """What ``cpuinfo.get_cpu_info()`` answered first in this process tree (a copy)."""
    with _LOCK:
        if _STATE["answer"] is None:
            _STATE["answer"] = _first_answer()
        return copy.deepcopy(_STATE["answer"])


def _first_answer() -> dict:
    answer = None
    text = os.environ.get(ENV)
    if text:
        try:
            answer = json.loads(text)
        except ValueError:
            answer = None
    proc, _STATE["asking"] = _STATE["asking"], None
    if answer is None and proc is not None:
        answer = _answer_of_query(proc)
    if answer is None:
        original = _STATE["original"]
        answer = original() if original is not None else {}
    if answer:
        os.environ[ENV] = json.dumps(answer)
    return answer


def share() -> None:
    """Settle this process's answer and put it in its environment, for processes it starts
    next (their first question then costs nothing)."""
    if install():
        remembered()
