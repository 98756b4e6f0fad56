"""A second opinion on a DeepNVMe number: the same path measured with fio, else dd.

fio (``ioengine=libaio``, ``direct=1``) is told what the DeepNVMe handle does: a fresh file, the
same block size and queue depth, sequential, one job, no preallocation (DeepNVMe writes into a
new, empty file; fio's default fallocate would hand it allocated blocks: on the CI disk, one run
each, 1.07 GB/s preallocated against 0.63-0.85 without). Without fio, dd with O_DIRECT
(``oflag=direct`` / ``iflag=direct``) moves the same bytes one block at a time (queue depth 1),
so its ratio to DeepNVMe says less, but still bounds it (``DD_RATIO_CEILING``).

The ratio DeepNVMe/tool is recorded, round by round, so a user can trust the number; the suite
holds its median under the tool's ceiling (``ratio_ceiling``, through the metrics recorder): a
DeepNVMe rate far above the tool's with the same pattern did not come from the disk.

Units: bytes and seconds; GB/s means 1e9 bytes per second.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

# DeepNVMe measured above this multiple of fio's rate, same file pattern, same moment: not the
# disk. Measured on the CI machine (virtio disk shared with parallel jobs, 256 MiB, medians of 3):
# DeepNVMe/fio write 0.50, read 2.2 (rounds 0.30-2.5; DeepNVMe submits its queue in batches,
# fio one request per call). A page cache or a host-side cache answers reads 10x faster than such
# a disk; 5x leaves the shared disk's noise room.
FIO_RATIO_CEILING = 5.0
# The same bound against dd (queue depth 1). Measured on the 2xH200 node, which has no fio
# (22 runs of 2026-11-30, docs/findings.md#deepnvme: 256 MiB, 3 rounds each): medians 0.96-1.35
# (write) and 0.69-1.73 (read), rounds up to 1.88. A read served by the page cache runs at memory
# speed, several times any single disk's; 5x leaves that node 2.9x room.
DD_RATIO_CEILING = 5.0
TIMEOUT_S = 600


def ratio_ceiling(tool: str) -> float:
    """The most DeepNVMe's rate may exceed ``tool``'s on the same path and pattern."""
    ceilings = {"fio": FIO_RATIO_CEILING, "dd": DD_RATIO_CEILING}
    if tool not in ceilings:
        raise ValueError(f"tool must be 'fio' or 'dd', not {tool!r}")
    return ceilings[tool]


class ToolError(RuntimeError):
    """fio or dd failed; the message holds the command and its output."""


@dataclass(frozen=True)
class ToolRun:
    tool: str  # "fio" | "dd"
    op: str  # "write" | "read"
    nbytes: int
    seconds: float
    command: str

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9


def available_tool() -> str | None:
    """"fio" when installed, else "dd", else None."""
    if shutil.which("fio"):
        return "fio"
    return "dd" if shutil.which("dd") else None


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ToolError(f"{' '.join(cmd)}: did not finish within {TIMEOUT_S} s") from None
    if proc.returncode != 0:
        raise ToolError(f"{' '.join(cmd)} exited {proc.returncode}:\n"
                        f"{(proc.stdout + proc.stderr)[-2000:]}")
    return proc


def fio_command(path: Path, op: str, *, nbytes: int, block_size: int,
                queue_depth: int) -> list[str]:
    return ["fio", "--name=dsconform-xcheck", f"--filename={path}", f"--rw={op}",
            f"--bs={block_size}", f"--iodepth={queue_depth}", "--ioengine=libaio", "--direct=1",
            f"--size={nbytes}", "--fallocate=none", "--numjobs=1", "--unlink=0",
            "--output-format=json"]


def parse_fio(text: str, op: str) -> tuple[int, float]:
    """(bytes moved, seconds) of the one job's ``op`` from fio's JSON output."""
    start = text.find("{")  # fio may print notices before the JSON
    try:
        job = json.loads(text[start:])["jobs"][0][op]
        nbytes, runtime_ms = int(job["io_bytes"]), float(job["runtime"])
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise ToolError(f"cannot read fio's JSON output ({e}): {text[:500]}") from None
    if nbytes <= 0 or runtime_ms <= 0:
        raise ToolError(f"fio reports {nbytes} bytes in {runtime_ms} ms for {op}")
    return nbytes, runtime_ms / 1e3


def dd_command(path: Path, op: str, *, nbytes: int, block_size: int) -> list[str]:
    count = nbytes // block_size
    if op == "write":
        return ["dd", "if=/dev/zero", f"of={path}", f"bs={block_size}", f"count={count}",
                "oflag=direct"]
    return ["dd", f"if={path}", "of=/dev/null", f"bs={block_size}", f"count={count}",
            "iflag=direct"]


_DD_RE = re.compile(r"^(\d+) bytes .*? copied, ([\d.]+(?:e[-+]?\d+)?) s", re.M)


def parse_dd(text: str) -> tuple[int, float]:
    """(bytes, seconds) from dd's summary line (GNU coreutils, stderr)."""
    m = _DD_RE.search(text)
    if not m or float(m[2]) <= 0:
        raise ToolError(f"cannot read dd's summary: {text[-500:]}")
    return int(m[1]), float(m[2])


def measure(tool: str, path: Path, op: str, *, nbytes: int, block_size: int,
            queue_depth: int) -> ToolRun:
    """One write (to the fresh file ``path``) or read (of it) with fio or dd."""
    if op not in ("write", "read"):
        raise ValueError(f"op must be 'write' or 'read', not {op!r}")
    if nbytes % block_size:
        raise ValueError(f"nbytes={nbytes} is not a multiple of block_size={block_size}")
    if tool == "fio":
        cmd = fio_command(path, op, nbytes=nbytes, block_size=block_size,
                          queue_depth=queue_depth)
        moved, seconds = parse_fio(_run(cmd).stdout, op)
    elif tool == "dd":
        cmd = dd_command(path, op, nbytes=nbytes, block_size=block_size)
        moved, seconds = parse_dd(_run(cmd).stderr)
    else:
        raise ValueError(f"tool must be 'fio' or 'dd', not {tool!r}")
    if moved != nbytes:
        raise ToolError(f"{' '.join(cmd)} moved {moved} bytes, expected {nbytes}")
    return ToolRun(tool, op, nbytes, seconds, " ".join(cmd))
