"""Collectives: what each one must return on known data, which sizes a bandwidth sweep visits,
and how bandwidth is named (nccl-tests' definitions).

Exactness. Every rank's input is a known function of (rank, element index): integer units
times a power-of-two unit, chosen per dtype so that every partial sum of a reduction is exact in
that dtype, in any order, and every value a rank receives is NOT exact in any other dtype the
collective could be carried in. With M the dtype's significant bits (bf16 8, fp16 11, fp32 24):
one rank (rank 0 of a reduction, every rank otherwise) sends odd units of magnitude in
[2**(M-2), 2**(M-1)), M - 1 significant bits; the others add even units whose sum stays below
2**(M-3), so every sum is odd, of magnitude in (2**(M-3), 2**(M-1) + 2**(M-3)): at least M - 2
significant bits and below 2**M. fp16 data (unit 1) so needs 9 or more bits, which bf16 does not
keep; fp32 data (unit 2**-10, magnitudes 2048 to 10240) 22 or more, which bf16, fp16 and a
tf32-like 10-bit mantissa do not; bf16 data (unit 2**20) is >= 2**21 wherever it is not zero,
past fp16's largest finite value (65504). So any backend must reproduce the expected output
exactly, and one that carries or reduces the data in another type (a compression hook, a wrong
NCCL datatype) is caught. Values
depend on the position, so an output in the wrong order or from the wrong rank is caught, not
only a wrong sum. Sizes that are not a multiple of the world size are laid out the way DeepSpeed
lays them out: all_gather and reduce_scatter pad the flat buffer to a multiple of the world size
as ZeRO partitions it (the padding must come back as zeros); all_to_all uses uneven splits, so
the ranks' totals differ and are not multiples of the world size.

Bandwidth. algbw = bytes / seconds; busbw = algbw * factor, factor from nccl-tests
(doc/PERFORMANCE.md): all_reduce 2(n-1)/n, all_gather, reduce_scatter and all_to_all (n-1)/n,
broadcast 1. "bytes" is nccl-tests' size: the whole buffer (all_gather's output,
reduce_scatter's input). GB/s means 1e9 bytes per second.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dsconform.units import GIB

__all__ = [
    "COLLECTIVES", "DTYPES", "DEFAULT_TOP_BYTES", "GIB", "MIB", "Mismatch", "bus_factor",
    "exact_case", "exactness_message", "find_mismatch", "iterations", "mismatches_from_ranks",
    "span", "sweep_sizes", "sweep_top", "wrong_output_message",
]

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")


@dataclass(frozen=True)
class NcclFloor:
    """A profile's bus-bandwidth floor for one collective at one size (``[nccl] floors``)."""
    collective: str
    bytes: int
    busbw_gbps: float
    world_size: int | None = None  # None: all GPUs the profile promises
    source: str = ""


MIB = 1 << 20
DTYPES = ("fp32", "bf16", "fp16")
#: Where a sweep ends when the profile states no floor (the issue's "or 4 GiB").
DEFAULT_TOP_BYTES = 4 * GIB
#: On the CPU accelerator (gloo over shared memory, 2 ranks on a shared CI machine) a sweep
#: stops here: beyond it a round takes seconds and measures the machine's load, not gloo.
CPU_TOP_BYTES = 64 * MIB

# The acceptance tier's sizes (each point costs well under a second on 2xH200): 1 MiB shows
# per-call overhead, 64 MiB and 1 GiB the bandwidth regime. all_reduce, the collective ZeRO and
# DDP lean on, gets one point more than the others. Floors are measured by their own tests at
# their own sizes (suites/test_collectives.py COLL-BW-2), so 4 GiB is not repeated here.
_ACCEPTANCE = {"cuda": {"all_reduce": (MIB, 64 * MIB, GIB), "*": (MIB, 64 * MIB)},
               "cpu": {"all_reduce": (MIB, 4 * MIB), "*": (MIB,)}}


def bus_factor(collective: str, n: int) -> float:
    """nccl-tests' bus bandwidth factor: busbw = algbw * factor."""
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r} (known: {', '.join(COLLECTIVES)})")
    if n < 1:
        raise ValueError(f"world size must be >= 1, got {n}")
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective == "broadcast":
        return 1.0
    return (n - 1) / n


def iterations(nbytes: int, accelerator: str) -> int:
    """Back-to-back calls per round, a function of the size only (so two runs are comparable).
    cuda: about 20 GB moved per round, long enough to swamp launch jitter and short at 4 GiB
    (the rule the floors were measured with). cpu: about 200 MB, a fraction of a second."""
    if accelerator == "cuda":
        return max(5, min(200, int(2e10 // nbytes)))
    return max(3, min(20, int(2e8 // nbytes)))


def sweep_top(floors: Iterable[NcclFloor], accelerator: str) -> int:
    """The largest size a sweep visits: the largest floor's size, else DEFAULT_TOP_BYTES; capped
    at CPU_TOP_BYTES on the CPU accelerator."""
    sizes = [f.bytes for f in floors]
    top = max(sizes) if sizes else DEFAULT_TOP_BYTES
    return min(top, CPU_TOP_BYTES) if accelerator == "cpu" else top


def sweep_sizes(collective: str, top: int, *, accelerator: str, full: bool) -> tuple[int, ...]:
    """Sizes of one collective's sweep, ascending, from 1 MiB to ``top``.

    full (the nightly ``slow`` tier): 1 MiB * 4**k up to ``top``, and ``top`` itself.
    Otherwise (the acceptance tier and CI) a few of them, never more than the full sweep."""
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r} (known: {', '.join(COLLECTIVES)})")
    if top < MIB:
        raise ValueError(f"a sweep needs top >= 1 MiB, got {top} bytes")
    everything = []
    size = MIB
    while size <= top:
        everything.append(size)
        size *= 4
    if everything[-1] != top:
        everything.append(top)
    if full:
        return tuple(everything)
    table = _ACCEPTANCE["cuda" if accelerator == "cuda" else "cpu"]
    chosen = table.get(collective, table["*"])
    return tuple(s for s in chosen if s <= top)


# ------------------------------------------------------------------ exact data

# dtype -> (the significant bits M its data uses, the value of one unit). bf16's unit puts every
# nonzero value past fp16's range; fp32's keeps its values within fp16's normal range, so fp16
# rounding there is a tf32-like 11-bit rounding.
_UNITS = {"bf16": (8, 2.0 ** 20), "fp16": (11, 1.0), "fp32": (24, 2.0 ** -10)}


def _carries(n: int, rank: int, reduces: bool) -> bool:
    """Whether ``rank`` sends the full-precision values (rank 0 of a reduction, every rank of a
    collective that does not add)."""
    return not reduces or n == 1 or rank == 0


def span(n: int, dtype: str = "bf16", rank: int = 0, reduces: bool = True) -> int:
    """Largest |units| of rank ``rank``'s input: 2**(M-1) - 1 where it carries the precision;
    for the other ranks of a reduction, even units whose sum over the n - 1 of them stays below
    2**(M-3) (0 where that leaves no room, e.g. bf16 on more than 16 ranks)."""
    bits = _UNITS[dtype][0]
    if _carries(n, rank, reduces):
        return (1 << (bits - 1)) - 1
    return 2 * (((1 << (bits - 3)) - 1) // (2 * (n - 1)))


def unit(dtype: str) -> float:
    """The value of one unit of ``dtype``'s exact data (a power of two)."""
    return _UNITS[dtype][1]


def _unit_values(rank: int, index: Any, n: int, dtype: str = "bf16",
                 reduces: bool = True) -> Any:
    """Rank ``rank``'s input units at flat positions ``index`` (an int64 tensor): odd, of
    magnitude in [2**(M-2), 2**(M-1)), where it carries the precision; even, in [-span, span],
    otherwise. Both depend on the position and the rank, signs mixed."""
    bits = _UNITS[dtype][0]
    mix = index * 7 + rank * 13
    if _carries(n, rank, reduces):
        sign = 1 - 2 * ((index + rank) % 3 == 0).to(index.dtype)
        return sign * ((1 << (bits - 2)) + 2 * (mix % (1 << (bits - 3))) + 1)
    half = span(n, dtype, rank, reduces) // 2
    return 2 * (mix % (2 * half + 1) - half)


def _splits(rank: int, n: int, numel: int) -> list[int]:
    """all_to_all: elements rank ``rank`` sends to each rank; uneven on purpose, and the total,
    n * numel + (about n/2), never a multiple of n."""
    return [numel + (rank + dst) % 2 for dst in range(n)]


@dataclass(frozen=True)
class ExactCase:
    """One rank's side of an exactness check: input and expected output in integer units
    (int64 tensors, exact; ``as_float`` gives the values), and the keyword arguments the
    collective needs."""
    collective: str
    numel: int
    input: Any
    expected: Any
    layout: str  # how the size was laid out, for the failure message
    input_splits: list[int] | None = None
    output_splits: list[int] | None = None
    src: int | None = None
    unit: float = 1.0  # the value of one unit

    def as_float(self, units: Any, dtype: Any) -> Any:
        """``units`` (int64) as values of torch dtype ``dtype``: exact for the case's dtype."""
        import torch

        return (units.to(torch.float64) * self.unit).to(dtype)


def exact_case(collective: str, rank: int, n: int, numel: int, device: Any = "cpu",
               dtype: str = "bf16") -> ExactCase:
    """Input and expected output of ``collective`` on rank ``rank`` of ``n`` for a logical size
    of ``numel`` elements (see the module docstring for the layouts), with ``dtype``'s data."""
    import dataclasses

    case = _exact_units(collective, rank, n, numel, device, dtype)
    return dataclasses.replace(case, unit=unit(dtype))


def _exact_units(collective: str, rank: int, n: int, numel: int, device: Any,
                 dtype: str) -> ExactCase:
    import torch

    reduces = collective in ("all_reduce", "reduce_scatter")

    def values(r: int, index: Any) -> Any:
        return _unit_values(r, index, n, dtype, reduces)

    if numel < 1:
        raise ValueError(f"numel must be >= 1, got {numel}")

    def arange(count: int, start: int = 0) -> torch.Tensor:
        return torch.arange(start, start + count, dtype=torch.int64, device=device)

    if collective == "all_reduce":
        g = arange(numel)
        expected = sum(values(r, g) for r in range(n))
        return ExactCase(collective, numel, values(rank, g), expected, f"{numel} elements")
    if collective == "broadcast":
        src = n - 1  # not rank 0: a broadcast that ignores src must not pass by luck
        g = arange(numel)
        return ExactCase(collective, numel, values(rank, g), values(src, g),
                         f"{numel} elements from rank {src}", src=src)
    if collective in ("all_gather", "reduce_scatter"):
        part = -(-numel // n)  # ZeRO: ceil(numel / n) per rank, the tail padded with zeros
        layout = (f"{numel} elements padded to {part * n} ({part} per rank)" if part * n != numel
                  else f"{numel} elements ({part} per rank)")
        if collective == "all_gather":
            flat = values(0, arange(part * n))
            flat[numel:] = 0
            mine = flat[rank * part:(rank + 1) * part].clone()
            return ExactCase(collective, numel, mine, flat, layout)
        g = arange(part * n)
        inputs = [values(r, g) for r in range(n)]
        for t in inputs:
            t[numel:] = 0
        total = sum(inputs)
        return ExactCase(collective, numel, inputs[rank],
                         total[rank * part:(rank + 1) * part].clone(), layout)
    if collective == "all_to_all":
        send = _splits(rank, n, numel)
        recv = [_splits(src, n, numel)[rank] for src in range(n)]
        pieces = []
        for src in range(n):
            offset = sum(_splits(src, n, numel)[:rank])
            pieces.append(values(src, arange(recv[src], offset)))
        return ExactCase(collective, numel, values(rank, arange(sum(send))),
                         torch.cat(pieces), f"uneven splits, this rank sends {send}",
                         input_splits=send, output_splits=recv)
    raise ValueError(f"unknown collective {collective!r} (known: {', '.join(COLLECTIVES)})")


# ------------------------------------------------------------------ comparing

@dataclass(frozen=True)
class Mismatch:
    """Where one rank's output of one collective differs from the exact result."""
    collective: str
    dtype: str
    numel: int
    rank: int
    index: int       # first wrong element of the output
    expected: float
    found: float
    wrong: int       # how many elements are wrong
    total: int       # output elements
    layout: str = ""
    where: str = ""  # the rank's device, e.g. "GPU 1 (PCI 0000:2a:00.0)"
    api: str = "deepspeed.comm"  # what the collective was called through

    def describe(self) -> str:
        """One line; values with 9 significant digits, enough to tell any two fp32 (and so
        bf16 and fp16) values apart, and the difference itself."""
        at = f" on {self.where}" if self.where else ""
        return (f"{self.collective} {self.dtype} numel={self.numel} ({self.layout}): rank "
                f"{self.rank}{at}: element {self.index} is {self.found:.9g}, expected "
                f"{self.expected:.9g} ({self.wrong} of {self.total} elements wrong), off by "
                f"{self.found - self.expected:+.9g}, through {self.api}")


def find_mismatch(found: Any, expected: Any) -> tuple[int, float, float, int] | None:
    """(first wrong index, expected, found, number wrong), or None when equal element for
    element. ``found`` and ``expected`` are tensors of the same shape and dtype; NaN never
    equals anything."""
    if tuple(found.shape) != tuple(expected.shape):
        raise ValueError(f"output shape {tuple(found.shape)} is not the expected "
                         f"{tuple(expected.shape)}")
    wrong = found.ne(expected)
    count = int(wrong.sum().item())
    if not count:
        return None
    index = int(wrong.nonzero()[0, 0].item())
    return index, float(expected[index].item()), float(found[index].item()), count


def mismatches_from_ranks(per_rank: Sequence[Sequence[Mapping[str, Any]]]) -> list[Mismatch]:
    """Every rank's reported mismatches (dicts with Mismatch's fields), in rank order."""
    return [Mismatch(**m) for reports in per_rank for m in reports]


def wrong_output_message(collective: str, nbytes: int, wrong: Sequence[int],
                         who: Sequence[str], api: str | None = None) -> str:
    """The failure of a timed bandwidth point whose checked call (every rank's input rank + 1)
    returned wrong elements (``wrong[r]`` on the rank named ``who[r]``), called through ``api``
    where given; "" when none did."""
    bad = [f"{name}: {count} elements" for name, count in zip(who, wrong) if count]
    if not bad:
        return ""
    through = f" through {api}" if api else ""
    return (f"{collective} at {nbytes} bytes returned wrong values{through} after the timed "
            f"calls (input rank + 1 on every rank): " + ", ".join(bad))


def exactness_message(mismatches: Sequence[Mismatch]) -> str:
    """One line per wrong output; empty when there is none."""
    if not mismatches:
        return ""
    head = f"{len(mismatches)} collective output(s) differ from the exact result:"
    return "\n  ".join([head] + [m.describe() for m in mismatches])
