"""What DeepSpeed's JIT op builds need on this node, probed without DeepSpeed: libaio for
async_io, the nvidia-fs kernel module for gds. `--profile auto` promises those ops only where
they can build (dsconform.profile.select.training_ops)."""

from __future__ import annotations

import os
from pathlib import Path


def _include_dirs() -> list[Path]:
    extra = [p for var in ("CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH")
             for p in os.environ.get(var, "").split(os.pathsep) if p]
    return [Path(p) for p in extra] + [Path("/usr/include"), Path("/usr/local/include")]


def libaio_present() -> bool:
    """Whether DeepSpeed's async_io can build here: libaio's header and its library (Debian's
    libaio-dev), in the system paths or where CPATH / LIBRARY_PATH point (the bundle's
    install.sh points them at an unpacked libaio)."""
    import ctypes.util
    header = any((d / "libaio.h").is_file() for d in _include_dirs())
    lib_dirs = [p for p in os.environ.get("LIBRARY_PATH", "").split(os.pathsep) if p]
    library = ctypes.util.find_library("aio") is not None or any(
        any(Path(d).glob("libaio.so*")) for d in lib_dirs if Path(d).is_dir())
    return header and library


def nvidia_fs_loaded(modules: Path = Path("/proc/modules")) -> bool:
    """Whether the nvidia-fs kernel module (GPUDirect Storage) is loaded."""
    try:
        text = modules.read_text()
    except OSError:
        text = ""
    return any(line.split(" ", 1)[0] == "nvidia_fs" for line in text.splitlines()) \
        or Path("/proc/driver/nvidia-fs").exists()
