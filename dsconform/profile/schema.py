"""Hardware profiles: what a node type promises, loaded from TOML and validated strictly.

A profile is a contract. Every field that is present is a promise the suite enforces (a node that
does not meet it FAILS); every field that is absent is no promise (tests that need it skip).
Bandwidths are GB/s with GB = 1e9 bytes; sizes are bytes unless the field name says GiB (2**30).

Validation never stops at the first problem: it collects every one as
``FILE: FIELD: REASON`` so a user fixes a profile in one pass.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsconform.base import versions

# The collectives and their floors are the checks' (dsconform/checks/collectives.py); the names
# are this module's too.
from dsconform.checks.collectives import COLLECTIVES as COLLECTIVES
from dsconform.checks.collectives import NcclFloor as NcclFloor


def _profiles_dir() -> Path:
    """The checkout's hardware_profiles/ (where profiles are edited), else the copy a wheel
    install ships inside the package (pyproject.toml: dsconform.hardware_profiles)."""
    package = Path(__file__).resolve().parents[1]
    checkout = package.parent / "hardware_profiles"
    return checkout if checkout.is_dir() else package / "hardware_profiles"


PROFILES_DIR = _profiles_dir()

# A profile's NVMe path may name the run's --scratch directory instead of a fixed mount.
SCRATCH_TOKEN = "@scratch"
_VERSION_RE = re.compile(r"^\d+(\.\d+){0,2}$")
_CC_RE = re.compile(r"^\d+\.\d+$")
_OP_RE = re.compile(r"^[a-z][a-z0-9_]*$")


class ProfileError(ValueError):
    """A profile that cannot be used. ``problems`` holds one ``FILE: FIELD: REASON`` per defect."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


@dataclass(frozen=True)
class NvmePath:
    path: str
    read_gbps: float
    write_gbps: float
    gds: bool = False
    bytes: int = 1 << 30  # transfer size the floors were measured with
    # read_gbps/write_gbps hold transfers from page-locked CPU memory; these hold transfers from
    # GPU memory (through DeepNVMe's bounce buffer, or GDS where gds = true). None: recorded,
    # not floored.
    gpu_read_gbps: float | None = None
    gpu_write_gbps: float | None = None
    source: str = ""  # where the floors came from

    def resolve(self, scratch: Path | None) -> Path:
        if self.path == SCRATCH_TOKEN:
            if scratch is None:
                raise ProfileError([f"nvme.paths: path {SCRATCH_TOKEN} needs --scratch DIR"])
            return scratch
        return Path(self.path)


# The checkpoint suite's engines a floor may name (suites/test_checkpoint.py ENGINES).
CHECKPOINT_ENGINES = ("torch", "fast")


@dataclass(frozen=True)
class CheckpointFloor:
    """Save/load GB/s (1e9 B/s) the checkpoint suite's throughput tests must reach with one
    checkpoint engine: the suite's own checkpoint (ZeRO-3, fp32, 2 ranks), bytes over time until
    durable (save) or from the device (load), median of 3 rounds."""
    engine: str
    save_gbps: float | None = None
    load_gbps: float | None = None
    source: str = ""


@dataclass(frozen=True)
class Profile:
    name: str
    source: str  # file path, or "detected"
    description: str = ""
    gpu_count: int | None = None
    gpu_model: str | None = None
    gpu_min_memory_gib: float | None = None
    gpu_compute_capability: str | None = None
    bf16: bool | None = None
    fp16: bool | None = None
    # Per-GPU health (suites/test_collectives.py): a GPU, link or rank (CPU ranks too) more
    # than this many percent slower than its peers' median is a straggler (None: the default,
    # dsconform/node/gpu_health.py DEFAULT_STRAGGLER_PCT).
    straggler_pct: float | None = None
    # Dense matmul floors per GPU, TFLOPS = 1e12 flop/s (M = N = K = 8192).
    matmul_bf16_tflops: float | None = None
    matmul_fp16_tflops: float | None = None
    # Per-GPU copy floors, GB/s = 1e9 B/s: device-to-device counting read and write, and pinned
    # host transfers each way (suites/test_gpu.py).
    hbm_gbps: float | None = None
    h2d_gbps: float | None = None
    d2h_gbps: float | None = None
    # The GPU catalogue entry the floors above come from where the profile did not set them
    # (dsconform/profile/gpu_models.toml); None: none named.
    gpu_catalogue: str | None = None
    nccl_min_version: str | None = None
    nccl_floors: tuple[NcclFloor, ...] = ()
    nvme_paths: tuple[NvmePath, ...] = ()
    checkpoint_floors: tuple[CheckpointFloor, ...] = ()
    ops: tuple[str, ...] = ()
    deepspeed_min_version: str | None = None
    onebit: tuple[str, ...] = ()  # 1-bit optimizers that must train (dsconform/base/removed.py)
    min_shm_gib: float | None = None
    min_cpu_cores: int | None = None
    min_host_memory_gib: float | None = None
    check_cuda_driver: bool = False
    tolerances: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    # [health]: limits of the hardware error gate (dsconform/node/severity.py Thresholds); an
    # absent key keeps the gate's default.
    health: Mapping[str, float] = field(default_factory=dict)

    @property
    def gpus_promised(self) -> int:
        return self.gpu_count or 0


# ---------------------------------------------------------------- schema
# Each field: (type, required, check) where check returns an error string or None.

def _positive(v: Any) -> str | None:
    return None if v > 0 else "must be > 0"


def _mib_multiple(v: Any) -> str | None:
    """An NVMe transfer size: the suite moves it in 1 MiB blocks (O_DIRECT)."""
    return None if v > 0 and v % (1 << 20) == 0 else (
        "must be a positive multiple of 1 MiB (1048576): the suite transfers in 1 MiB blocks")


def _percent(v: Any) -> str | None:
    return None if 0 < v < 100 else "must be a percentage, > 0 and < 100"


def _non_negative(v: Any) -> str | None:
    return None if v >= 0 else "must be >= 0"


def _version_field(v: str) -> str | None:
    """A profile field holding a version: parsed the one way (dsconform.base.versions)."""
    ok = _VERSION_RE.match(v) and versions.parse(v) is not None
    return None if ok else "must look like 2.21 or 2.21.5"


def _cc(v: str) -> str | None:
    return None if _CC_RE.match(v) else 'must look like "9.0" (major.minor, no suffix)'


def _collective(v: str) -> str | None:
    return None if v in COLLECTIVES else f"must be one of {', '.join(COLLECTIVES)}"


def _catalogue_key(v: str) -> str | None:
    from dsconform.profile import catalogue
    models = catalogue.shipped()
    return None if v in models else (f"no such entry in {catalogue.CATALOGUE_FILE.name} "
                                     f"(entries: {', '.join(models)})")


def _nonempty(v: str) -> str | None:
    return None if v.strip() else "must not be empty"


def _abs_path(v: str) -> str | None:
    if v == SCRATCH_TOKEN or os.path.isabs(v):
        return None
    return f'must be an absolute path or "{SCRATCH_TOKEN}"'


_NUM = (int, float)
SCHEMA: dict[str, dict[str, tuple]] = {
    "profile": {"name": (str, True, _nonempty), "description": (str, False, None)},
    "gpus": {
        "count": (int, True, _non_negative),
        "model": (str, False, _nonempty),
        "min_memory_gib": (_NUM, False, _positive),
        "compute_capability": (str, False, _cc),
        "bf16": (bool, False, None),
        "fp16": (bool, False, None),
        "straggler_pct": (_NUM, False, _percent),  # percent slower than the peers' median
        "matmul_bf16_tflops": (_NUM, False, _positive),  # TFLOPS = 1e12 flop/s, per GPU
        "matmul_fp16_tflops": (_NUM, False, _positive),
        "hbm_gbps": (_NUM, False, _positive),  # GB/s, a device copy counting read and write
        "h2d_gbps": (_NUM, False, _positive),  # GB/s, pinned host memory to one GPU
        "d2h_gbps": (_NUM, False, _positive),
        "catalogue": (str, False, _catalogue_key),  # an entry of dsconform/profile/gpu_models.toml
    },
    "nccl": {"min_version": (str, False, _version_field), "floors": (list, False, None)},
    "nccl.floors": {
        "collective": (str, True, _collective),
        "bytes": (int, True, _positive),
        "busbw_gbps": (_NUM, True, _positive),
        "world_size": (int, False, _positive),
        "source": (str, False, None),
    },
    "nvme": {"paths": (list, False, None)},
    "nvme.paths": {
        "path": (str, True, _abs_path),
        "read_gbps": (_NUM, True, _positive),
        "write_gbps": (_NUM, True, _positive),
        "gds": (bool, False, None),
        "bytes": (int, False, _mib_multiple),
        "gpu_read_gbps": (_NUM, False, _positive),
        "gpu_write_gbps": (_NUM, False, _positive),
        "source": (str, False, None),
    },
    "checkpoint": {"floors": (list, False, None)},
    "checkpoint.floors": {
        "engine": (str, True, lambda v: None if v in CHECKPOINT_ENGINES
                   else f"must be one of {', '.join(CHECKPOINT_ENGINES)}"),
        "save_gbps": (_NUM, False, _positive),
        "load_gbps": (_NUM, False, _positive),
        "source": (str, False, None),
    },
    "deepspeed": {"ops": (list, False, None), "min_version": (str, False, _version_field),
                  "onebit": (list, False, None)},
    "system": {
        "min_shm_gib": (_NUM, False, _positive),
        "min_cpu_cores": (int, False, _positive),
        "min_memory_gib": (_NUM, False, _positive),
        "check_cuda_driver": (bool, False, None),
    },
    "tolerances": {},  # free keys, checked against the tolerance table
    "health": {  # the hardware error gate's limits (docs/health.md)
        "max_corrected_ecc_per_hour": (_NUM, False, _non_negative),
        "max_pcie_replays_per_minute": (_NUM, False, _non_negative),
        "max_nvlink_crc_errors_per_second": (_NUM, False, _non_negative),
        "max_nvlink_replay_errors": (int, False, _non_negative),
    },
}
REQUIRED_TABLES = ("profile", "gpus")


def _type_name(t: Any) -> str:
    if t is _NUM:
        return "number"
    return {str: "string", int: "integer", bool: "boolean", list: "array"}.get(t, str(t))


def _check_fields(where: str, table: Any, schema_key: str, problems: list[str], src: str) -> None:
    if not isinstance(table, dict):
        problems.append(f"{src}: {where}: must be a table")
        return
    spec = SCHEMA[schema_key]
    for key in table:
        if key not in spec:
            known = ", ".join(spec) or "(none)"
            problems.append(f"{src}: {where}.{key}: unknown key (known: {known})")
    for key, (typ, required, check) in spec.items():
        if key not in table:
            if required:
                problems.append(f"{src}: {where}.{key}: required")
            continue
        value = table[key]
        # bool is an int subclass in Python; a promise of "count = true" is a typo, not 1.
        ok = isinstance(value, typ) and not (isinstance(value, bool) and typ is not bool)
        if not ok:
            problems.append(
                f"{src}: {where}.{key}: expected {_type_name(typ)}, found {value!r}")
            continue
        if check is not None:
            err = check(value)
            if err:
                problems.append(f"{src}: {where}.{key}: {err} (found {value!r})")


def validate_data(data: Mapping[str, Any], src: str = "<profile>") -> list[str]:
    """Return every problem in a parsed profile (empty list: valid)."""
    problems: list[str] = []
    for top in data:
        if top not in SCHEMA or "." in top:
            known = ", ".join(k for k in SCHEMA if "." not in k)
            problems.append(f"{src}: {top}: unknown table (known: {known})")
    for top in REQUIRED_TABLES:
        if top not in data:
            problems.append(f"{src}: [{top}]: required table is missing")
    for top in ("profile", "gpus", "nccl", "nvme", "checkpoint", "deepspeed", "system",
                "health"):
        if top in data:
            _check_fields(top, data[top], top, problems, src)
    for parent, child in (("nccl", "floors"), ("nvme", "paths"), ("checkpoint", "floors")):
        items = data.get(parent, {}).get(child, []) if isinstance(data.get(parent), dict) else []
        if isinstance(items, list):
            for i, item in enumerate(items):
                _check_fields(f"{parent}.{child}[{i}]", item, f"{parent}.{child}", problems, src)
    problems.extend(_checkpoint_floor_problems(data, src))
    gpus = data.get("gpus", {})
    paths = data.get("nvme", {}).get("paths", []) if isinstance(data.get("nvme"), dict) else []
    if isinstance(gpus, dict) and gpus.get("count") == 0 and isinstance(paths, list):
        for i, entry in enumerate(paths):
            for key in ("gpu_read_gbps", "gpu_write_gbps"):
                if isinstance(entry, dict) and key in entry:
                    problems.append(f"{src}: nvme.paths[{i}].{key}: makes no sense with "
                                    "gpus.count = 0")
    if isinstance(gpus, dict) and gpus.get("count") == 0:
        # straggler_pct stays meaningful without GPUs: it also holds CPU ranks to each other.
        for key in ("model", "min_memory_gib", "compute_capability", "matmul_bf16_tflops",
                    "matmul_fp16_tflops", "hbm_gbps", "h2d_gbps", "d2h_gbps", "catalogue"):
            if key in gpus:
                problems.append(f"{src}: gpus.{key}: makes no sense with gpus.count = 0")
    floors = data.get("nccl", {}).get("floors", []) if isinstance(data.get("nccl"), dict) else []
    if isinstance(floors, list) and floors and isinstance(gpus, dict):
        count = gpus.get("count")
        for i, fl in enumerate(floors):
            if not isinstance(fl, dict):
                continue
            ws = fl.get("world_size", count)
            if isinstance(ws, int) and isinstance(count, int) and not isinstance(ws, bool):
                if ws < 2:
                    problems.append(f"{src}: nccl.floors[{i}]: a collective floor needs at least "
                                    f"2 ranks (gpus.count or world_size is {ws})")
                elif ws > count and count > 0:
                    problems.append(f"{src}: nccl.floors[{i}].world_size: {ws} exceeds "
                                    f"gpus.count {count}")
    ds = data.get("deepspeed", {})
    if isinstance(ds, dict) and isinstance(ds.get("ops"), list):
        for i, op in enumerate(ds["ops"]):
            if not isinstance(op, str) or not _OP_RE.match(op):
                problems.append(f"{src}: deepspeed.ops[{i}]: expected an op name such as "
                                f"\"cpu_adam\", found {op!r}")
        unknown = _unknown_ops([op for op in ds["ops"] if isinstance(op, str)])
        for op, known in unknown:
            problems.append(f"{src}: deepspeed.ops: unknown op {op!r} (this DeepSpeed knows: "
                            f"{', '.join(known)})")
    if isinstance(ds, dict) and isinstance(ds.get("onebit"), list):
        problems.extend(_check_onebit(ds["onebit"], src))
    tol = data.get("tolerances")
    if isinstance(tol, dict):
        problems.extend(_check_tolerances(tol, src))
    return problems


def _check_onebit(names: list[Any], src: str) -> list[str]:
    """deepspeed.onebit: 1-bit optimizers by their DeepSpeed config type, each once."""
    from dsconform.base.removed import ONEBIT_OPTIMIZERS
    problems = []
    for i, name in enumerate(names):
        if name not in ONEBIT_OPTIMIZERS:
            problems.append(f"{src}: deepspeed.onebit[{i}]: expected one of "
                            f"{', '.join(ONEBIT_OPTIMIZERS)}, found {name!r}")
        elif names.index(name) != i:
            problems.append(f"{src}: deepspeed.onebit[{i}]: {name!r} is listed twice")
    return problems


def _checkpoint_floor_problems(data: Mapping[str, Any], src: str) -> list[str]:
    """A checkpoint floor floors something (save and/or load), once per engine."""
    table = data.get("checkpoint")
    floors = table.get("floors", []) if isinstance(table, dict) else []
    problems, seen = [], set()
    for i, fl in enumerate(floors if isinstance(floors, list) else []):
        if not isinstance(fl, dict):
            continue
        if "save_gbps" not in fl and "load_gbps" not in fl:
            problems.append(f"{src}: checkpoint.floors[{i}]: needs save_gbps and/or load_gbps")
        if fl.get("engine") in seen:
            problems.append(f"{src}: checkpoint.floors[{i}].engine: {fl['engine']!r} has a "
                            f"floor already")
        seen.add(fl.get("engine"))
    return problems


def _unknown_ops(ops: list[str]) -> list[tuple[str, list[str]]]:
    """Ops DeepSpeed does not know. Without DeepSpeed installed nothing can be said: accept."""
    known = sorted(known_op_names())
    if not known:  # DeepSpeed not installed: the ops suite reports that, not validate
        return []
    return [(op, known) for op in ops if op not in known]


def known_op_names() -> set[str]:
    """Every op name any accelerator of the installed DeepSpeed defines (union, so a CUDA profile
    validates on a CPU machine). Read from the builders' source so validate needs no import."""
    import importlib.util
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        return set()
    root = Path(list(spec.submodule_search_locations)[0]) / "ops" / "op_builder"
    names: set[str] = set()
    for py in root.rglob("*.py"):
        names.update(re.findall(r'^\s+NAME = "([a-z0-9_]+)"', py.read_text(), re.M))
    return names


def _check_tolerances(tol: Mapping[str, Any], src: str) -> list[str]:
    problems = []
    try:
        from dsconform.checks.tolerances import OVERRIDE_FIELDS as fields
        from dsconform.checks.tolerances import known_tolerance_keys
        known = set(known_tolerance_keys())
    except ImportError:
        known, fields = None, ("rtol", "atol", "update", "gain", "tensor_gain", "why")
    for key, val in tol.items():
        where = f"{src}: tolerances.{key}"
        if known is not None and key not in known:
            problems.append(f"{where}: unknown tolerance (known: {', '.join(sorted(known))})")
        if not isinstance(val, dict):
            problems.append(f"{where}: must be a table with rtol and/or atol")
            continue
        for k, v in val.items():
            if k not in fields:
                problems.append(f"{where}.{k}: unknown key (known: {', '.join(fields)})")
            elif k != "why" and (isinstance(v, bool) or not isinstance(v, _NUM) or v < 0):
                problems.append(f"{where}.{k}: expected a number >= 0, found {v!r}")
        if "why" not in val:
            problems.append(f"{where}.why: required (say why this node needs another tolerance)")
    return problems


def from_data(data: Mapping[str, Any], source: str) -> Profile:
    """Build a Profile from parsed TOML, raising ProfileError with every problem found."""
    problems = validate_data(data, source)
    if problems:
        raise ProfileError(problems)
    p, g = data["profile"], data["gpus"]
    nccl, nvme, ds, system = (data.get(k, {}) for k in ("nccl", "nvme", "deepspeed", "system"))
    g = _with_catalogue_floors(g)
    return Profile(
        name=p["name"],
        source=source,
        description=p.get("description", ""),
        gpu_count=g["count"],
        gpu_model=g.get("model"),
        gpu_min_memory_gib=g.get("min_memory_gib"),
        gpu_compute_capability=g.get("compute_capability"),
        bf16=g.get("bf16"),
        fp16=g.get("fp16"),
        straggler_pct=g.get("straggler_pct"),
        matmul_bf16_tflops=g.get("matmul_bf16_tflops"),
        matmul_fp16_tflops=g.get("matmul_fp16_tflops"),
        hbm_gbps=g.get("hbm_gbps"),
        h2d_gbps=g.get("h2d_gbps"),
        d2h_gbps=g.get("d2h_gbps"),
        gpu_catalogue=g.get("catalogue"),
        nccl_min_version=nccl.get("min_version"),
        nccl_floors=tuple(NcclFloor(**f) for f in nccl.get("floors", [])),
        nvme_paths=tuple(NvmePath(**n) for n in nvme.get("paths", [])),
        checkpoint_floors=tuple(CheckpointFloor(**f)
                                for f in data.get("checkpoint", {}).get("floors", [])),
        ops=tuple(ds.get("ops", [])),
        deepspeed_min_version=ds.get("min_version"),
        onebit=tuple(ds.get("onebit", [])),
        min_shm_gib=system.get("min_shm_gib"),
        min_cpu_cores=system.get("min_cpu_cores"),
        min_host_memory_gib=system.get("min_memory_gib"),
        check_cuda_driver=system.get("check_cuda_driver", False),
        tolerances=dict(data.get("tolerances", {})),
        health=dict(data.get("health", {})),
    )


def _with_catalogue_floors(gpus: Mapping[str, Any]) -> dict[str, Any]:
    """[gpus] with the floors of its catalogue entry filled in where the profile sets none (a
    value the profile sets wins: it was measured on that node type)."""
    out = dict(gpus)
    if "catalogue" in gpus:
        from dsconform.profile import catalogue
        model = catalogue.shipped()[gpus["catalogue"]]
        for name in catalogue.FLOOR_FIELDS:
            out.setdefault(name, model.floor(name))
    return out


def load(path: str | os.PathLike) -> Profile:
    """Load and validate one profile file."""
    path = Path(path)
    src = str(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ProfileError([f"{src}: cannot read: {e.strerror or e}"]) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ProfileError([f"{src}: not valid TOML: {e}"]) from None
    return from_data(data, src)


def shipped() -> dict[str, Path]:
    """Shipped profiles by name (file stem)."""
    return {p.stem: p for p in sorted(PROFILES_DIR.glob("*.toml"))}


def resolve(spec: str, *, named: str | None = None,
            hint: str = "give a NAME, a PATH or auto") -> Path:
    """Map --profile NAME|PATH to a file. ``auto`` is handled by the caller (needs detection).
    named: how the user gave spec, for the error (default ``--profile SPEC``); hint: what to
    give instead."""
    if spec.endswith(".toml") or os.sep in spec:
        return Path(spec)
    profiles = shipped()
    if spec in profiles:
        return profiles[spec]
    raise ProfileError([f"{named or f'--profile {spec}'}: no such shipped profile (shipped: "
                        f"{', '.join(profiles) or 'none'}); {hint}"])
