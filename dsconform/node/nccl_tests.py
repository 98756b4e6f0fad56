"""nccl-tests' all_reduce_perf as a second opinion on the suite's own bandwidth numbers.

Where the node has ``all_reduce_perf`` on PATH, the collectives suite runs it on the same GPUs
at each all_reduce floor size and records the ratio of torch.distributed's busbw to nccl-tests'
(on 2xH200 within 0.5% at 1 and 4 GiB, half at 1 MiB where per-call overhead rules:
docs/findings.md#collectives).
``-N 3`` repeats the measurement three times, so nccl-tests' number has rounds like ours.

The table it prints (src/util.cu ``writeBenchmarkLine*``), one row per size and cycle:
``size count type redop root`` then out-of-place ``time(us) algbw busbw #wrong`` then the same
in-place; ``#wrong`` is ``N/A`` without data checks (-c 0).
Upstream: https://github.com/NVIDIA/nccl-tests
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["EXECUTABLE", "NcclTestsError", "Row", "command", "find", "parse", "run"]

EXECUTABLE = "all_reduce_perf"


class NcclTestsError(RuntimeError):
    """all_reduce_perf failed or printed nothing we can read."""


@dataclass(frozen=True)
class Row:
    """One out-of-place measurement: a size in one cycle."""
    bytes: int
    dtype: str
    redop: str
    seconds: float  # per call
    algbw_gbps: float
    busbw_gbps: float
    wrong: int | None  # None: data not checked


def find() -> str | None:
    """Path of all_reduce_perf on PATH, None when absent."""
    return shutil.which(EXECUTABLE)


def command(executable: str, min_bytes: int, max_bytes: int, gpus: int, *, iters: int,
            warmup: int = 5, cycles: int = 3) -> list[str]:
    """fp32 sum from min_bytes to max_bytes in steps of 2x, ``gpus`` GPUs in one process (-g),
    data checked (-c 1), every size ``cycles`` times (-N)."""
    return [executable, "-b", str(min_bytes), "-e", str(max_bytes), "-f", "2", "-g", str(gpus),
            "-d", "float", "-o", "sum", "-w", str(warmup), "-n", str(iters), "-N", str(cycles),
            "-c", "1"]


def _wrong(text: str) -> int | None:
    return None if text == "N/A" else int(float(text))


def _wrong_of(fields: list[str]) -> int | None:
    """Wrong elements of a row: out-of-place plus in-place (field 12, where printed); None
    when neither was checked."""
    counts = [_wrong(f) for f in (fields[8], *fields[12:13])]
    checked = [c for c in counts if c is not None]
    return sum(checked) if checked else None


def parse(text: str) -> list[Row]:
    """Every row of all_reduce_perf's table: the out-of-place timing, and the wrong elements
    of both the out-of-place and the in-place run."""
    rows = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 9 or line.lstrip().startswith("#") or not fields[0].isdigit():
            continue
        try:
            rows.append(Row(bytes=int(fields[0]), dtype=fields[2], redop=fields[3],
                            seconds=float(fields[5]) * 1e-6, algbw_gbps=float(fields[6]),
                            busbw_gbps=float(fields[7]), wrong=_wrong_of(fields)))
        except ValueError:
            continue  # not a result row (a warning that starts with a number)
    return rows


def run(executable: str, sizes: Sequence[int], gpus: Sequence[str], *, iters: int,
        timeout_s: float) -> tuple[dict[int, list[Row]], list[str]]:
    """Run all_reduce_perf on ``gpus`` (CUDA_VISIBLE_DEVICES entries) at ``sizes``: one run over
    the 2x ladder from the smallest to the largest size (one NCCL start-up), then one run per
    size that ladder missed. Returns ({bytes: rows}, the command lines). Raises NcclTestsError
    naming the command and the end of its output."""
    wanted = sorted(set(sizes))
    rows, commands = _run_once(executable, wanted[0], wanted[-1], gpus, iters, timeout_s)
    found = {n: [r for r in rows if r.bytes == n] for n in wanted}
    for nbytes in [n for n in wanted if not found[n]]:
        more, cmd = _run_once(executable, nbytes, nbytes, gpus, iters, timeout_s)
        commands += cmd
        found[nbytes] = [r for r in more if r.bytes == nbytes]
        if not found[nbytes]:
            raise NcclTestsError(f"{cmd[0]}: no result row for {nbytes} bytes in its output")
    return found, commands


def _run_once(executable: str, min_bytes: int, max_bytes: int, gpus: Sequence[str],
              iters: int, timeout_s: float) -> tuple[list[Row], list[str]]:
    argv = command(executable, min_bytes, max_bytes, len(gpus), iters=iters)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(gpus))
    shown = f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} {' '.join(argv)}"
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired as e:
        raise NcclTestsError(f"{shown}: still running after {timeout_s:g} s; output so far:\n"
                             f"{_tail(e.stdout)}") from None
    except OSError as e:
        raise NcclTestsError(f"{shown}: cannot run: {e}") from None
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise NcclTestsError(f"{shown}: exit code {done.returncode}:\n{_tail(output)}")
    rows = parse(done.stdout)
    if not rows:
        raise NcclTestsError(f"{shown}: no result rows in its output:\n{_tail(output)}")
    return rows, [shown]


def _tail(text: str | bytes | None, lines: int = 30) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join((text or "").splitlines()[-lines:])
