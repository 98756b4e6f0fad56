"""The SDC suite's library: the known answers beside the GPU catalogue (validated, looked up by
the exact key, recordable from a run's results), the HBM test's patterns, and the bounds in the
tolerance table."""

from __future__ import annotations

import json
import tomllib

import pytest
import torch

from dsconform import cli
from dsconform.checks.tolerances import TABLE
from dsconform.profile import catalogue, known_answers
from dsconform.profile.known_answers import Key, KnownAnswersError
from dsconform.results.records import Fact, document
from suites import sdc_ranks, test_sdc

H = "ab" * 32
ENTRY = {"model": "h200", "torch": "2.11.0+cu130", "cuda": "13.0", "cublas": "13.1.0",
         "inputs": 1, "hashes": {"gemm.bf16.4096": H, "train.fp32.mlp1024": "cd" * 32}}


def _parse(text: str) -> dict:
    return known_answers.parse(tomllib.loads(text), "f.toml", catalogue.shipped())


def test_the_shipped_file_loads():
    assert isinstance(known_answers.load(), dict)


def test_an_entry_renders_and_parses_back():
    parsed = _parse(known_answers.render(ENTRY, "1xH200, results/reference/x"))
    assert parsed == {Key("h200", "2.11.0+cu130", "13.0", "13.1.0", 1): ENTRY["hashes"]}
    assert known_answers.lookup(ENTRY, parsed) == (ENTRY["hashes"], "")


@pytest.mark.parametrize(("change", "problem"), [
    ({"model": "b300"}, "answers[0].model: 'b300' is no entry of gpu_models.toml"),
    ({"inputs": "1"}, "answers[0].inputs: required"),
    ({"cublas": ""}, "answers[0].cublas: required"),
    ({"hashes": {"gemm.bf16.4096": "xyz"}}, "answers[0].hashes.gemm.bf16.4096: expected 64 hex"),
    ({"hashes": {}}, "answers[0].hashes: required"),
])
def test_a_bad_entry_is_refused_naming_the_field(change, problem):
    with pytest.raises(KnownAnswersError) as e:
        _parse(known_answers.render({**ENTRY, **change}, "s"))
    assert any(p.startswith(f"f.toml: {problem}") for p in e.value.problems), e.value.problems


def test_a_second_entry_for_one_key_is_refused():
    text = known_answers.render(ENTRY, "a") + "\n" + known_answers.render(ENTRY, "b")
    with pytest.raises(KnownAnswersError, match="a second entry for model h200"):
        _parse(text)


def test_another_cublas_is_another_key():
    answers = _parse(known_answers.render(ENTRY, "s"))
    recorded, why = known_answers.lookup({**ENTRY, "cublas": "13.2.0"}, answers)
    assert recorded is None and "cuBLAS 13.2.0" in why and "recorded for this model: model " \
        "h200, torch 2.11.0+cu130, CUDA 13.0, cuBLAS 13.1.0, inputs v1" in why


def _results(tmp_path, values: list[dict]):
    fact = Fact("suites/test_sdc.py::test_repetitions[short]", f"{known_answers.FACT}.short",
                values, "sdc")
    doc = document([], [], machine_info={}, commit_info={}, profile={}, facts=[fact])
    (tmp_path / "benchmarks.json").write_text(json.dumps(doc))
    return tmp_path


def test_a_run_s_observed_hashes_become_an_entry(tmp_path, monkeypatch, capsys):
    gpus = [{**ENTRY, "gpu": "GPU 0"}, {**ENTRY, "gpu": "GPU 1"}]
    target = tmp_path / "known_answers.toml"
    target.write_text("")
    monkeypatch.setattr(known_answers, "ANSWERS_FILE", target)
    results = _results(tmp_path, gpus)
    assert cli.main(["known-answers", str(results)]) == 0
    printed = capsys.readouterr().out
    assert _parse(printed.replace("FILL IN: node and results folder", "x")) == {
        Key("h200", "2.11.0+cu130", "13.0", "13.1.0", 1): ENTRY["hashes"]}
    assert target.read_text() == ""  # printed only
    assert cli.main(["known-answers", str(results), "--write"]) == 2  # --write needs --source
    assert cli.main(["known-answers", str(results), "--write", "--source", "1xH200, run X"]) == 0
    assert len(known_answers.load(target)) == 1


def test_gpus_that_disagree_are_not_recordable(tmp_path, capsys):
    other = {**ENTRY, "hashes": {**ENTRY["hashes"], "gemm.bf16.4096": "ef" * 32}}
    assert cli.main(["known-answers", str(_results(tmp_path, [ENTRY, other]))]) == 2
    assert "gemm.bf16.4096: the run's GPUs disagree" in capsys.readouterr().err


def test_every_kernel_has_a_reference_bound_with_its_reason():
    for kind, tol in test_sdc.reference_tols().items():
        family, dtype = kind.split(".")
        assert TABLE[("sdc_reference", dtype, family)]["cuda"] is tol
        assert len(tol.why) > 80, (kind, tol.why)


def _pattern(name: str, start: int = 0, n: int = 4096) -> torch.Tensor:
    return sdc_ranks._pattern(name, torch.arange(start, start + n, dtype=torch.int64))


def test_walking_ones_set_every_bit_of_every_word_once_over_32_passes():
    words = torch.stack([_pattern(f"walking-ones-{p}") for p in range(32)]).view(torch.int32)
    bits = (words.to(torch.int64) & 0xFFFFFFFF)
    assert all(bin(int(v)).count("1") == 1 for v in bits.flatten()[:5000])
    combined = bits[0]
    for row in bits[1:]:
        combined = combined | row
    assert bool((combined == 0xFFFFFFFF).all())
    assert bool((bits[0][:-1] != bits[0][1:]).all())  # neighbours differ


def test_address_patterns_differ_across_the_memory_and_invert():
    plain, inverted = _pattern("address-plain"), _pattern("address-inverted")
    assert bool((plain ^ inverted == -1).all())
    assert len(set(plain.tolist())) == 4096
    far = _pattern("address-plain", start=1 << 30)  # 4 GiB further on
    assert not bool((far == plain).all())


def test_random_patterns_are_fixed_by_their_seed():
    assert bool((_pattern("random-1") == _pattern("random-1")).all())
    assert float((_pattern("random-1") == _pattern("random-2")).float().mean()) < 0.01
    assert len(set(_pattern("random-1").tolist())) > 4000


def test_a_walking_ones_chunk_is_the_pattern_at_every_chunk():
    """The HBM test writes one precomputed chunk of walking ones everywhere: it MUST be the
    pattern each chunk's own addresses give."""
    local = torch.arange(1 << 10, dtype=torch.int64)
    for name in ("walking-ones-0", "walking-ones-13"):
        same = sdc_ranks._repeating(name, local)
        assert same is not None
        for start in (0, 1 << 10, 5 << 20):
            got = sdc_ranks._expected(name, local, same, start, start + 1000)
            assert bool((got == _pattern(name, start, 1000)).all()), (name, start)
    assert sdc_ranks._repeating("random-1", local) is None
    assert sdc_ranks._repeating("walking-ones-0", local[:1000]) is None  # not a multiple of 32
