"""The checkpoint suites' cells (suites/test_checkpoint.py, suites/test_checkpoint_files.py):
the ZeRO cells a checkpoint is taken of, their tiers, and the scratch directory each writes."""

from __future__ import annotations

from pathlib import Path

from dsconform.suite import (
    ACCELERATORS,
    ZERO_OFFLOADS,
    accel_cell,
    checkpoint_storage,
    requires,
)
from suites.checkpoint_ranks import CkptCase

CAPABILITY = "checkpoint"
# Per call; a cell with CPU Adam may JIT-build it inside its first call
# (docs/findings.md#op-builds).
TIMEOUT_S = 300
OP_TIMEOUT_S = 900
DTYPES = ("fp32", "bf16", "fp16")
# Adam carries the most state (two moments, a step); offloaded cells use DeepSpeed's CPU Adam,
# which ZeRO-Offload picks unless told otherwise.
_OFFLOAD_NAMES = {(False, False): "none", (True, False): "opt", (True, True): "param+opt"}


def _optimizer(offload_optimizer: bool) -> str:
    return "cpu_adam" if offload_optimizer else "adam"


def _case(stage: int, offload: str, dtype: str, **kw) -> CkptCase:
    opt, param = {v: k for k, v in _OFFLOAD_NAMES.items()}[offload]
    return CkptCase(stage=stage, dtype=dtype, optimizer=kw.pop("optimizer", _optimizer(opt)),
                    offload_optimizer=opt, offload_param=param, **kw)


def _valid(cell: dict) -> bool:
    return cell["offload"] in {_OFFLOAD_NAMES[o] for o in ZERO_OFFLOADS[cell["stage"]]}


def _needs(case: CkptCase) -> list:
    marks = []
    if case.dtype in ("bf16", "fp16"):
        marks.append(requires(**{case.dtype: True}))
    if case.optimizer == "cpu_adam":
        marks.append(requires(op="cpu_adam"))
    return marks


def _params(cells: list[dict], *, cpu_tier: set[tuple], gpu_tier: list[dict], build,
            prefix=lambda cell: (), world_size: int = 2) -> list:
    """One pytest.param (accelerator, *prefix(cell), build(cell)) per accelerator and cell: cpu
    cells outside ``cpu_tier`` and cuda cells outside ``gpu_tier`` (the pairwise acceptance
    tier) are marked ``slow``. Then, for a node with one GPU, the cuda cells of ``gpu_tier`` once
    more at one rank (id ``<cell>-ws1``): the acceptance tier there, in their place; nightly
    elsewhere."""
    out = []
    for accel in ACCELERATORS:
        for cell in cells:
            case = build(cell)
            key = tuple(cell.values())
            tier = key in cpu_tier if accel == "cpu" else cell in gpu_tier
            out.append(accel_cell(accel, *prefix(cell), case, id="-".join(map(str, key)),
                                  world_size=world_size, marks=_needs(case), slow=not tier,
                                  one_gpu="covered" if tier else None))
    for cell in gpu_tier:
        case = build(cell).with_(world_size=1)
        out.append(accel_cell("cuda", *prefix(cell), case, id=_ws1_id(*cell.values()),
                              world_size=1, marks=_needs(case), slow=True, one_gpu="tier"))
    return out


def _ws1_id(*values) -> str:
    """The id of a two-rank cell's one-rank twin."""
    return "-".join(map(str, (*values, "ws1")))


def _timeout(case: CkptCase) -> int:
    return OP_TIMEOUT_S if case.optimizer == "cpu_adam" else TIMEOUT_S


def ckpt_dir(scratch: Path, case: CkptCase, *, tags: int = 1, name: str = "ckpt") -> str:
    """The checkpoint directory under the test's scratch, refused (CheckpointStorageError naming
    --scratch) before anything is written when it cannot take ``tags`` checkpoints."""
    path = Path(scratch) / name
    param_bytes = 4 if case.dtype == "fp32" else 2
    need = tags * checkpoint_storage.estimate_bytes(case.n_params(), param_bytes=param_bytes)
    checkpoint_storage.preflight(path, need)
    path.mkdir()
    return str(path)


def _label(accelerator: str, case: CkptCase) -> str:
    return f"{accelerator}-{case.id}"
