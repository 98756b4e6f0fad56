"""NCCL settings that change how collectives behave, for the report header and machine_info.

Two runs with the same hardware and software can still differ by an environment variable:
NCCL_ALGO / NCCL_PROTO pin an algorithm, NCCL_NVLS_ENABLE=0 turns NVLink SHARP off (the 2xH200
node sets it: docs/findings.md#2xh200-node), NCCL_IB_* pick HCAs and GID indices, NCCL_P2P_* /
NCCL_SHM_DISABLE change the transport. A comparison of two results files must show them.

Shown: every ``NCCL_*`` variable except the purely diagnostic ones (NCCL_DEBUG*, which change
what is logged, not what runs), PyTorch's ``TORCH_NCCL_*`` (blocking wait, stream handling), and
the CUDA variables that change which GPUs and how many hardware queues NCCL gets. NCCL also reads
its variables from a configuration file (``$NCCL_CONF_FILE``, before 2.23 ``~/.nccl.conf``, and
``/etc/nccl.conf``), where the environment wins; such values are shown with their file.
Upstream: https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["NcclSetting", "conf_files", "header_line", "machine_info", "nccl_settings"]

PREFIXES = ("NCCL_", "TORCH_NCCL_")
#: Only change logging; left out so the header shows what changes behaviour.
DIAGNOSTIC = frozenset({"NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE",
                        "NCCL_DEBUG_TIMESTAMP_FORMAT", "NCCL_DEBUG_TIMESTAMP_LEVELS",
                        "NCCL_CONF_FILE"})
#: Not NCCL's, but they change which devices NCCL sees, their order, and its stream concurrency.
CUDA_VARIABLES = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "CUDA_DEVICE_MAX_CONNECTIONS")
ENVIRONMENT = "environment"


@dataclass(frozen=True)
class NcclSetting:
    name: str
    value: str
    source: str  # "environment" or the configuration file it came from


def _relevant(name: str) -> bool:
    return (name.startswith(PREFIXES) and name not in DIAGNOSTIC) or name in CUDA_VARIABLES


def conf_files(environ: Mapping[str, str]) -> list[Path]:
    """NCCL's configuration files in the order it reads them (an earlier one wins)."""
    user = environ.get("NCCL_CONF_FILE") or str(Path(environ.get("HOME", "~")) / ".nccl.conf")
    return [Path(user).expanduser(), Path("/etc/nccl.conf")]


def _read_conf(path: Path) -> dict[str, str]:
    """NAME=VALUE lines, as NCCL reads them ('#' starts a comment)."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        return {}
    out = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        name, sep, value = line.partition("=")
        if sep and name.strip():
            out[name.strip()] = value.strip()
    return out


def nccl_settings(environ: Mapping[str, str] | None = None,
                  files: Sequence[Path] | None = None) -> list[NcclSetting]:
    """The settings in force, sorted by name: the environment first, then the configuration
    files for what the environment does not set (as NCCL does)."""
    env = os.environ if environ is None else environ
    found = {name: NcclSetting(name, value, ENVIRONMENT)
             for name, value in env.items() if _relevant(name)}
    for path in conf_files(env) if files is None else files:
        for name, value in _read_conf(path).items():
            if _relevant(name) and name not in found:
                found[name] = NcclSetting(name, value, str(path))
    return [found[name] for name in sorted(found)]


def header_line(settings: Sequence[NcclSetting]) -> str:
    """One line for the report header."""
    if not settings:
        return "NCCL settings: none set (NCCL's defaults)"
    shown = [f"{s.name}={s.value}" + ("" if s.source == ENVIRONMENT else f" [{s.source}]")
             for s in settings]
    return "NCCL settings: " + ", ".join(shown)


def machine_info(settings: Sequence[NcclSetting]) -> dict[str, dict[str, str]]:
    """For the results' machine_info: {name: {"value": ..., "source": ...}}."""
    return {s.name: {"value": s.value, "source": s.source} for s in settings}
