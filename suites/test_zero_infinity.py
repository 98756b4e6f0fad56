"""ZeRO-Infinity: ZeRO-3 with the optimizer, and with optimizer and parameters, offloaded to
``nvme`` on the profile's path MUST give DDP's losses, gradients and parameters (the ZeRO suite's
rank code and comparison; the tolerance table's ``zero_infinity`` entries, measured on the wider
model DeepSpeed needs before it swaps anything), and MUST have put its tensors on that path.
DeepNVMe itself is suites/test_deepnvme.py's.

Upstream: https://www.deepspeed.ai/tutorials/zero/#offloading-to-nvme-with-zero-infinity .

Stable ids: NVME-ZINF-1.
"""

from __future__ import annotations

import contextlib
import itertools
from pathlib import Path

import pytest

from dsconform.suite import (
    ACCELERATORS,
    RankCall,
    ZeroCase,
    accel_cell,
    batched,
    cell_results,
    compare_rank_results,
    pairwise,
    requires,
    tolerance,
)
from suites.deepnvme_paths import MiB, entry_label, generate_nvme_entries, target
from suites.deepnvme_ranks import (
    nvme_usage_problems,
    train_zero_infinity,
)

CAPABILITY = "deepnvme"
# Per call. The first call of a fresh pool may build async_io (docs/performance.md).
TIMEOUT_S = 900
NEEDS_AIO = requires(op="async_io")
pytest_generate_tests = generate_nvme_entries  # one nvme_entry per profile path


ZINF_AXES = {"offload": ("opt", "param+opt"), "dtype": ("fp32", "bf16"),
             "optimizer": ("sgd", "cpu_adam")}
ZINF_MUST = {"offload": "param+opt", "dtype": "fp32", "optimizer": "sgd"}
# The CPU tier: both swappers in bf16, and the optimizer swapper bit-exact in fp32. fp32 with
# parameters on NVMe is a known upstream issue on the CPU accelerator (DS-Z3-INIT-DTYPE-NVME:
# DeepSpeed swaps the fp32 parameters as bf16); it runs with the slow cells.
ZINF_CPU_TIER = ({**ZINF_MUST, "dtype": "bf16"}, {**ZINF_MUST, "offload": "opt"})
# Enough steps for every swapped tensor to go out and come back several times; the ZeRO suite's
# 20 cost seconds per cell of NVMe round trips on a loaded 2-core machine.
ZINF_STEPS = 8
# DeepSpeed swaps only tensors of 1 MiB or more (MIN_AIO_BYTES): a 1024-wide hidden layer has
# partitions of 2 MiB (fp32) or 1 MiB (bf16) on each of 2 ranks; 53 (the ZeRO suite's width)
# would leave everything in CPU memory and prove nothing about NVMe.
ZINF_WIDTH = 1024


def _zinf_marks(cell: dict) -> list:
    marks = [NEEDS_AIO]
    if cell["dtype"] == "bf16":
        marks.append(requires(bf16=True))
    if cell["optimizer"] == "cpu_adam":
        marks.append(requires(op="cpu_adam"))
    return marks


def _zinf_id(cell: dict) -> str:
    return f"{cell['offload']}-{cell['dtype']}-{cell['optimizer']}"


def _zinf_params() -> list:
    tier = pairwise(ZINF_AXES, must=[ZINF_MUST])
    params = []
    for accel in ACCELERATORS:
        for values in itertools.product(*ZINF_AXES.values()):
            cell = dict(zip(ZINF_AXES, values))
            in_tier = cell in (tier if accel == "cuda" else ZINF_CPU_TIER)
            params.append(accel_cell(accel, cell, 2, world_size=2, marks=_zinf_marks(cell),
                                     slow=not in_tier, id=_zinf_id(cell),
                                     one_gpu="covered" if in_tier else None))
    # A node with one GPU runs the cuda tier at one rank instead (every pair of ZINF_AXES):
    # ZeRO-Infinity on one GPU is what such a node offloads to NVMe for. Nightly elsewhere.
    for cell in tier:
        params.append(accel_cell("cuda", cell, 1, world_size=1, marks=_zinf_marks(cell),
                                 slow=True, id=f"{_zinf_id(cell)}-ws1", one_gpu="tier"))
    return params


def _zinf_case(cell: dict, nvme_path: str, world_size: int) -> ZeroCase:
    return ZeroCase(stage=3, dtype=cell["dtype"], optimizer=cell["optimizer"], grad_accum=1,
                    world_size=world_size, offload_optimizer=True,
                    offload_param=cell["offload"] == "param+opt", width=ZINF_WIDTH,
                    steps=ZINF_STEPS, offload_device="nvme", nvme_path=nvme_path)


def _zinf_plan(params: dict, workdir: Path, run) -> tuple:
    """The cell's rank call, writing under a directory of its own on the entry's path (checked
    before anything is written), removed once the call ended."""
    accelerator, cell = params["accelerator"], params["cell"]
    if accelerator == "cpu" and run.node.gpu_count:
        pytest.skip("on a GPU node the cuda cells run ZeRO-Infinity: a CPU-accelerator process "
                    "would rebuild async_io over the CUDA build in the shared extensions cache")
    index, entry = params["nvme_entry"]
    stack = contextlib.ExitStack()
    d, _ = stack.enter_context(target(run.profile, index, entry, run, workdir, 256 * MiB))
    case = _zinf_case(cell, str(d), params["world_size"])
    return (RankCall(train_zero_infinity, case.world_size, TIMEOUT_S, args=(case,),
                     accelerator=accelerator), stack.close)


@pytest.mark.nvme
@pytest.mark.parametrize("accelerator, cell, world_size", _zinf_params())
@batched(_zinf_plan)  # the cells run at once where lanes are on (dsconform.plugin.batch)
def test_zero_infinity_matches_ddp(accelerator, cell, world_size, nvme_entry, profile, run, node,
                                   scratch, metrics, request):
    """NVME-ZINF-1: ZeRO-3 offloading to NVMe MUST give DDP's losses, gradients, parameters."""
    index, entry = nvme_entry
    results = cell_results(request, scratch)
    case = _zinf_case(cell, "", world_size)
    tol = tolerance("zero_infinity", case.dtype, case.optimizer, profile.tolerances,
                    accelerator=accelerator)
    cmp = compare_rank_results(results, tol, label=f"{accelerator}-{case.id}")
    params = {**case.params(), "accelerator": accelerator, "path": entry.path,
              "rtol": tol.rtol, "atol": tol.atol}
    metrics.record("zero_infinity.loss_max_rel_diff", cmp.worst("loss")[1], unit="1",
                   better="lower", bound=tol.rtol, **params)
    metrics.record("zero_infinity.grad_max_abs_diff", cmp.worst("grad")[0], unit="1",
                   better="lower", **params)
    metrics.record("zero_infinity.param_max_abs_diff", cmp.worst("param")[0], unit="1",
                   better="lower", **params)
    io = [r["nvme"]["proc_io"] for r in results if r["nvme"]["proc_io"] is not None]
    if io:  # how much ZeRO-Infinity moved, per rank at most: a swap that stops shows here
        metrics.record("zero_infinity.storage_write_bytes",
                       max(x["write_bytes"] for x in io), unit="bytes", better="lower", **params)
    cmp.assert_ok()
    where = entry_label(profile, index, entry)
    problems = nvme_usage_problems(results, case, where)
    assert not problems, f"ZeRO-Infinity matched DDP but did not use NVMe at {where}: " + \
        "; ".join(problems)
