"""SDC-REPEAT-1, SDC-PEER-1, SDC-CAT-1, SDC-REF-1 and SDC-HBM-1 MUST fail a GPU that computes
one wrong bit, a peer that differs, a result that is not the recorded known answer, a value off
the float64 reference and a memory word that reads back wrong, naming the GPU.

The rank functions run for real on CPU ranks (this machine has no GPU); each fault is injected
by their ``tamper`` hook after the real kernel computed its output (or the real pattern was
written). Only the GPUs' identities (PCI bus id, serial, device name, versions) are faked, as a
node with GPUs would report them."""

from __future__ import annotations

import pytest

from dsconform.harness.api import run_ranks
from dsconform.node import gpu_health
from dsconform.profile import known_answers
from dsconform.profile.known_answers import Key
from suites import sdc_ranks, test_sdc
from suites.test_sdc import catalogue_check

SIZE = 64
BUS = ["0000:1b:00.0", "0000:2a:00.0", "0000:3c:00.0"]
SERIALS = ["1654922001234", "1654922005678", None]
VERSIONS = {"torch": "2.11.0+cu130", "cuda": "13.0", "cublas": "13.1.0"}
TOLS = test_sdc.reference_tols()
_CACHE: dict[str, list[dict]] = {}


def run(tamper: dict | None = None) -> list[dict]:
    """The short pass's kernels at SIZE on two CPU ranks, ``tamper`` injected."""
    key = repr(tamper)
    if key not in _CACHE:
        _CACHE[key] = run_ranks(sdc_ranks.known_answers, 2, timeout_s=300,
                                args=(list(test_sdc.KINDS), SIZE, 3,
                                      {k: (t.rtol, t.atol) for k, t in TOLS.items()}),
                                kwargs={"tamper": tamper}, accelerator="cpu")
    return _CACHE[key]


def as_gpus(results: list[dict], ranks: list[int] | None = None) -> tuple[list[dict], list]:
    """The results as H200s would report them: rank r on the GPU at BUS[r] with SERIALS[r]
    (``ranks`` renumbers them, so a result can stand for a third GPU)."""
    out = []
    for r, res in zip(ranks or range(len(results)), results):
        out.append({**res, "identity": {**res["identity"], "rank": r, "device": f"cuda:{r}",
                                        "bus_id": BUS[r]},
                    "serial": SERIALS[r], "name": "NVIDIA H200", "versions": VERSIONS})
    return out, gpu_health.identify([r["identity"] for r in out], BUS)


def by_name() -> dict:
    return test_sdc.by_name(TOLS, SIZE)


def test_healthy_gpus_pass_every_check():
    results, ids = as_gpus(run())
    assert sdc_problems(results, ids) == []
    assert results[0]["kernels"].keys() == {sdc_ranks.kernel_name(k, SIZE)
                                            for k in test_sdc.KINDS}
    assert [k["hash"] for k in results[0]["kernels"].values()] == \
        [k["hash"] for k in results[1]["kernels"].values()]


def sdc_problems(results: list[dict], ids: list) -> list[str]:
    from dsconform.checks import sdc
    return (sdc.repetition_problems(results, ids) + sdc.peer_problems(results, ids)
            + sdc.reference_problems(results, ids, by_name()))


def test_one_flipped_bit_in_one_repetition_fails_naming_the_gpu():
    from dsconform.checks import sdc
    results, ids = as_gpus(run({"rank": 1, "kernel": "gemm.bf16", "rep": 2, "index": 5,
                                "bit": 3}))
    [line] = sdc.repetition_problems(results, ids)
    assert line.startswith("GPU 1 (PCI 0000:2a:00.0, rank 1), serial 1654922005678: "
                           "gemm.bf16.64: repetition 2 of 3 differs from repetition 0 in 1 of "
                           "4096 elements"), line
    # The first repetition was right: the peers and the reference agree with it.
    assert sdc.peer_problems(results, ids) == []
    assert sdc.reference_problems(results, ids, by_name()) == []


def test_a_peer_that_differs_fails_and_the_majority_names_it():
    from dsconform.checks import sdc
    bad = run({"rank": 1, "kernel": "gemm.fp16", "rep": None, "index": 77, "bit": 0})
    results, ids = as_gpus(bad)
    assert sdc.repetition_problems(results, ids) == []  # wrong the same way every time
    two = sdc.peer_problems(results, ids)
    assert len(two) == 2 and all("no majority" in line for line in two), two
    assert "GPU 0 (PCI 0000:1b:00.0, rank 0), serial 1654922001234: gemm.fp16.64" in two[0]
    assert "GPU 1 (PCI 0000:2a:00.0, rank 1)" in two[1]
    assert "1 of 4096 elements differ from rank 0's" in two[1]
    # A third GPU computing what rank 0 did: two agree, the odd one is named alone.
    results, ids = as_gpus([bad[0], bad[1], bad[0]], ranks=[0, 1, 2])
    [line] = sdc.peer_problems(results, ids)
    assert line.startswith("GPU 1 (PCI 0000:2a:00.0, rank 1), serial 1654922005678: "
                           "gemm.fp16.64: result sha256:"), line
    assert "differs from the 2 of 3 NVIDIA H200 GPUs that agree" in line
    # A low mantissa bit is inside the float64 reference's bound: only the hashes find it.
    assert sdc.reference_problems(results, ids, by_name()) == []


def test_a_flipped_exponent_bit_fails_the_reference():
    from dsconform.checks import sdc
    results, ids = as_gpus(run({"rank": 0, "kernel": "gemm.fp32", "rep": None, "index": 5,
                                "bit": 30}))
    [line] = sdc.reference_problems(results, ids, by_name())
    assert line.startswith("GPU 0 (PCI 0000:1b:00.0, rank 0), serial 1654922001234: "
                           "gemm.fp32.64: element 5 is "), line
    assert "the CPU float64 reference" in line and "rtol=0 atol=0.0001" in line


def _recorded(results: list[dict]) -> dict:
    res = results[0]
    entry = known_answers.observed(res["name"], res["versions"], test_sdc.INPUTS_VERSION,
                                   {k: v["hash"] for k, v in res["kernels"].items()})
    return {Key(*(entry[f] for f in known_answers.KEY_FIELDS)): dict(entry["hashes"])}


def test_a_one_gpu_node_is_held_to_the_recorded_known_answer():
    healthy, _ = as_gpus(run())
    answers = _recorded(healthy)
    one, ids = as_gpus(run()[:1])
    assert catalogue_check(one, ids, answers) == ([], [])
    # The same GPU computing one bit wrong on every repetition: nothing else can see it.
    bad, ids = as_gpus(run({"rank": 1, "kernel": "gemm.fp16", "rep": None, "index": 77,
                            "bit": 0})[1:], ranks=[1])
    problems, skipped = catalogue_check(bad, ids, answers)
    assert skipped == [] and len(problems) == 1, problems
    assert problems[0].startswith("GPU 1 (PCI 0000:2a:00.0, rank 1), serial 1654922005678: "
                                  "gemm.fp16.64: result sha256:"), problems
    assert "the catalogue records sha256:" in problems[0]


def test_without_a_recorded_answer_the_check_says_what_to_record():
    one, ids = as_gpus(run()[:1])
    problems, [why] = catalogue_check(one, ids, answers={})
    assert problems == []
    assert ("no known answer recorded for model h200, torch 2.11.0+cu130, CUDA 13.0, cuBLAS "
            "13.1.0, inputs v1") in why
    assert "dsconform known-answers RESULTS_DIR" in why
    other = [{**one[0], "name": "NVIDIA B300"}]
    _, [why] = catalogue_check(other, ids, answers={})
    assert "'NVIDIA B300' is not in the GPU catalogue" in why
    unread = [{**one[0], "versions": {**VERSIONS, "cublas": "unknown"}}]
    _, [why] = catalogue_check(unread, ids, answers={})
    assert "could not be read" in why


def hbm(tamper: dict | None = None, max_bytes: int = 1 << 20) -> tuple[list[dict], list]:
    out = run_ranks(sdc_ranks.hbm_patterns, 2, timeout_s=300,
                    args=(0.9, 0, ["walking-ones-0", "walking-ones-31", "address-plain",
                                   "address-inverted", "random-1"]),
                    kwargs={"max_bytes": max_bytes, "chunk_words": 1 << 14, "tamper": tamper},
                    accelerator="cpu")
    return as_gpus(out)


def test_healthy_memory_passes():
    from dsconform.checks import sdc
    results, ids = hbm()
    assert sdc.hbm_problems(results, ids, 0.8) == []
    assert all(r["tested_bytes"] == 1 << 20 for r in results)


@pytest.mark.parametrize("pattern", ["random-1", "walking-ones-31"])
def test_a_word_that_reads_back_wrong_fails_naming_the_gpu_and_offset(pattern):
    from dsconform.checks import sdc
    results, ids = hbm({"rank": 1, "pattern": pattern, "word": 1000})
    [line] = sdc.hbm_problems(results, ids, 0.8)
    assert line.startswith(f"GPU 1 (PCI 0000:2a:00.0, rank 1), serial 1654922005678: "
                           f"{pattern}: 1 of 262144 words read back wrong: offset 0xfa0 "
                           f"(address 0x"), line
    assert results[0]["patterns"] and all(p["errors"] == 0 for p in results[0]["patterns"])


def test_a_gpu_that_tested_too_little_of_its_memory_fails():
    from dsconform.checks import sdc
    results, ids = hbm()
    results[0] = {**results[0], "free_bytes": 10 << 20}
    [line] = sdc.hbm_problems(results, ids, 0.8)
    assert line.startswith("GPU 0 (PCI 0000:1b:00.0, rank 0), serial 1654922001234: tested "
                           "1048576 bytes, under 80% of the 10485760 bytes free"), line


def test_a_run_records_what_each_gpu_observed_in_a_recordable_form(monkeypatch):
    """The fact the suite records (sdc.observed.PASS) becomes the catalogue entry that then
    holds the same GPU to what it computed."""
    from dsconform.results.records import FactsRecorder

    results, _ = as_gpus(run())
    monkeypatch.setattr(test_sdc, "run_pass", lambda *a, **k: results)
    monkeypatch.setattr(test_sdc, "worker_gpus", lambda: [0, 1])
    monkeypatch.setattr(test_sdc, "_RUNS", {})
    recorded = []
    facts = FactsRecorder("t::t", "sdc", recorded.append)

    class Node:
        class hardware:
            bus_ids = BUS

    class Profile:
        tolerances: dict = {}
    got, ids = test_sdc.pass_results("short", Node(), Profile(), facts)
    [fact] = recorded
    assert fact.name == "sdc.observed.short" and fact.value[1]["gpu"].startswith("GPU 1 (PCI")
    [entry] = known_answers.entries_from_results({"dsconform": {"facts": [
        {"name": fact.name, "value": fact.value}]}})
    answers = {Key(*(entry[f] for f in known_answers.KEY_FIELDS)): entry["hashes"]}
    assert catalogue_check(got, ids, answers) == ([], [])
