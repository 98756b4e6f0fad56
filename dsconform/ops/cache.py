"""The torch-extensions cache where JIT-built ops live: torch keys it by directory only, so the
suite keeps one per (torch, DeepSpeed, Python) environment under DSCONFORM_CACHE
(docs/findings.md#op-builds)."""

from __future__ import annotations

import getpass
import hashlib
import importlib.metadata
import importlib.util
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from dsconform import settings
from dsconform.node.detect import dist_version


def _torch_variant(torch_version: str | None, *, installed: bool = True) -> str:
    """cpu / cuXYZ / rocmX.Y / xpu without importing torch: a download.pytorch.org wheel's local
    version ("2.11.0+cu130"), else torch/version.py as text (PyPI's "2.11.0" carries none)."""
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
        if m := re.search(rf"^{attr}\s*(?::[^=]*)?=\s*['\"]([\d.]+)['\"]", text, re.M):
            return prefix + "".join(m[1].split(".")[:2])
    return "cpu"


def environment_key(*, torch_version: str | None = None, deepspeed_version: str | None = None,
                    python: tuple[int, int] | None = None) -> str:
    """py311-torch2.13.0-ds0.19.8-cpu: what an op binary built here depends on; the arguments
    describe another environment (default: this one, read without importing torch or DeepSpeed)."""
    torch_v = torch_version or dist_version("torch")
    ds_v = deepspeed_version or dist_version("deepspeed") or "none"
    major, minor = python or sys.version_info[:2]
    # abiflags: a free-threaded 3.13t interpreter cannot load a 3.13 build
    py = f"py{major}{minor}{sys.abiflags}"
    key = (f"{py}-torch{(torch_v or 'none').split('+')[0]}-ds{ds_v}-"
           f"{_torch_variant(torch_v, installed=torch_version is None)}")
    if deepspeed_version is None:
        # Two installs of one version (two virtualenvs, a tox env, an offline --target site) must
        # not rebuild each other's ops (docs/options.md): the install's location is in the key.
        spec = importlib.util.find_spec("deepspeed")
        where = str(Path(spec.origin).resolve().parent) if spec and spec.origin else "none"
        key += f"-{hashlib.sha256(where.encode()).hexdigest()[:8]}"
    return re.sub(r"[^A-Za-z0-9._-]", "_", key)


def cache_root() -> Path:
    """$DSCONFORM_CACHE, default ~/.cache/dsconform."""
    return Path(settings.get("DSCONFORM_CACHE") or Path.home() / ".cache" / "dsconform")


def extensions_dir() -> Path:
    """$DSCONFORM_CACHE (default ~/.cache/dsconform)/torch_extensions/<environment_key()>."""
    return cache_root() / "torch_extensions" / environment_key()


def ensure_extensions_dir() -> Path:
    """Point TORCH_EXTENSIONS_DIR at `extensions_dir()` unless the user set it; create it."""
    if not os.environ.get("TORCH_EXTENSIONS_DIR"):
        os.environ["TORCH_EXTENSIONS_DIR"] = str(extensions_dir())
    path = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    path.mkdir(parents=True, exist_ok=True)
    return path


def inductor_cache_dir() -> Path:
    """Where torch's inductor keeps its compiled kernels (default <tmp>/torchinductor_<user>)."""
    if given := os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return Path(given)
    user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())
    return Path(tempfile.gettempdir()) / f"torchinductor_{user}"


def sweep_inductor_cache(root: Path | None = None, *, older_than_s: float = 120.0) -> list[str]:
    """torch links an inductor kernel straight into its cache path and loads any file found
    there: a link killed midway (a rank stopped while DeepSpeed's Muon compiled) leaves a
    truncated library that fails every later run needing that kernel ("ImportError: ... .so:
    file too short"). Remove each library in the cache that is not an ELF object and is older
    than ``older_than_s`` (a link in progress is seconds old), so that torch compiles it again;
    returns a notice per file removed."""
    root = root or inductor_cache_dir()
    notices = []
    now = time.time()
    for lib in root.rglob("*.so") if root.is_dir() else ():
        try:
            if now - lib.stat().st_mtime < older_than_s:
                continue
            with lib.open("rb") as f:
                if f.read(4) == b"\x7fELF":
                    continue
            lib.unlink()
        except OSError:
            continue
        notices.append(f"removed {lib}: a truncated inductor kernel (its compile was killed); "
                       f"torch compiles it again")
    return notices


def bytecode_dir() -> Path:
    """Compiled Python of the suite's processes where writing it beside the sources is forbidden."""
    return cache_root() / "pycache"


def enable_bytecode_cache(env: dict[str, str] | None = None) -> Path | None:
    """Where PYTHONDONTWRITEBYTECODE is set (container images) and PYTHONPYCACHEPREFIX is not,
    keep compiled Python in ``bytecode_dir()`` (never beside the sources) for this process and
    those it starts (``env``, default os.environ); else every process compiles torch and
    DeepSpeed anew (docs/performance.md#rank-start-up). DSCONFORM_PYCACHE=0 leaves the
    environment as it is. Returns the directory used, or None."""
    env = os.environ if env is None else env
    if (not settings.get("DSCONFORM_PYCACHE", env) or not env.get("PYTHONDONTWRITEBYTECODE")
            or env.get("PYTHONPYCACHEPREFIX")):
        return None
    where = bytecode_dir()
    try:
        where.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # a read-only cache: compile as before
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(where)
    if env is os.environ:
        sys.dont_write_bytecode = False
        sys.pycache_prefix = str(where)
    return where

