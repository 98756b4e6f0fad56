"""Monitor: with ``csv_monitor`` and ``tensorboard`` enabled in the config, the values DeepSpeed
writes at every optimizer step MUST be the engine's, at the step index the engine counts, and
only rank 0 MAY write.

One training run per cell (ZeRO stage 1, WarmupLR so the lr moves every step, 2 micro-batches
per step, 6 optimizer steps; 2 ranks on the CPU accelerator and on GPUs) serves every check of
that cell; each rank gets output paths of its own, so a file is known to be the rank's that
wrote it. After every optimizer step the ranks note what the engine holds: ``get_lr()``,
``global_samples`` (the step index DeepSpeed writes), the fp16 loss scale, and the step's loss.

- MON-CSV-1 (``test_csv_values``): ``Train/Samples/lr`` (and ``Train/Samples/loss_scale`` in
  fp16) MUST hold one row per optimizer step, each the engine's value after that step at its
  ``global_samples``; nothing per micro-batch.
- MON-CSV-2 (``test_csv_loss``): ``Train/Samples/train_loss`` MUST hold the engine's loss of
  every optimizer step (the mean of rank 0's micro-batch losses) at its ``global_samples``.
- MON-TB-1 / MON-TB-2 (``test_tensorboard_values``, ``test_tensorboard_loss``): the same in the
  TensorBoard event file, read back through tensorboard's ``event_accumulator`` (values as
  32-bit floats). Skips, saying so, where tensorboard is not installed (``pip install
  'dsconform[monitor]'``): DeepSpeed's TensorBoard monitor cannot write without it either.
- MON-RANK-1 (``test_only_rank_zero_writes``): rank 0 MUST write the monitors' files and no
  other rank MAY write anything (DeepSpeed documents rank 0 as the writer).

The reading and the judgement: ``dsconform/checks/monitor_log.py``; the loss's bound:
``dsconform/checks/tolerances.py`` "monitor_loss". DeepSpeed 0.18.3 and later write no loss
(known issue DS-7665-MONITOR-NO-LOSS); earlier releases write it one step early
(DS-MONITOR-LOSS-STEP-EARLY).

Upstream: https://deepspeed.readthedocs.io/en/latest/monitor.html (what is logged
automatically), https://www.deepspeed.ai/tutorials/monitor/ ,
https://www.deepspeed.ai/docs/config-json/#monitoring-module

Stable ids: MON-CSV-1, MON-CSV-2, MON-TB-1, MON-TB-2, MON-RANK-1; each case id
(``cpu-fp32``) names its cell and does not change.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dsconform.suite import (
    ACCELERATORS,
    MONITOR_JOB,
    accel_cell,
    monitor_log,
    requires,
    run_ranks,
    tolerance,
)
from suites import monitor_ranks

CAPABILITY = "monitor"
TIMEOUT_S = 300
STAGE = 1
STEPS = 6
MICRO_BATCH = 4
GRAD_ACCUM = 2
WORLD_SIZE = 2


def _cells() -> list:
    """fp32 and fp16 (where the accelerator has it) on 2 ranks; on GPUs fp16 in the acceptance
    tier (it writes the loss scale too) and fp32 nightly."""
    return [accel_cell(accel, dtype, id=dtype, world_size=WORLD_SIZE,
                       marks=[requires(fp16=True)] if dtype == "fp16" else [],
                       slow=accel == "cuda" and dtype == "fp32")
            for accel in ACCELERATORS for dtype in ("fp32", "fp16")]


CELLS = _cells()


def run_cell(accelerator: str, dtype: str, out: Path, late: bool = False) -> dict[str, Any]:
    """Train one cell and read back, in this process, what each rank wrote: {"steps": the
    engine's per-step values (rank 0), "files": each rank's files, "csv" and "tensorboard":
    rank 0's series by event name (tensorboard None where it is not installed)}."""
    tensorboard = monitor_log.tensorboard_installed()
    results = run_ranks(monitor_ranks.train_logged, WORLD_SIZE, timeout_s=TIMEOUT_S,
                        args=(dtype, STAGE, STEPS, MICRO_BATCH, GRAD_ACCUM, str(out),
                              tensorboard), kwargs={"late": late}, accelerator=accelerator)
    csv_dir, tb_dir = (Path(d) / MONITOR_JOB for d in monitor_ranks.rank_dirs(str(out), 0))
    return {"steps": results[0]["steps"], "files": [r["files"] for r in results],
            "csv": monitor_log.read_csv(csv_dir) if csv_dir.is_dir() else {},
            "tensorboard": monitor_log.read_tensorboard(tb_dir) if tensorboard else None,
            "dtype": dtype}


_RUNS: dict[tuple[str, str], dict[str, Any]] = {}


def cell_run(accelerator: str, dtype: str, scratch: Path) -> dict[str, Any]:
    """The cell's run, trained once per session: a two-rank engine costs seconds, and every
    check of the cell reads the same run (read back before ``scratch`` goes)."""
    key = (accelerator, dtype)
    if key not in _RUNS:
        _RUNS[key] = run_cell(accelerator, dtype, scratch / "monitor")
    return _RUNS[key]


def value_problems(run: dict[str, Any], written: dict[str, Any], writer: str) -> list[str]:
    """MON-CSV-1 / MON-TB-1: lr (and the fp16 loss scale) at every optimizer step."""
    steps = run["steps"]
    f32 = writer == "tensorboard"
    problems = monitor_log.series_problems(
        written.get(monitor_log.EVENTS["lr"]), monitor_log.engine_series(steps, "lr"),
        f"{writer} {monitor_log.EVENTS['lr']}", as_float32=f32)
    scale_event = monitor_log.EVENTS["loss_scale"]
    if run["dtype"] == "fp16":
        problems += monitor_log.series_problems(
            written.get(scale_event), monitor_log.engine_series(steps, "loss_scale"),
            f"{writer} {scale_event}", as_float32=f32)
    elif scale_event in written:
        problems.append(f"{writer}: {scale_event} written without fp16 "
                        f"({written[scale_event][:3]}...)")
    return problems


def loss_problems(run: dict[str, Any], written: dict[str, Any], writer: str,
                  accelerator: str) -> list[str]:
    """MON-CSV-2 / MON-TB-2: the loss of every optimizer step."""
    tol = tolerance("monitor_loss", run["dtype"], "sgd", accelerator=accelerator)
    event = monitor_log.EVENTS["train_loss"]
    return monitor_log.series_problems(written.get(event),
                                       monitor_log.engine_series(run["steps"], "loss"),
                                       f"{writer} {event}", tol=tol,
                                       as_float32=writer == "tensorboard")


def _tensorboard(run: dict[str, Any]) -> dict[str, Any]:
    if run["tensorboard"] is None:
        pytest.skip("tensorboard is not installed (pip install 'dsconform[monitor]'): "
                    "DeepSpeed's TensorBoard monitor was not enabled and nothing can be read "
                    "back")
    return run["tensorboard"]


@pytest.mark.parametrize("accelerator, dtype", CELLS)
def test_csv_values(accelerator: str, dtype: str, scratch):
    """MON-CSV-1: the csv monitor MUST write the engine's lr (and loss scale) every step."""
    run = cell_run(accelerator, dtype, scratch)
    problems = value_problems(run, run["csv"], "csv_monitor")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("accelerator, dtype", CELLS)
def test_csv_loss(accelerator: str, dtype: str, scratch):
    """MON-CSV-2: the csv monitor MUST write the engine's loss every optimizer step."""
    run = cell_run(accelerator, dtype, scratch)
    problems = loss_problems(run, run["csv"], "csv_monitor", accelerator)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("accelerator, dtype", CELLS)
def test_tensorboard_values(accelerator: str, dtype: str, scratch):
    """MON-TB-1: TensorBoard MUST hold the engine's lr (and loss scale) every step."""
    run = cell_run(accelerator, dtype, scratch)
    problems = value_problems(run, _tensorboard(run), "tensorboard")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("accelerator, dtype", CELLS)
def test_tensorboard_loss(accelerator: str, dtype: str, scratch):
    """MON-TB-2: TensorBoard MUST hold the engine's loss every optimizer step."""
    run = cell_run(accelerator, dtype, scratch)
    problems = loss_problems(run, _tensorboard(run), "tensorboard", accelerator)
    assert not problems, "\n".join(problems)


def rank_problems(run: dict[str, Any]) -> list[str]:
    """MON-RANK-1: rank 0 wrote its monitors' files, no other rank wrote anything."""
    problems = []
    zero = run["files"][0]
    if not any(f.startswith("csv/") for f in zero):
        problems.append(f"rank 0 wrote no csv_monitor file (its files: {zero})")
    if run["tensorboard"] is not None and not any(f.startswith("tensorboard/") for f in zero):
        problems.append(f"rank 0 wrote no TensorBoard event file (its files: {zero})")
    for r, files in enumerate(run["files"][1:], start=1):
        if files:
            problems.append(f"rank {r} wrote {len(files)} file(s) where only rank 0 may: "
                            f"{files[:5]}")
    return problems


@pytest.mark.parametrize("accelerator, dtype", CELLS)
def test_only_rank_zero_writes(accelerator: str, dtype: str, scratch):
    """MON-RANK-1: only rank 0 MAY write the monitors' files."""
    problems = rank_problems(cell_run(accelerator, dtype, scratch))
    assert not problems, "\n".join(problems)
