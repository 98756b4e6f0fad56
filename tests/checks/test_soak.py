"""SOAK-1 (``--soak MINUTES``) MUST fail a GPU that computes one wrong bit in one iteration, a GPU
that throttles or reaches its slowdown temperature, a hardware gate finding during the soak and
a matmul rate that drifts past ``straggler_pct``, each naming the GPU; its progress line, its
summary section and its Prometheus series MUST say per GPU what the soak saw.

The rank loop (suites/sdc_ranks.py ``soak``) runs for real on two CPU ranks, the known-answer
kernels, a ZeRO cell against DDP, the matmul and the HBM patterns included; its ``tamper`` hook
flips a bit after the real kernel computed its output, overwrites an HBM word after the real
write, or scales DeepSpeed's loss inside its backward (the ZeRO suite's fault). NVML is the
hardware gate tests' fake (tests/node/test_health.py) with temperatures and clock event reasons
added; the matmul timings of the drift tests are made up.
"""

from __future__ import annotations

import contextlib
import hashlib
import json

import pynvml
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dsconform.checks import soak
from dsconform.checks.tolerances import tolerance
from dsconform.checks.zero_vs_ddp import ZeroCase
from dsconform.harness.api import run_ranks
from dsconform.node import gpu_health, sampler
from dsconform.profile import known_answers
from dsconform.results import prometheus
from suites import sdc_ranks, test_sdc
from tests.node.test_health import FakeNvml, h200

BUS = ["0000:1b:00.0", "0000:2a:00.0"]
NVML_BUS = ["00000000:1B:00.0", "00000000:2A:00.0"]
SIZE = 64
PCT = gpu_health.DEFAULT_STRAGGLER_PCT


# ------------------------------------------------------------------ the rank loop, for real

def loop(tmp_path, tamper=None, iterations=2) -> list[dict]:
    case = ZeroCase(stage=1, dtype="fp32", optimizer="sgd", grad_accum=1, world_size=2,
                    steps=3)
    tol = tolerance("zero", "fp32", "sgd", accelerator="cpu")
    tols = test_sdc.reference_tols()
    return run_ranks(sdc_ranks.soak, 2, timeout_s=300, accelerator="cpu", args=(
        60.0, list(test_sdc.KINDS), SIZE, {k: (t.rtol, t.atol) for k, t in tols.items()},
        [(case, tol)], (64, 0.05), (0.9, 0, 1 << 16), 2, str(tmp_path)),
        kwargs={"max_iterations": iterations, "tamper": tamper})


def as_gpus(results: list[dict]) -> tuple[list[dict], list, list[str]]:
    """The results as two H200s would report them (rank r on the GPU at BUS[r])."""
    out = [{**r, "identity": {**r["identity"], "device": f"cuda:{i}", "bus_id": BUS[i]},
            "serial": f"16549220{i}"} for i, r in enumerate(results)]
    ids = gpu_health.identify([r["identity"] for r in out], BUS)
    return out, ids, [f"{i.label}, serial {r['serial']}" for r, i in zip(out, ids)]


def healthy_samples(n: int = 3, temp: int = 60, events: int = 0) -> list[dict]:
    return [{"at": 10.0 * t, "gpu": g, "bus_id": BUS[g], "temperature_c": temp,
             "slowdown_c": 87, "clock_events": events} for t in range(n) for g in range(2)]


#: The real loop's matmul on two shared CPU cores is noise, not a GPU's rate: drift is held to
#: straggler_pct by the tests with made-up timings.
NO_DRIFT_CHECK = float("inf")


def judge(results, samples, findings=(), could_not=(), pct=PCT) -> tuple[list, list[str]]:
    results, ids, labels = as_gpus(results)
    reports = soak.gpu_reports(results, ids, samples, labels)
    node = soak.attach_findings(reports, list(findings))
    return reports, soak.verdict(reports, pct, node, could_not)


def test_a_healthy_soak_passes_and_counts_every_iteration(tmp_path):
    results = loop(tmp_path)
    reports, problems = judge(results, healthy_samples(), pct=NO_DRIFT_CHECK)
    assert problems == []
    assert [r.iterations for r in reports] == [2, 2]
    assert [r.mismatches for r in reports] == [0, 0]
    assert all(it["tflops"] > 0 for r in results for it in r["iterations"])
    progress = json.loads((tmp_path / "rank1.json").read_text())
    assert progress["iterations"] == 2 and progress["mismatches"] == 0


def h200s(results: list[dict]) -> tuple[list[dict], list]:
    """The loop's results as two H200s with one torch, CUDA and cuBLAS would report them."""
    gpus, ids, _ = as_gpus(results)
    return [{**r, "name": "NVIDIA H200", "versions": H200_VERSIONS} for r in gpus], ids


H200_VERSIONS = {"torch": "2.11.0+cu130", "cuda": "13.0", "cublas": "13.1.0"}


def recorded(gpu: dict) -> dict:
    entry = known_answers.observed(gpu["name"], gpu["versions"], test_sdc.INPUTS_VERSION,
                                   {k: v["hash"] for k, v in gpu["kernels"].items()})
    return {known_answers.Key(*(entry[f] for f in known_answers.KEY_FIELDS)):
            dict(entry["hashes"])}


def test_the_soak_holds_its_first_iteration_to_the_recorded_known_answers(tmp_path):
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
    gpus, ids = h200s(loop(tmp_path / "a"))
    assert gpus[0]["kernels"].keys() == {sdc_ranks.kernel_name(k, SIZE)
                                         for k in test_sdc.KINDS}
    answers = recorded(gpus[0])
    cat = test_sdc.soak_catalogue(gpus, ids, answers)
    assert cat["problems"] == [] and cat["not_compared"] == []
    assert cat["compared"] == ["GPU 0 (PCI 0000:1b:00.0, rank 0), serial 165492200",
                               "GPU 1 (PCI 0000:2a:00.0, rank 1), serial 165492201"]
    assert cat["file"] == "dsconform/profile/known_answers.toml"
    assert cat["sha256"] == hashlib.sha256(known_answers.ANSWERS_FILE.read_bytes()).hexdigest()
    # One bit wrong in iteration 0 on GPU 1: the hashes every later iteration is held to are
    # themselves wrong; the recorded answer names the GPU.
    bad, ids = h200s(loop(tmp_path / "b", {"iteration": 0, "rank": 1, "kernel": "gemm.fp16",
                                            "rep": None, "index": 77, "bit": 0}))
    cat = test_sdc.soak_catalogue(bad, ids, answers)
    [line] = cat["problems"]
    assert line.startswith("GPU 1 (PCI 0000:2a:00.0, rank 1), serial 165492201: gemm.fp16.64: "
                           "result sha256:"), line
    assert len(cat["compared"]) == 2
    # Nothing recorded for this GPU: not compared, and said why; not a failure.
    cat = test_sdc.soak_catalogue(gpus, ids, answers={})
    assert cat["problems"] == [] and cat["compared"] == []
    assert "no known answer recorded for model h200, torch 2.11.0+cu130" in \
        cat["not_compared"][0]


def test_one_flipped_bit_in_one_iteration_fails_naming_the_gpu(tmp_path):
    tamper = {"iteration": 1, "rank": 1, "kernel": "gemm.fp32", "rep": 0, "index": 7,
              "bit": 3}
    reports, problems = judge(loop(tmp_path, tamper), healthy_samples(), pct=NO_DRIFT_CHECK)
    assert [r.mismatches for r in reports][0] == 0
    text = "\n".join(problems)
    assert problems, "a flipped bit passed the soak"
    assert problems[0].startswith("GPU 1 (PCI 0000:2a:00.0, rank 1), serial 165492201:"), text
    assert "iteration 1: gemm.fp32.64: result sha256:" in text
    assert "differs from iteration 0's" in text
    assert "1 of 4096 elements differ from rank 0's" in text


def test_an_hbm_word_that_reads_back_wrong_in_one_iteration_fails_naming_the_gpu(tmp_path):
    tamper = {"iteration": 0, "rank": 0, "pattern": "walking-ones-1", "word": 5}
    _, problems = judge(loop(tmp_path, tamper, iterations=1), healthy_samples(),
                        pct=NO_DRIFT_CHECK)
    assert len(problems) == 1, problems
    assert problems[0].startswith("GPU 0 (PCI 0000:1b:00.0, rank 0)"), problems
    assert "HBM walking-ones-1: 1 of" in problems[0] and "offset 0x14" in problems[0]


def test_a_zero_step_off_ddp_in_one_iteration_fails_naming_the_gpus(tmp_path):
    _, problems = judge(loop(tmp_path, {"iteration": 1, "perturb": 1.001}), healthy_samples(),
                        pct=NO_DRIFT_CHECK)
    assert len(problems) == 2, problems
    for gpu, line in enumerate(problems):
        assert line.startswith(f"GPU {gpu} (PCI {BUS[gpu]}, rank {gpu})"), line
        assert "1 mismatches in 2 iterations: iteration 1: ZeRO z1-off_none-fp32-sgd-gas1-ws2 " \
               "off DDP: step 0, grad of " in line, line


# ------------------------------------------------------------------ drift (made-up timings)

def timed(rates_by_gpu: list[list[float]]) -> list[dict]:
    return [{"identity": {"rank": g, "device": "cpu", "bus_id": None},
             "iterations": [{"iteration": i, "tflops": r, "mismatches": 0, "problems": []}
                            for i, r in enumerate(rates)]}
            for g, rates in enumerate(rates_by_gpu)]


def test_window_drift_compares_the_first_and_last_quarters():
    assert soak.window_drift([700.0]) == (None, None, None)
    first, last, drift = soak.window_drift([700, 700, 690, 650, 600, 600, 600, 600])
    assert (first, last) == (700, 600)
    assert drift == pytest.approx(100 / 7)


def test_a_drift_past_straggler_pct_fails_naming_the_gpu():
    steady = [700.0] * 8
    falling = [700.0, 700.0, 650.0, 600.0, 560.0, 540.0, 530.0, 530.0]  # -24%
    _, problems = judge(timed([steady, falling]), healthy_samples())
    assert len(problems) == 1, problems
    assert problems[0].startswith("GPU 1 (PCI 0000:2a:00.0, rank 1)"), problems
    assert "fell 24.3% from 700.0 TFLOPS (median of the first 2 iterations) to 530.0" in \
        problems[0]
    assert "past straggler_pct 20%" in problems[0]
    _, within = judge(timed([steady, [700.0] * 4 + [600.0] * 4]), healthy_samples())
    assert within == []  # 14% is within 20%


# ------------------------------------------------------------------ the gate, sampled

class SoakNvml(FakeNvml):
    """The gate's fake NVML with what the sampler reads besides: temperature, the slowdown
    threshold, the clock event reasons (``temp``, ``slowdown``, ``events`` per GPU)."""

    def nvmlDeviceGetTemperature(self, h, sensor):
        return self._get(h, "temp")

    def nvmlDeviceGetTemperatureThreshold(self, h, kind):
        assert kind == pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
        return self._get(h, "slowdown")

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return self._get(h, "events")


def two_gpus() -> SoakNvml:
    return SoakNvml([h200(bus=b, temp=55, slowdown=87, events=0) for b in NVML_BUS])


def sample(nvml: SoakNvml, during=None) -> sampler.Sampled:
    clock = iter(range(0, 1000, 10))
    s = sampler.GateSampler(interval_s=3600.0, open_nvml=lambda: contextlib.nullcontext(
        (nvml, list(range(len(nvml.gpus))))), kernel_log=lambda: ("", ""),
        clock=lambda: float(next(clock)))
    s.start()
    if during:
        during(nvml)
    s.tick()
    return s.stop()


def steady() -> list[dict]:
    return timed([[700.0] * 4, [700.0] * 4])


def test_a_healthy_gate_passes_and_reports_the_highest_temperature():
    def warm(nvml):
        nvml.gpus[1]["temp"] = 71
    seen = sample(two_gpus(), warm)
    reports, problems = judge(steady(), seen.samples, seen.findings, seen.could_not)
    assert problems == []
    assert [r.max_temperature_c for r in reports] == [55, 71]
    assert [r.samples for r in reports] == [2, 2]


def test_a_thermal_slowdown_fails_naming_the_gpu():
    def throttle(nvml):
        nvml.gpus[0]["events"] = 0x40 | 0x1  # HW_THERMAL_SLOWDOWN, and GPU idle (no fault)
        nvml.gpus[0]["temp"] = 88
    seen = sample(two_gpus(), throttle)
    reports, problems = judge(steady(), seen.samples, seen.findings, seen.could_not)
    assert reports[0].throttle == {"HW_THERMAL_SLOWDOWN": 1}
    assert len(problems) == 2, problems
    assert all(p.startswith("GPU 0 (PCI 0000:1b:00.0, rank 0)") for p in problems), problems
    assert "clock event HW_THERMAL_SLOWDOWN in 1 of 2 readings" in problems[0]
    assert "reached 88 C, at or above its slowdown temperature 87 C" in problems[1]


def test_an_ecc_error_during_the_soak_fails_naming_the_gpu_and_the_time():
    def fault(nvml):
        nvml.gpus[1]["ecc"][("UNCORRECTED", "VOLATILE")] = 1
    seen = sample(two_gpus(), fault)
    _, problems = judge(steady(), seen.samples, seen.findings, seen.could_not)
    assert problems, "an uncorrected ECC error passed the soak"
    assert problems[0].startswith("GPU 1 (PCI 0000:2a:00.0, rank 1), serial 165492201: at 20 s "
                                  "of the soak: RESET"), problems
    assert "uncorrected" in problems[0].lower()


def test_nvml_unreadable_during_the_soak_fails():
    _, problems = judge(steady(), [], (), ["at 10 s: NVML cannot be read: NVMLError: gone"])
    assert problems[0] == ("GPU 0 (PCI 0000:1b:00.0, rank 0), serial 165492200: the hardware "
                           "gate never read this GPU during the soak")
    assert problems[-1] == ("the hardware gate could not be sampled: at 10 s: NVML cannot be "
                            "read: NVMLError: gone")


# ------------------------------------------------------------------ console, summary, Prometheus

def test_the_progress_line_says_elapsed_iterations_mismatches_and_temperatures():
    line = soak.progress_line(725.0, 3600.0, [("GPU 0", 214, 0, 61), ("GPU 1", 213, 2, None)])
    assert line == "soak 12/60 min: GPU 0 214 it 0 mism 61 C, GPU 1 213 it 2 mism ? C"


def test_the_summary_section_becomes_per_gpu_prometheus_series():
    seen = sample(two_gpus())
    falling = [700.0, 700.0, 650.0, 600.0, 560.0, 540.0, 530.0, 530.0]
    results, ids, labels = as_gpus(timed([[700.0] * 8, falling]))
    reports = soak.gpu_reports(results, ids, seen.samples, labels)
    problems = soak.verdict(reports, PCT)
    section = json.loads(json.dumps(soak.summary(60, 3601.0, 10.0, PCT, reports, problems)))
    assert section["passed"] is False and section["gpus"][1]["bus_id"] == BUS[1]
    text = generate_latest(prometheus.registry_of(prometheus.soak_families(section))).decode()
    series = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for fam in text_string_to_metric_families(text) for s in fam.samples}
    gpu1 = (("bus_id", BUS[1]), ("gpu", "1"))
    assert series[("dsconform_soak_iterations", gpu1)] == 8
    assert series[("dsconform_soak_mismatches", gpu1)] == 0
    assert series[("dsconform_soak_throughput_drift_ratio", gpu1)] == pytest.approx(0.2429, 1e-3)
    assert series[("dsconform_soak_temperature_max_celsius", gpu1)] == 55
    assert series[("dsconform_soak_matmul_flop_per_second", (*gpu1, ("window", "last")))] == \
        530e12
    assert series[("dsconform_soak_passed", ())] == 0
    assert series[("dsconform_soak_duration_seconds", (("kind", "asked"),))] == 3600
    assert prometheus.soak_families(None) == []
