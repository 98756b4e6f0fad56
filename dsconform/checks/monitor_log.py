"""What DeepSpeed's monitors wrote, read back, and judged against what the engine held.

``csv_monitor`` writes one file per event, ``<output_path>/<job_name>/Train_Samples_lr.csv``, a
header ``step,<name>`` and one ``step,value`` row per write; ``tensorboard`` writes an event file
under ``<output_path>/<job_name>/`` whose scalars are read back through tensorboard's
``event_accumulator`` (tensorboard is an optional dependency: ``pip install 'dsconform[monitor]'``;
without it ``read_tensorboard`` raises ``TensorBoardMissing``). The step of every event is
DeepSpeed's ``global_samples`` after the optimizer step that wrote it.
"""

from __future__ import annotations

import csv
import importlib.util
import math
from collections.abc import Sequence
from pathlib import Path

from dsconform.checks.tolerances import Tol

#: DeepSpeed's event names (the engine's summary events) and the csv file each is written to.
EVENTS = {"lr": "Train/Samples/lr", "loss_scale": "Train/Samples/loss_scale",
          "train_loss": "Train/Samples/train_loss"}

Series = list[tuple[int, float]]


class TensorBoardMissing(RuntimeError):
    """tensorboard (its event reader) is not installed."""


def tensorboard_installed() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


def csv_file(log_dir: Path, event: str) -> Path:
    return log_dir / (event.replace("/", "_").replace(" ", "_") + ".csv")


def read_csv(log_dir: Path) -> dict[str, Series]:
    """Every event's rows in ``log_dir``, by DeepSpeed event name; a file whose header or rows
    are not ``step,value`` raises ValueError naming the file and line."""
    found: dict[str, Series] = {}
    for name, event in EVENTS.items():
        path = csv_file(log_dir, event)
        if not path.exists():
            continue
        with path.open(newline="") as f:
            rows = list(csv.reader(f))
        if not rows or rows[0] != ["step", event.rsplit("/", 1)[-1]]:
            raise ValueError(f"{path}:1: header {rows[:1]}, expected step,{name}")
        series = []
        for line, row in enumerate(rows[1:], start=2):
            try:
                series.append((int(row[0]), float(row[1])))
            except (IndexError, ValueError):
                raise ValueError(f"{path}:{line}: expected step,value, found {row}") from None
        found[event] = series
    return found


def read_tensorboard(log_dir: Path) -> dict[str, Series]:
    """Every scalar of the event files in ``log_dir``, by tag, as (step, value) in file order."""
    if not tensorboard_installed():
        raise TensorBoardMissing("tensorboard is not installed (pip install "
                                 "'dsconform[monitor]'): its event files cannot be read back")
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(int(e.step), float(e.value)) for e in acc.Scalars(tag)]
            for tag in acc.Tags().get("scalars", [])}


def _float32(x: float) -> float:
    """x as TensorBoard stores a scalar (a 32-bit float)."""
    import struct

    return struct.unpack("f", struct.pack("f", x))[0]


def series_problems(written: Series | None, expected: Series, what: str, *,
                    tol: Tol | None = None, as_float32: bool = False) -> list[str]:
    """``written`` against the engine's ``expected`` (step, value) pairs, in order: one line for
    a missing series or a different number of writes, else the first step where a step index or
    a value differs (later ones follow from it). Values are exact unless ``tol`` is given;
    ``as_float32`` compares with the expected value rounded to 32 bits."""
    if written is None:
        return [f"{what}: nothing written (expected {len(expected)} values, first "
                f"{expected[:1]})"]
    if len(written) != len(expected):
        return [f"{what}: {len(written)} values written, the engine took {len(expected)} "
                f"optimizer steps (written steps {[s for s, _ in written]}, the engine's "
                f"samples {[s for s, _ in expected]})"]
    for k, ((step, value), (want_step, want)) in enumerate(zip(written, expected)):
        want = _float32(want) if as_float32 else want
        same = (value == want if tol is None else
                math.isclose(value, want, rel_tol=tol.rtol, abs_tol=tol.atol))
        if step != want_step or not same:
            bound = "exact" if tol is None else f"{tol} ({tol.why})"
            return [f"{what}: optimizer step {k} wrote {value!r} at step index {step}; the "
                    f"engine held {want!r} with {want_step} samples ({bound})"]
    return []


def engine_series(steps: Sequence[dict], key: str) -> Series:
    """(samples, value) of one engine quantity, one pair per optimizer step."""
    return [(int(s["samples"]), float(s[key])) for s in steps]
