"""The radar's environments: one virtualenv per torch release, DeepSpeed releases swapped in.

A torch wheel is several GB and a DeepSpeed release a few MB, so the radar keeps one venv per
torch under ``--venvs`` (``torch-2.11.0``) and installs into it, in order:

1. ``torch==VERSION`` (pip's cache is not used for it: the wheel is kept once, in the venv);
2. the DeepSpeed release a run needs (``pip install --no-build-isolation deepspeed==VERSION``
   with ``DS_BUILD_OPS=0``: a PyPI sdist builds as a pure-Python wheel against the venv's torch,
   and pip keeps that wheel, so swapping a release back in takes seconds);
3. this checkout of the suite (``pip install -e``), with the checkout's ``constraints.txt``
   less its torch and DeepSpeed lines, so the suite's own dependencies are the tested ones.

A venv is ready once its marker names its torch and the checkout it holds. The ops each
release builds live in the suite's op cache, keyed by torch and DeepSpeed (ops/cache.py), so
releases that share a venv never rebuild each other's.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from dsconform.tools.periods import TORCH_RELEASED, Version

READY = ".dsconform-radar-ready"  # in a venv: {"torch": ..., "suite": ...}
WARM = ".dsconform-radar-warm-"  # + DeepSpeed version: its CPU comm op and async_io are built
INSTALL_TIMEOUT_S = 1800
#: Lines of the checkout's constraints.txt the radar does not apply: the axes it varies.
NOT_CONSTRAINED = re.compile(r"^(torch|deepspeed|triton|nvidia-(?!ml-py))\b", re.I)
WARM_UP = r"""
import sys
from dsconform.ops.cache import ensure_extensions_dir
print(ensure_extensions_dir())
from deepspeed.accelerator import get_accelerator
acc = get_accelerator()
if acc.device_name() == "cpu":
    for name in ("ShareMemCommBuilder", "AsyncIOBuilder"):
        builder = acc.create_op_builder(name)
        if builder is not None and builder.is_compatible(verbose=False):
            builder.load()
            print(name, "built")
"""


class RadarError(RuntimeError):
    """One line that says what could not be done and how to fix it."""


def torch_release(spec: str) -> str:
    """``2.13`` -> the newest 2.13.x the period table knows (2.13.0); a full version as given."""
    if not re.fullmatch(r"\d+\.\d+(\.\d+)?([a-z0-9.+]*)", spec):
        raise RadarError(f"--torch {spec!r}: expected a torch release such as 2.14.1 or 2.13")
    if spec.count(".") >= 2:
        return spec
    known = [t for t in TORCH_RELEASED if t.startswith(spec + ".")]
    if not known:
        raise RadarError(f"--torch {spec}: no {spec}.x release known; give the full version")
    return max(known, key=Version)


def venv_dir(cache: Path, torch: str) -> Path:
    return cache / ("torch-" + re.sub(r"[^A-Za-z0-9.]+", "_", torch).strip("_"))


def run_logged(cmd: Sequence[str], log: Path, *, timeout_s: float,
               env: dict[str, str] | None = None, cwd: Path | None = None) -> int:
    """Run ``cmd`` with its output appended to ``log``; kill its process group at the timeout
    (exit 124)."""
    with open(log, "a") as out:
        out.write(f"$ {shlex.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            out.write(f"\n[dsconform radar: killed after {timeout_s:g} s]\n")
            return 124


def _metadata(python: Path, dist: str) -> str | None:
    """The version of ``dist`` that ``python`` sees (its metadata: nothing is imported)."""
    try:
        out = subprocess.run([str(python), "-c", "import importlib.metadata as m; "
                              f"print(m.version({dist!r}))"], capture_output=True, text=True,
                             timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def installed_deepspeed(python: Path) -> str | None:
    """The DeepSpeed version ``python`` imports."""
    return _metadata(python, "deepspeed")


def installed_torch(python: Path) -> str | None:
    """The torch version ``python`` imports, without its local build tag."""
    found = _metadata(python, "torch")
    return found.split("+")[0] if found else None


def sees_the_suite(python: Path) -> bool:
    """``python`` finds dsconform and its pytest entry point (the options --results needs)."""
    code = ("import importlib.metadata as m, dsconform; "
            "print(any(e.value.startswith('dsconform') "
            "for e in m.entry_points(group='pytest11')))")
    try:
        out = subprocess.run([str(python), "-c", code], capture_output=True, text=True,
                             timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and out.stdout.strip() == "True"


def _tail(log: Path, lines: int = 1) -> str:
    text = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return " | ".join(text[-lines:])[-300:] if text else "no output"


def _constraints(checkout: Path, where: Path) -> list[str]:
    """``-c FILE`` for the checkout's constraints.txt less the lines the radar varies. The file
    lies beside the venv ``where``, which may not exist yet and which ``venv --clear`` empties."""
    given = checkout / "constraints.txt"
    if not given.is_file():
        return []
    kept = [ln for ln in given.read_text().splitlines() if not NOT_CONSTRAINED.match(ln.strip())]
    path = where.with_name(where.name + ".constraints.txt")
    path.write_text("\n".join(kept) + "\n")
    return ["-c", str(path)]


def ensure_env(cache: Path, torch: str, deepspeed: str, checkout: Path,
               say: Callable[[str], None]) -> Path:
    """The python of the venv of ``torch`` holding ``deepspeed`` and this checkout of the suite,
    installing what is missing. RadarError when an install fails, naming its log."""
    where = venv_dir(cache, torch)
    python = where / "bin" / "python"
    marker = where / READY
    log = where.with_name(where.name + ".install.log")
    env = {**os.environ, "DS_BUILD_OPS": "0"}
    want = {"torch": torch, "suite": str(checkout.resolve())}
    try:
        ready = json.loads(marker.read_text()) == want and python.exists()
    except (OSError, ValueError):
        ready = False
    steps: list[tuple[str, list[str]]] = []
    if not ready:
        cache.mkdir(parents=True, exist_ok=True)
        log.write_text("")
        if installed_torch(python) != torch:
            steps += [(f"torch {torch}", [sys.executable, "-m", "venv", "--clear", str(where)]),
                      ("", [str(python), "-m", "pip", "install", "--no-cache-dir", "wheel",
                            f"torch=={torch}"])]
    if installed_deepspeed(python) != deepspeed or not ready:
        steps.append((f"deepspeed {deepspeed}",
                      [str(python), "-m", "pip", "install", "--no-build-isolation",
                       f"deepspeed=={deepspeed}"]))
    if not ready:
        steps.append(("the suite", [str(python), "-m", "pip", "install",
                                    *_constraints(checkout, where), "-e", str(checkout)]))
    if not steps:
        say(f"venv {where} (cached)")
        return python
    say(f"installing {', '.join(w for w, _ in steps if w)} into {where} (log {log})")
    started = time.monotonic()
    for _, cmd in steps:
        rc = run_logged(cmd, log, timeout_s=INSTALL_TIMEOUT_S, env=env)
        if rc != 0:
            raise RadarError(f"`{shlex.join(cmd[-3:])}` exited {rc} in {where} (see {log}): "
                             f"{_tail(log)}")
    for dist, found, wanted in (("torch", installed_torch(python), torch),
                                ("deepspeed", installed_deepspeed(python), deepspeed)):
        if found != wanted:
            raise RadarError(f"{where} imports {dist} {found}, not {wanted} (see {log})")
    marker.write_text(json.dumps(want) + "\n")
    say(f"installed in {time.monotonic() - started:.0f} s")
    return python


def has_gpu() -> bool:
    """An NVIDIA GPU is present (the driver's own listing; no torch import)."""
    gpus = Path("/proc/driver/nvidia/gpus")
    return gpus.is_dir() and any(gpus.iterdir())


def warm_up(python: Path, log: Path, say: Callable[[str], None], env: dict[str, str], *,
            gpu: bool) -> None:
    """Build the CPU accelerator's shm comm op and async_io once per release and venv, into the
    suite's op cache, before a rank waits for them (nothing to do where a GPU is)."""
    version = installed_deepspeed(python) or "unknown"
    marker = python.parent.parent / (WARM + version)
    if marker.is_file() or gpu:
        return
    say("building DeepSpeed's CPU comm and async_io ops (once per release and torch)")
    rc = run_logged([str(python), "-c", WARM_UP], log, timeout_s=INSTALL_TIMEOUT_S, env=env)
    if rc == 0:
        marker.write_text("ok\n")
    else:  # the suite's rank start-up reports it, with its diagnosis
        say(f"warning: the ops did not build (exit {rc}, see {log})")
