"""A time-bounded sweep of DeepNVMe's handle parameters; the best as a DeepSpeed ``aio`` block.

In the manner of ``ds_nvme_tune`` (deepspeed/nvme/perf_run_sweep.py): block size, queue depth,
intra-op parallelism, single_submit and overlap_events (ds_io's "sequential_requests" is
overlap_events=false), over ds_nvme_tune's default grid, each configuration timed writing a fresh
file and reading it back through a DeepNVMe handle with O_DIRECT (dsconform.storage.io.timed_rounds:
the page cache is ruled out, the bytes compared). The best is the one with the largest read +
write GB/s, ds_nvme_tune's own criterion (perf_generate_param.py).

Two differences from ds_nvme_tune:
- The sweep is time-bounded. The grid is ordered so that every pair of parameter values is tried
  first (dsconform.base.pairwise.pairwise), then the rest; a trial starts only if the one before it
  would
  still fit in the budget (the first always runs).
- The result is the ``aio`` block the runtime reads (dsconform.storage.nvme.AioSettings.block):
  ``intra_op_parallelism`` and real booleans, where ds_nvme_tune prints ``num_threads`` (which
  the runtime ignores) and the strings "true"/"false" (both true to the runtime).

Units: bytes and seconds; GB/s means 1e9 bytes per second.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsconform.base.pairwise import pairwise
from dsconform.storage.nvme import (
    AioSettings,
    PathFacts,
    check_path,
    io_units,
    owned_dir,
    probe_o_direct,
)

MIB = 1 << 20
# ds_nvme_tune's DEFAULT_SWEEP_CONFIG (deepspeed/nvme/perf_run_sweep.py), in the runtime's names.
DEFAULT_GRID: dict[str, tuple] = {
    "block_size": (1 * MIB, 8 * MIB),
    "queue_depth": (32, 128),
    "overlap_events": (True, False),
    "single_submit": (False, True),
    "intra_op_parallelism": (1, 2, 4, 8),
}
DEFAULT_BUDGET_S = 60.0
DEFAULT_BYTES = 256 * MIB


def sweep_order(grid: Mapping[str, Sequence[Any]]) -> list[AioSettings]:
    """Every configuration of the grid once: a pairwise covering set first, then the rest in
    grid order. Deterministic, so two runs with the same budget try the same ones."""
    first = pairwise(grid)
    rest = [dict(zip(grid, combo)) for combo in itertools.product(*grid.values())]
    ordered = first + [c for c in rest if c not in first]
    return [AioSettings(**c) for c in ordered]


@dataclass
class Trial:
    settings: AioSettings
    write_gbps: float
    read_gbps: float
    seconds: float  # wall time of the trial, setup included

    @property
    def score(self) -> float:
        return self.write_gbps + self.read_gbps


@dataclass
class TuneResult:
    facts: PathFacts
    nbytes: int
    memory: str
    budget_s: float
    grid_size: int
    trials: list[Trial] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def best(self) -> Trial:
        return max(self.trials, key=lambda t: t.score)

    def aio_config(self) -> dict[str, Any]:
        """The DeepSpeed config section to paste: {"aio": {...}}."""
        return {"aio": self.best.settings.block()}

    def summary(self) -> str:
        b = self.best
        return (f"best of {len(self.trials)} of the grid's {self.grid_size} configurations "
                f"(tried in {self.elapsed_s:.1f} s, budget {self.budget_s:g} s) on "
                f"{self.facts.describe()}, {self.nbytes} bytes from {self.memory} "
                f"memory: write {b.write_gbps:.3g} GB/s, read {b.read_gbps:.3g} GB/s "
                f"(GB = 1e9 bytes): {b.settings.label()}")


def tune(directory: str | Path, *, nbytes: int = DEFAULT_BYTES,
         budget_s: float = DEFAULT_BUDGET_S, grid: Mapping[str, Sequence[Any]] = DEFAULT_GRID,
         memory: str = "locked", progress: Callable[[str], None] = lambda line: None,
         where: str = "nvme-tune PATH") -> TuneResult:
    """Sweep ``grid`` on ``directory`` for at most about ``budget_s`` seconds.

    Checks the path first (dsconform.storage.nvme.check_path: missing, read-only, tmpfs/overlay,
    free
    space; NvmePathError) and writes only inside one directory of its own there, removed at the
    end. Raises dsconform.ops.load.OpUnavailable when async_io does not load, NvmeIOError when
    DeepNVMe fails or corrupts data."""
    from dsconform.ops.load import require_op
    from dsconform.storage.io import open_handle, timed_rounds

    if budget_s <= 0:
        raise ValueError(f"budget_s must be > 0, got {budget_s}")
    order = sweep_order(grid)
    facts = check_path(directory, 2 * nbytes, where=where)
    for s in order:
        unit, _ = io_units(s, facts)
        if nbytes % unit or nbytes % s.block_size:
            raise ValueError(f"{nbytes} bytes per transfer is not a multiple of every block "
                             "size swept and of intra_op_parallelism x the logical block size "
                             f"(the configuration {s.label()} needs a multiple of "
                             f"{math.lcm(unit, s.block_size)} bytes); use a power of two >= "
                             f"{max(grid['block_size'])}")
    probe_o_direct(directory, facts)
    result = TuneResult(facts=facts, nbytes=nbytes, memory=memory, budget_s=budget_s,
                        grid_size=len(order))
    progress(f"sweeping up to {len(order)} configurations for at most {budget_s:g} s on "
             f"{facts.describe()}, {nbytes} bytes per transfer from {memory} memory")
    require_op("async_io")  # built and loaded before the clock starts (a cold build: minutes)
    start = time.perf_counter()
    with owned_dir(directory) as d:
        for i, settings in enumerate(order):
            elapsed = time.perf_counter() - start
            last = result.trials[-1].seconds if result.trials else 0.0
            if result.trials and elapsed + last > budget_s:
                progress(f"time budget reached after {len(result.trials)} configurations "
                         f"({elapsed:.1f} s)")
                break
            t0 = time.perf_counter()
            handle = open_handle(settings)
            rounds = timed_rounds(handle, settings, d, facts, nbytes=nbytes, memory=memory,
                                  rounds=1, seed=i)
            del handle
            trial = Trial(settings, rounds.gbps("write")[0], rounds.gbps("read")[0],
                          time.perf_counter() - t0)
            result.trials.append(trial)
            mark = " (best so far)" if trial is result.best else ""
            progress(f"[{i + 1}/{len(order)} {time.perf_counter() - start:.1f}/{budget_s:g} s] "
                     f"{settings.label()}: write {trial.write_gbps:.3g} GB/s, read "
                     f"{trial.read_gbps:.3g} GB/s{mark}")
    result.elapsed_s = time.perf_counter() - start
    return result


# ---------------------------------------------------------------------------- the CLI


def _size(text: str) -> int:
    """Bytes, with an optional K/M/G suffix (powers of 2: 256M = 268435456)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        return int(t[:-1]) * units[t[-1]] if t and t[-1] in units else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 268435456 or 256M)") \
            from None


def add_cli(sub: Any) -> None:
    """Register ``dsconform nvme-tune`` on the CLI's subparsers."""
    t = sub.add_parser("nvme-tune", help="time-bounded sweep of DeepNVMe handle parameters on "
                       "PATH; prints the best as a DeepSpeed \"aio\" config block (JSON)")
    t.add_argument("path", help="a directory on the NVMe device; the sweep writes only in a "
                   "fresh subdirectory there and removes it")
    t.add_argument("--seconds", type=float, default=DEFAULT_BUDGET_S,
                   help=f"time budget (default {DEFAULT_BUDGET_S:g})")
    t.add_argument("--bytes", type=_size, default=DEFAULT_BYTES, dest="nbytes",
                   help="bytes per transfer, a multiple of 8M (default 256M)")
    t.add_argument("--memory", choices=("locked", "cuda"), default="locked",
                   help="transfer from page-locked CPU memory (default) or GPU memory")
    t.set_defaults(func=cmd_nvme_tune)


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """stdout carries only the JSON block: DeepSpeed's logger and its native code print to
    stdout (Python's sys.stdout and file descriptor 1), so both go to stderr meanwhile."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 1)
        os.close(saved)


def cmd_nvme_tune(args: argparse.Namespace) -> int:
    """Progress and the summary go to stderr, the aio block (JSON) to stdout. Exit 0; 2 for a
    path or size the sweep must not use; 1 when DeepNVMe does not load or moves wrong bytes."""
    from dsconform.ops.cache import ensure_extensions_dir
    from dsconform.ops.load import OpUnavailable
    from dsconform.storage.io import NvmeIOError
    from dsconform.storage.nvme import NvmePathError

    def progress(line: str) -> None:
        print(f"nvme-tune: {line}", file=sys.stderr, flush=True)

    if args.memory == "cuda":
        import torch
        if not torch.cuda.is_available():
            print("dsconform nvme-tune: --memory cuda: torch sees no CUDA GPU here "
                  "(torch.cuda.is_available() is False); use --memory locked", file=sys.stderr)
            return 2
    ensure_extensions_dir()  # the suite's op cache, so async_io is not rebuilt
    try:
        with _stdout_to_stderr():
            result = tune(args.path, nbytes=args.nbytes, budget_s=args.seconds,
                          memory=args.memory, progress=progress, where="PATH")
    except (NvmePathError, ValueError) as e:
        print(f"dsconform nvme-tune: {e}", file=sys.stderr)
        return 2
    except (OpUnavailable, NvmeIOError) as e:
        print(f"dsconform nvme-tune: {e}", file=sys.stderr)
        return 1
    progress(result.summary())
    json.dump(result.aio_config(), sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0
