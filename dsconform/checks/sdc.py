"""Silent data corruption: the judgement of the known-answer checks and the HBM pattern test
(suites/test_sdc.py). Pure functions over what the ranks report, so the project's tests can
drive them with any result, a corrupt one included.

What a rank reports for the known-answer pass (suites/sdc_ranks.py ``known_answers``)::

    {"identity": {...},            # collective_calls.identity(): rank, device, PCI bus id
     "serial": "1654922001234",    # NVML's board serial, None where NVML gives none
     "name": "NVIDIA H200",        # the device name (peers are grouped by it)
     "versions": {"torch": ..., "cuda": ..., "cublas": ...},
     "kernels": {"gemm.bf16.4096": {
         "hash": "<sha256 of repetition 0's output bytes>",
         "elements": 16777216, "reps": 3,
         "rep_differ": {"2": 1},   # repetition -> elements whose bits differ from repetition 0
         "peer_differ": 0,         # elements whose bits differ from rank 0's result (None: 1 GPU)
         "reference": {"index": 12, "value": 1.5, "reference": 1.49, "scale": 64.0,
                       "used": 0.2}}}}

``reference`` is the sampled element farthest outside the kernel's bound against a CPU float64
evaluation of the same inputs (checks/tolerances.py "sdc_reference"): it passes when
``|value - reference| <= atol * scale + rtol * |reference|``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from dsconform.checks.tolerances import Tol

#: Errors shown per GPU and pattern; the rest are counted.
SHOWN_ERRORS = 4


def gpu_label(ident: Any, serial: str | None) -> str:
    """``GPU 1 (PCI 0000:2a:00.0, rank 1), serial 1654922001234``: the GPU's NVML index, PCI
    bus id and, where NVML gives one, its board serial (what a technician reads off the
    board)."""
    return f"{ident.label}, serial {serial}" if serial else f"{ident.label}, serial unknown"


def _labels(results: Sequence[Mapping[str, Any]], ids: Sequence[Any]) -> list[str]:
    return [gpu_label(i, r.get("serial")) for r, i in zip(results, ids)]


def repetition_problems(results: Sequence[Mapping[str, Any]], ids: Sequence[Any]) -> list[str]:
    """SDC-REPEAT-1: one line per GPU and kernel whose repetitions gave other bits than its
    first, naming the repetition and how many elements differ."""
    out = []
    for label, res in zip(_labels(results, ids), results):
        for kernel, k in sorted(res["kernels"].items()):
            for rep, n in sorted(k.get("rep_differ", {}).items(), key=lambda x: int(x[0])):
                if n:
                    out.append(f"{label}: {kernel}: repetition {rep} of {k['reps']} differs "
                               f"from repetition 0 in {n} of {k['elements']} elements (same "
                               f"inputs, same kernel, same GPU)")
    return out


def peer_problems(results: Sequence[Mapping[str, Any]], ids: Sequence[Any]) -> list[str]:
    """SDC-PEER-1: among GPUs of one model, every kernel's bits MUST be the same. Where a strict
    majority agrees, each GPU outside it is named; where none does (two GPUs that differ),
    every GPU of the model is, since two results cannot say which one is wrong."""
    labels = _labels(results, ids)
    by_model: dict[str, list[int]] = {}
    for i, res in enumerate(results):
        by_model.setdefault(str(res.get("name")), []).append(i)
    out = []
    for model, members in sorted(by_model.items()):
        if len(members) < 2:
            continue
        kernels = sorted(set().union(*(results[i]["kernels"] for i in members)))
        for kernel in kernels:
            hashes = {i: results[i]["kernels"].get(kernel, {}).get("hash") for i in members}
            counts = Counter(hashes.values())
            if len(counts) == 1:
                continue
            top, n = counts.most_common(1)[0]
            majority = n * 2 > len(members)
            for i in [i for i in members if hashes[i] != top] if majority else members:
                k = results[i]["kernels"].get(kernel, {})
                differ = k.get("peer_differ")
                vs0 = ("" if differ is None or results[i]["identity"]["rank"] == 0
                       else f"; {differ} of {k.get('elements')} elements differ from rank 0's")
                why = (f"differs from the {n} of {len(members)} {model} GPUs that agree"
                       if majority else
                       f"the {len(members)} {model} GPUs do not agree and no majority says "
                       f"which is right (SDC-CAT-1 and SDC-REF-1 may)")
                out.append(f"{labels[i]}: {kernel}: result {_short(hashes[i])} {why} "
                           f"({_short(top) if majority else 'no majority'}){vs0}")
    return out


def _short(digest: str | None) -> str:
    return "missing" if not digest else f"sha256:{digest[:12]}"


def catalogue_problems(observed: Mapping[str, str], recorded: Mapping[str, str],
                       label: str) -> tuple[list[str], list[str]]:
    """SDC-CAT-1: (one line per kernel whose hash is not the one the catalogue recorded for this
    GPU model and torch/CUDA/cuBLAS, the kernels the entry does not record)."""
    problems, unrecorded = [], []
    for kernel, digest in sorted(observed.items()):
        want = recorded.get(kernel)
        if want is None:
            unrecorded.append(kernel)
        elif want != digest:
            problems.append(f"{label}: {kernel}: result {_short(digest)}, the catalogue records "
                            f"{_short(want)} for this GPU model, torch, CUDA and cuBLAS")
    return problems, unrecorded


def reference_problems(results: Sequence[Mapping[str, Any]], ids: Sequence[Any],
                       tols: Mapping[str, Tol]) -> list[str]:
    """SDC-REF-1: each GPU's kernels MUST agree with a CPU float64 evaluation of the same inputs
    within their dtype's bound (``tols`` by kernel, from the tolerance table)."""
    out = []
    for label, res in zip(_labels(results, ids), results):
        for kernel, k in sorted(res["kernels"].items()):
            ref, tol = k.get("reference"), tols.get(kernel)
            if ref is None or tol is None:
                continue
            diff = abs(ref["value"] - ref["reference"])
            bound = tol.atol * ref["scale"] + tol.rtol * abs(ref["reference"])
            if not diff <= bound:  # NaN fails
                out.append(f"{label}: {kernel}: element {ref['index']} is {ref['value']!r}, the "
                           f"CPU float64 reference {ref['reference']!r}: off by {diff:.4g}, "
                           f"bound {bound:.4g} ({tol}, scale {ref['scale']:g}; {tol.why})")
    return out


def hbm_problems(results: Sequence[Mapping[str, Any]], ids: Sequence[Any],
                 min_fraction: float) -> list[str]:
    """SDC-HBM-1: every word of every pattern MUST read back as written. One line per GPU and
    pattern with errors, naming the first offsets (bytes from the start of the tested block,
    and the device address), the word written and the word read; and one per GPU that tested
    less than ``min_fraction`` of its free memory (the check would pass unseen)."""
    out = []
    for label, res in zip(_labels(results, ids), results):
        free, tested = res["free_bytes"], res["tested_bytes"]
        if free and tested < min_fraction * free:
            out.append(f"{label}: tested {tested} bytes, under {min_fraction:.0%} of the "
                       f"{free} bytes free")
        for p in res["patterns"]:
            if not p["errors"]:
                continue
            shown = "; ".join(
                f"offset {e['offset']:#x} (address {e['address']:#x}): wrote "
                f"{e['expected'] & 0xFFFFFFFF:#010x}, read {e['found'] & 0xFFFFFFFF:#010x}"
                for e in p["first"][:SHOWN_ERRORS])
            out.append(f"{label}: {p['name']}: {p['errors']} of {p['words']} words read back "
                       f"wrong: {shown}")
    return out
