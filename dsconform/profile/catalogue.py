"""The GPU model catalogue (gpu_models.toml beside this module): what each GPU model is and the
per-GPU floors a node of it must reach, each with its source.

`--profile auto` composes a node's detected hardware with its model's entry, and a profile may
name an entry (``[gpus] catalogue = "h200"``) instead of repeating its numbers. The catalogue is
validated as strictly as a profile: every problem names the entry and the field.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

CATALOGUE_FILE = Path(__file__).with_name("gpu_models.toml")
#: The floors an entry carries: profile [gpus] field -> what it measures (units in the file).
FLOOR_FIELDS = {
    "matmul_bf16_tflops": "dense bf16 matmul, TFLOPS",
    "matmul_fp16_tflops": "dense fp16 matmul, TFLOPS",
    "hbm_gbps": "device-to-device copy, GB/s counting read and write",
    "h2d_gbps": "pinned host-to-device copy, GB/s",
    "d2h_gbps": "pinned device-to-host copy, GB/s",
}
#: Datasheet peaks an entry may carry (optional): field -> what it is. Nothing is held to them;
#: they are the denominator of a model-FLOPs utilisation (MFU).
PEAK_FIELDS = {"peak_bf16_tflops": "dense bf16 Tensor Core peak from the datasheet, TFLOPS"}
_KEY_RE = re.compile(r"^[a-z0-9][a-z0-9-]*$")
_CC_RE = re.compile(r"^\d+\.\d+$")
_PCIE_RE = re.compile(r"^Gen[1-6] x(1|2|4|8|16)$")


class CatalogueError(ValueError):
    """Problems of a catalogue file, one line each: FILE: models.KEY.FIELD: reason."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class Floor:
    value: float
    source: str


@dataclass(frozen=True)
class GpuModel:
    key: str
    name: str
    match: tuple[str, ...]
    exclude: tuple[str, ...]
    memory_gib: float
    compute_capability: str
    bf16: bool
    fp16: bool
    pcie: str
    floors: Mapping[str, Floor]
    peaks: Mapping[str, Floor] = field(default_factory=dict)  # Floor.value: the peak

    def matches(self, device_name: str) -> bool:
        """Whether a device name (NVML's or torch's) is this model."""
        low = device_name.lower()
        return (any(m.lower() in low for m in self.match)
                and not any(x.lower() in low for x in self.exclude))

    def floor(self, field_name: str) -> float | None:
        f = self.floors.get(field_name)
        return f.value if f else None

    def describe(self) -> str:
        return f"{self.key} ({self.name})"


def _problems(data: Mapping[str, Any], src: str) -> list[str]:
    problems: list[str] = []
    models = data.get("models")
    if not isinstance(models, dict) or not models:
        return [f"{src}: models: required, a table of GPU models"]
    for extra in set(data) - {"models"}:
        problems.append(f"{src}: {extra}: unknown table (only [models.KEY])")
    for key, entry in models.items():
        at = f"{src}: models.{key}"
        if not _KEY_RE.match(key):
            problems.append(f"{at}: the key must be lower case letters, digits and dashes")
        if not isinstance(entry, dict):
            problems.append(f"{at}: expected a table")
            continue
        fields = {"name": str, "match": list, "exclude": list, "memory_gib": (int, float),
                  "compute_capability": str, "bf16": bool, "fp16": bool, "pcie": str,
                  **dict.fromkeys(FLOOR_FIELDS, dict), **dict.fromkeys(PEAK_FIELDS, dict)}
        for name in set(entry) - set(fields):
            problems.append(f"{at}.{name}: unknown field (known: {', '.join(sorted(fields))})")
        for name, kind in fields.items():
            value = entry.get(name)
            if value is None:
                if name != "exclude" and name not in PEAK_FIELDS:
                    problems.append(f"{at}.{name}: required")
                continue
            if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
                problems.append(f"{at}.{name}: expected {getattr(kind, '__name__', 'a number')}"
                                f", found {value!r}")
                continue
            if name in ("match", "exclude") and not all(isinstance(m, str) and m
                                                        for m in value):
                problems.append(f"{at}.{name}: expected non-empty strings")
            if name == "match" and not value:
                problems.append(f"{at}.match: at least one substring of the device name")
            if name == "memory_gib" and value <= 0:
                problems.append(f"{at}.memory_gib: must be > 0")
            if name == "compute_capability" and not _CC_RE.match(value):
                problems.append(f"{at}.compute_capability: expected MAJOR.MINOR, found {value!r}")
            if name == "pcie" and not _PCIE_RE.match(value):
                problems.append(f"{at}.pcie: expected 'GenN xW' (e.g. 'Gen5 x16'), found "
                                f"{value!r}")
            if name in FLOOR_FIELDS:
                problems += _floor_problems(value, f"{at}.{name}")
            if name in PEAK_FIELDS:
                problems += _floor_problems(value, f"{at}.{name}", key="value")
    return problems


def _floor_problems(value: Mapping[str, Any], at: str, key: str = "floor") -> list[str]:
    out = []
    for extra in set(value) - {key, "source"}:
        out.append(f"{at}.{extra}: unknown (expected `{key}` and `source`)")
    floor = value.get(key)
    if isinstance(floor, bool) or not isinstance(floor, (int, float)) or floor <= 0:
        out.append(f"{at}.{key}: expected a number > 0, found {floor!r}")
    source = value.get("source")
    if not isinstance(source, str) or not source.strip():
        out.append(f"{at}.source: required: where the number comes from (a node type and "
                   "results folder, or a datasheet figure and the fraction taken)")
    return out


def parse(data: Mapping[str, Any], src: str = "<catalogue>") -> dict[str, GpuModel]:
    """The catalogue's models by key; CatalogueError naming every problem."""
    problems = _problems(data, src)
    if problems:
        raise CatalogueError(problems)
    return {key: GpuModel(
        key=key, name=e["name"], match=tuple(e["match"]), exclude=tuple(e.get("exclude", ())),
        memory_gib=float(e["memory_gib"]), compute_capability=e["compute_capability"],
        bf16=e["bf16"], fp16=e["fp16"], pcie=e["pcie"],
        floors={f: Floor(float(e[f]["floor"]), e[f]["source"]) for f in FLOOR_FIELDS},
        peaks={f: Floor(float(e[f]["value"]), e[f]["source"]) for f in PEAK_FIELDS if f in e})
        for key, e in data["models"].items()}


def load(path: str | Path = CATALOGUE_FILE) -> dict[str, GpuModel]:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except OSError as e:
        raise CatalogueError([f"{path}: cannot read: {e.strerror or e}"]) from None
    except tomllib.TOMLDecodeError as e:
        raise CatalogueError([f"{path}: not valid TOML: {e}"]) from None
    return parse(data, str(path))


@cache
def shipped() -> dict[str, GpuModel]:
    """The shipped catalogue (a broken one is a bug of the suite: it raises)."""
    return load(CATALOGUE_FILE)


def is_catalogue(data: Mapping[str, Any]) -> bool:
    """Whether parsed TOML is a catalogue (for `dsconform validate`), not a profile."""
    return "models" in data and "profile" not in data


def find(names: Sequence[str]) -> GpuModel | None:
    """The one entry every given device name matches, or None (no names, an unknown model,
    GPUs of different models, or two entries matching: the catalogue is then ambiguous)."""
    if not names:
        return None
    found = {m.key: m for m in shipped().values() if all(m.matches(n) for n in names)}
    return next(iter(found.values())) if len(found) == 1 else None


def peak_tflops(device_name: str, dtype: str) -> Floor | None:
    """The datasheet peak of ``dtype`` ("bf16") for the GPU model named ``device_name`` (its
    ``value`` and ``source``), or None where the catalogue has no such model or peak."""
    model = find([device_name])
    return None if model is None else model.peaks.get(f"peak_{dtype}_tflops")
