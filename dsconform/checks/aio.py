"""The ``aio`` block of a DeepSpeed config: the handle's five parameters (``AioSettings``) with
the keys and types DeepSpeed's runtime reads (deepspeed/runtime/swap_tensor/aio_config.py), and
what ds_nvme_tune gets wrong (``aio_block_problems``). dsconform.checks.dsconfig writes the block;
dsconform.storage.nvme decides the paths it is used with."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

# The keys deepspeed/runtime/swap_tensor/aio_config.py reads, with the types it needs.
# get_scalar_param does no type check: "false" (a non-empty string) is true there.
RUNTIME_AIO_TYPES: dict[str, type] = {
    "block_size": int, "queue_depth": int, "intra_op_parallelism": int,
    "single_submit": bool, "overlap_events": bool, "use_gds": bool,
}
# What ds_nvme_tune (deepspeed/nvme/perf_generate_param.py) writes instead.
DS_NVME_TUNE_KEYS = {"num_threads": "intra_op_parallelism"}


@dataclass(frozen=True)
class AioSettings:
    """An aio_handle/gds_handle's parameters; the defaults are DeepSpeed's runtime defaults
    (deepspeed/runtime/swap_tensor/constants.py)."""
    block_size: int = 1 << 20
    queue_depth: int = 8
    intra_op_parallelism: int = 1
    single_submit: bool = False
    overlap_events: bool = True
    use_gds: bool = False

    def __post_init__(self) -> None:
        problems = aio_block_problems(self.block())
        if problems:
            raise ValueError("AioSettings: " + "; ".join(problems))

    def handle_args(self) -> tuple[int, int, bool, bool, int]:
        """aio_handle / gds_handle(block_size, queue_depth, single_submit, overlap_events,
        intra_op_parallelism)."""
        return (self.block_size, self.queue_depth, self.single_submit, self.overlap_events,
                self.intra_op_parallelism)

    def block(self) -> dict[str, Any]:
        """The ``aio`` section of a DeepSpeed config."""
        return asdict(self)

    def label(self) -> str:
        return (f"block_size={self.block_size} queue_depth={self.queue_depth} "
                f"intra_op_parallelism={self.intra_op_parallelism} "
                f"single_submit={str(self.single_submit).lower()} "
                f"overlap_events={str(self.overlap_events).lower()}")


def aio_block_problems(block: Mapping[str, Any], where: str = "aio") -> list[str]:
    """Every way ``block`` differs from what DeepSpeed's runtime reads: unknown keys (naming the
    key ds_nvme_tune uses instead), wrong types (a string "false" is true to the runtime), values
    out of range. Empty: the runtime reads exactly these values."""
    problems = []
    for key in block:
        if key in DS_NVME_TUNE_KEYS:
            problems.append(f"{where}.{key}: DeepSpeed's runtime does not read it (ds_nvme_tune "
                            f"writes it); use {DS_NVME_TUNE_KEYS[key]!r}")
        elif key not in RUNTIME_AIO_TYPES:
            problems.append(f"{where}.{key}: unknown key (the runtime reads "
                            f"{', '.join(RUNTIME_AIO_TYPES)})")
    for key, typ in RUNTIME_AIO_TYPES.items():
        if key not in block:
            continue  # the runtime's default applies
        value = block[key]
        if typ is bool and not isinstance(value, bool):
            hint = (" (a non-empty string is true to the runtime, \"false\" included)"
                    if isinstance(value, str) else "")
            problems.append(f"{where}.{key}: expected true or false, found {value!r}{hint}")
        elif typ is int and (isinstance(value, bool) or not isinstance(value, int)):
            problems.append(f"{where}.{key}: expected an integer, found {value!r}")
        elif typ is int and value < 1:
            problems.append(f"{where}.{key}: must be >= 1, found {value!r}")
    return problems


def runtime_aio_config(block: Mapping[str, Any]) -> dict[str, Any]:
    """What DeepSpeed's runtime makes of a config's ``aio`` section (imports DeepSpeed)."""
    from deepspeed.runtime.swap_tensor.aio_config import get_aio_config
    return dict(get_aio_config({"aio": dict(block)}))


def runtime_aio_defaults() -> dict[str, Any]:
    """DeepSpeed's own aio keys and defaults, read from its constants (imports DeepSpeed)."""
    from deepspeed.runtime.swap_tensor import constants as c
    return {getattr(c, name): getattr(c, f"{name}_DEFAULT")
            for name in ("AIO_BLOCK_SIZE", "AIO_QUEUE_DEPTH", "AIO_INTRA_OP_PARALLELISM",
                         "AIO_SINGLE_SUBMIT", "AIO_OVERLAP_EVENTS", "AIO_USE_GDS")}
