"""Silent data corruption: every GPU MUST compute the known answer, bit for bit, on every
repetition and as its peers do, and its memory MUST hold what was written to it.

A GPU that computes wrong values without crashing is found only by comparing values: most
corruptions are plausible numbers, not NaN or Inf (docs/sdc.md says what these checks can and
cannot find, with sources). Every GPU runs the same deterministic kernels at once on inputs drawn
on the CPU from fixed seeds (suites/sdc_ranks.py): GEMMs in bf16, fp16, fp32 and TF32 (bf16 and
TF32 where the GPU has them) at a size that loads every SM, a row reduction, an elementwise
chain of transcendentals, and one SGD step of a 256-1024-256 MLP; TF32 and reduced-precision
reductions off except for the TF32 GEMM, deterministic algorithms on.

- SDC-REPEAT-1 (``test_repetitions``): each GPU MUST give the same bits on every repetition.
- SDC-PEER-1 (``test_peers``): every GPU of one model MUST give the same bits as its peers;
  where a strict majority agrees the GPUs outside it are named, else every GPU of the model.
  Needs two GPUs of a model (a one-GPU node has SDC-CAT-1).
- SDC-CAT-1 (``test_catalogue``): each GPU's hashes MUST be those recorded in
  ``dsconform/profile/known_answers.toml`` for its model and this torch, CUDA and cuBLAS; where
  none is recorded it skips saying so, and every run records what it observed (fact
  ``sdc.observed``) for ``dsconform known-answers``.
- SDC-REF-1 (``test_reference``): each kernel MUST agree with a CPU float64 evaluation of the
  same inputs within its dtype's bound (``dsconform/checks/tolerances.py`` "sdc_reference",
  sampled rows); the share of its bound each kernel used is recorded
  (``sdc.reference.bound_used``).
- SDC-HBM-1 (``test_hbm_patterns``, nightly): walking ones, address-in-address and random
  patterns written over ``HBM_FRACTION`` of each GPU's free memory MUST read back as written.

- SOAK-1 (``test_soak``, only with ``--soak MINUTES``): for MINUTES, every GPU at once loops the
  known-answer kernels, the ZeRO training cells against DDP (``SOAK_TRAIN``), a sustained bf16
  matmul and a slice of the HBM patterns, while the hardware gate is read every
  ``SAMPLE_INTERVAL_S``; no GPU MAY show a mismatch, a gate finding, a slowdown clock event, its
  slowdown temperature or a matmul drift past ``straggler_pct`` between the first and the last
  quarter of its iterations (docs/burn-in.md).

The acceptance tier runs the short pass (GEMMs of 4096, 3 repetitions); the nightly tier the
full pass (8192, 10 repetitions) and the HBM test. Every failure names the GPU (nvidia-smi
index, PCI bus id, board serial where NVML gives one), the kernel or pattern, and the
repetition, element count or offset. The judgement: ``dsconform/checks/sdc.py``.

Stable ids: SDC-REPEAT-1, SDC-PEER-1, SDC-CAT-1, SDC-REF-1, SDC-HBM-1, SOAK-1; each case id
(``short``, ``full``) names its pass and does not change.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dsconform.suite import (
    GIB,
    ZeroCase,
    gpu_health,
    health,
    known_answers,
    requires,
    run_ranks,
    sampler,
    sdc,
    soak,
    tolerance,
    worker_gpus,
    zero_check_name,
)
from suites import sdc_ranks

CAPABILITY = "sdc"
TIMEOUT_S = 300
#: Bump when a kernel, its inputs or its settings change: recorded hashes then stop matching.
INPUTS_VERSION = 1
KINDS = ("gemm.bf16", "gemm.fp16", "gemm.fp32", "gemm.tf32", "reduce.fp32", "elementwise.fp32",
         "train.fp32")
HBM_FRACTION = 0.9          # of the free memory, less HBM_RESERVE for the pattern's temporaries
HBM_RESERVE = 4 * GIB
HBM_MIN_FRACTION = 0.8      # a GPU that tested less of its free memory fails


@dataclass(frozen=True)
class Pass:
    size: int
    reps: int


#: 4096: 512 output tiles of 128x256 on a 132-SM H200, a few ms per GEMM; 3 repetitions keep
#: the acceptance pass near 2 s. The nightly pass doubles the size and runs 10.
PASSES = {"short": Pass(4096, 3), "full": Pass(8192, 10)}
PASS_PARAMS = [pytest.param("short", id="short"),
               pytest.param("full", id="full", marks=pytest.mark.slow)]


def reference_tols(profile_tolerances: Any = None) -> dict[str, Any]:
    """Each kind's bound against the CPU float64 reference, from the tolerance table."""
    out = {}
    for kind in KINDS:
        family, dtype = kind.split(".")
        out[kind] = tolerance("sdc_reference", dtype, family, profile_tolerances,
                              accelerator="cuda")
    return out


def run_pass(name: str, accelerator: str, world_size: int, tols: dict[str, Any],
             tamper: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    p = PASSES[name]
    return run_ranks(sdc_ranks.known_answers, world_size, timeout_s=TIMEOUT_S,
                     args=(list(KINDS), p.size, p.reps,
                           {k: (t.rtol, t.atol) for k, t in tols.items()}),
                     kwargs={"tamper": tamper}, accelerator=accelerator)


def by_name(tols: dict[str, Any], size: int) -> dict[str, Any]:
    """The bounds keyed by the names the ranks report kernels under."""
    return {sdc_ranks.kernel_name(k, size): t for k, t in tols.items()}


_RUNS: dict[str, tuple[list[dict[str, Any]], list[Any]]] = {}


def pass_results(name: str, node, profile, facts) -> tuple[list[dict[str, Any]], list[Any]]:
    """The pass's results on every GPU at once and who each rank ran on, run once per session
    (every check of the pass reads the same run); the first test to run it records what each
    GPU observed (fact ``sdc.observed``)."""
    if name not in _RUNS:
        results = run_pass(name, "cuda", len(worker_gpus()), reference_tols(profile.tolerances))
        ids = gpu_health.identify([r["identity"] for r in results], node.hardware.bus_ids)
        facts.record(f"{known_answers.FACT}.{name}", [
            {**known_answers.observed(r["name"], r["versions"], INPUTS_VERSION,
                                      {k: v["hash"] for k, v in r["kernels"].items()}),
             "gpu": sdc.gpu_label(i, r["serial"])} for r, i in zip(results, ids)])
        _RUNS[name] = (results, ids)
    return _RUNS[name]


def catalogue_check(results: list[dict[str, Any]], ids: list[Any],
                    answers: Any = None) -> tuple[list[str], list[str]]:
    """SDC-CAT-1 over every GPU: (problems, why a GPU could not be compared)."""
    problems, skipped = [], []
    for res, ident in zip(results, ids):
        label = sdc.gpu_label(ident, res["serial"])
        entry = known_answers.observed(res["name"], res["versions"], INPUTS_VERSION,
                                       {k: v["hash"] for k, v in res["kernels"].items()})
        recorded, why = known_answers.lookup(entry, answers)
        if recorded is None:
            skipped.append(f"{label}: {why}")
            continue
        found, unrecorded = sdc.catalogue_problems(entry["hashes"], recorded, label)
        problems += found
        if unrecorded:
            skipped.append(f"{label}: the entry records no hash for {', '.join(unrecorded)}")
    return problems, skipped


@pytest.mark.gpu
@requires(min_gpus=1)
@pytest.mark.parametrize("pass_name", PASS_PARAMS)
def test_repetitions(pass_name: str, node, profile, facts):
    """SDC-REPEAT-1: each GPU MUST give the same bits on every repetition of every kernel."""
    results, ids = pass_results(pass_name, node, profile, facts)
    problems = sdc.repetition_problems(results, ids)
    assert not problems, "a GPU computed different bits from the same inputs:\n  " + \
        "\n  ".join(problems)


@pytest.mark.gpu
@requires(min_gpus=1)
@pytest.mark.parametrize("pass_name", PASS_PARAMS)
def test_peers(pass_name: str, node, profile, facts):
    """SDC-PEER-1: every GPU of one model MUST give the same bits as its peers."""
    results, ids = pass_results(pass_name, node, profile, facts)
    models = [r["name"] for r in results]
    if all(models.count(m) < 2 for m in models):
        pytest.skip(f"no two GPUs of one model ({', '.join(models)}): no peers to compare; "
                    f"SDC-CAT-1 compares with the recorded known answers")
    problems = sdc.peer_problems(results, ids)
    assert not problems, "GPUs of one model computed different bits:\n  " + \
        "\n  ".join(problems)


@pytest.mark.gpu
@requires(min_gpus=1)
@pytest.mark.parametrize("pass_name", PASS_PARAMS)
def test_catalogue(pass_name: str, node, profile, facts):
    """SDC-CAT-1: each GPU's hashes MUST be the known answers recorded for its model, torch,
    CUDA and cuBLAS."""
    results, ids = pass_results(pass_name, node, profile, facts)
    problems, skipped = catalogue_check(results, ids)
    assert not problems, "a GPU's result is not the recorded known answer:\n  " + \
        "\n  ".join(problems)
    if skipped:
        pytest.skip("no recorded known answer to compare with: " + "; ".join(skipped))


@pytest.mark.gpu
@requires(min_gpus=1)
@pytest.mark.parametrize("pass_name", PASS_PARAMS)
def test_reference(pass_name: str, node, profile, facts, metrics):
    """SDC-REF-1: each kernel MUST agree with a CPU float64 reference within its dtype's
    bound."""
    results, ids = pass_results(pass_name, node, profile, facts)
    tols = by_name(reference_tols(profile.tolerances), PASSES[pass_name].size)
    for res, ident in zip(results, ids):
        for kernel, k in res["kernels"].items():
            metrics.record("sdc.reference.bound_used", k["reference"]["used"], unit="1",
                           better="lower", bound=1.0, kernel=kernel, who=ident.label,
                           **ident.params())
    problems = sdc.reference_problems(results, ids, tols)
    assert not problems, "a GPU's result is off the CPU float64 reference:\n  " + \
        "\n  ".join(problems)


@pytest.mark.gpu
@pytest.mark.slow
@requires(min_gpus=1)
def test_hbm_patterns(node, metrics):
    """SDC-HBM-1: every pattern written over most of each GPU's free memory MUST read back as
    written."""
    results = run_ranks(sdc_ranks.hbm_patterns, len(worker_gpus()), timeout_s=TIMEOUT_S,
                        args=(HBM_FRACTION, HBM_RESERVE, sdc_ranks.PATTERNS),
                        accelerator="cuda")
    ids = gpu_health.identify([r["identity"] for r in results], node.hardware.bus_ids)
    for res, ident in zip(results, ids):
        metrics.record("sdc.hbm.tested_bytes", res["tested_bytes"], unit="B", better="higher",
                       who=ident.label, **ident.params())
    problems = sdc.hbm_problems(results, ids, HBM_MIN_FRACTION)
    assert not problems, "a GPU's memory did not hold what was written:\n  " + \
        "\n  ".join(problems)


# ------------------------------------------------------------------------------ the burn-in

#: The hardware gate's reading interval during a soak: NVML reads take milliseconds; a minute's
#: progress line shows six readings per GPU.
SAMPLE_INTERVAL_S = 10.0
PROGRESS_S = 60.0
#: The ZeRO acceptance cells' training at every GPU of the node: stages 1-3, fp32 and bf16, SGD
#: (no op to build).
SOAK_TRAIN = [ZeroCase(stage=s, dtype=d, optimizer="sgd", grad_accum=1, world_size="all")
              for s in (1, 2, 3) for d in ("fp32", "bf16")]
#: A sustained bf16 matmul of SOAK_MATMUL[0]^3 for SOAK_MATMUL[1] s each iteration (the rate
#: whose drift is judged); the HBM patterns over HBM_FRACTION, SOAK_PATTERNS an iteration.
SOAK_MATMUL = (8192, 10.0)
SOAK_PATTERNS = 4


def soak_args(seconds: float, world_size: int, profile_tolerances: Any, progress_dir: str
              ) -> tuple:
    """The rank loop's arguments (suites/sdc_ranks.py ``soak``)."""
    train = []
    for case in SOAK_TRAIN:
        case = case.with_(world_size=world_size)
        train.append((case, tolerance(zero_check_name(case), case.dtype, case.optimizer,
                                      profile_tolerances, accelerator="cuda")))
    tols = reference_tols(profile_tolerances)
    return (seconds, list(KINDS), PASSES["short"].size,
            {k: (t.rtol, t.atol) for k, t in tols.items()}, train, SOAK_MATMUL,
            (HBM_FRACTION, HBM_RESERVE, None), SOAK_PATTERNS, progress_dir)


def soak_catalogue(results: list[dict[str, Any]], ids: list[Any],
                   answers: Any = None) -> dict[str, Any]:
    """The soak's first iteration against the recorded known answers (SDC-CAT-1's check, at
    the acceptance pass's size): a GPU whose hashes differ from its recorded ones fails the
    soak; one with none recorded is named in ``not_compared``. Also which file was compared
    against (``file``, ``sha256``)."""
    problems, skipped = catalogue_check(results, ids, answers)
    unmatched = {s.split(": ", 1)[0] for s in skipped}
    labels = [sdc.gpu_label(i, r["serial"]) for r, i in zip(results, ids)]
    return {"file": f"dsconform/profile/{known_answers.ANSWERS_FILE.name}",
            "sha256": known_answers.digest(), "problems": problems,
            "compared": [label for label in labels if label not in unmatched],
            "not_compared": skipped}


def _progress(progress_dir: Path, watch: sampler.GateSampler, started: float,
              total_s: float) -> str:
    """The line of the minute: iterations and mismatches from the ranks' progress files, the
    temperatures from the sampler's last reading."""
    latest = watch.latest()
    rows = []
    for f in sorted(progress_dir.glob("rank*.json")):
        try:
            p = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        s = latest.get(p.get("bus_id"), {})
        rows.append((f"GPU {s.get('gpu', f.stem)}", p["iterations"], p["mismatches"],
                     s.get("temperature_c")))
    return soak.progress_line(time.monotonic() - started, total_s, rows)


@pytest.mark.gpu
@pytest.mark.soak
@requires(min_gpus=1)
def test_soak(node, profile, run, facts):
    """SOAK-1: for --soak MINUTES under load, no GPU MAY show a mismatch, a hardware gate
    finding, a slowdown or a throughput drift past straggler_pct."""
    total_s = run.soak_minutes * 60.0
    gpus = len(worker_gpus())
    pct = gpu_health.straggler_pct(profile.straggler_pct)
    progress_dir = Path(tempfile.mkdtemp(prefix="soak-", dir=run.scratch))
    watch = sampler.GateSampler(health.Thresholds.from_profile(profile.health),
                                SAMPLE_INTERVAL_S).start()
    started = time.monotonic()
    say = run.say or (lambda line: None)
    stop = threading.Event()

    def report_progress() -> None:
        while not stop.wait(PROGRESS_S):
            say(_progress(progress_dir, watch, started, total_s))

    ticker = threading.Thread(target=report_progress, name="dsconform-soak-progress",
                              daemon=True)
    ticker.start()
    try:
        results = run_ranks(sdc_ranks.soak, gpus, timeout_s=total_s + 4 * TIMEOUT_S,
                            args=soak_args(total_s, gpus, profile.tolerances,
                                           str(progress_dir)), accelerator="cuda")
    finally:
        stop.set()
        ticker.join()
        seen = watch.stop()
    elapsed = time.monotonic() - started
    ids = gpu_health.identify([r["identity"] for r in results], node.hardware.bus_ids)
    reports = soak.gpu_reports(results, ids, seen.samples,
                               [sdc.gpu_label(i, r["serial"]) for r, i in zip(results, ids)])
    node_findings = soak.attach_findings(reports, seen.findings)
    problems = soak.verdict(reports, pct, node_findings, seen.could_not)
    catalogue = soak_catalogue(results, ids)
    problems += catalogue.pop("problems")
    facts.record(soak.FACT, soak.summary(run.soak_minutes, elapsed, SAMPLE_INTERVAL_S, pct,
                                         reports, problems, catalogue))
    say(_progress(progress_dir, watch, started, total_s) + " (end)")
    assert not problems, f"the {run.soak_minutes:g}-minute burn-in failed:\n  " + \
        "\n  ".join(problems)
