"""The GPU model catalogue MUST ship the models fleets run, every floor with its source, and be
validated as strictly as a profile; a profile naming an entry takes its floors."""

from __future__ import annotations

import subprocess
import sys
import tomllib

import pytest

from dsconform.profile import catalogue, schema

MODELS = {  # device names as NVML and torch report them -> the entry they must find
    "NVIDIA H200": "h200",
    "NVIDIA H100 80GB HBM3": "h100-sxm",
    "NVIDIA H100 PCIe": "h100-pcie",
    "NVIDIA H100 NVL": "h100-nvl",
    "NVIDIA A100-SXM4-80GB": "a100-sxm-80gb",
    "NVIDIA A100-SXM4-40GB": "a100-40gb",
    "NVIDIA A100-PCIE-40GB": "a100-40gb",
    "NVIDIA B200": "b200",
    "NVIDIA L40S": "l40s",
}


def _data() -> dict:
    return tomllib.loads(catalogue.CATALOGUE_FILE.read_text())


@pytest.mark.parametrize(("device", "key"), sorted(MODELS.items()))
def test_each_model_fleets_run_has_its_entry(device, key):
    model = catalogue.find([device])
    assert model is not None and model.key == key, device


def test_every_entry_has_every_floor_with_a_source():
    for model in catalogue.shipped().values():
        assert set(model.floors) == set(catalogue.FLOOR_FIELDS), model.key
        for name, floor in model.floors.items():
            assert floor.value > 0 and ("measured" in floor.source or "datasheet" in floor.source
                                        or "PCIe" in floor.source), (model.key, name)


def test_unknown_and_mixed_models_find_nothing():
    assert catalogue.find(["NVIDIA H200 NVL"]) is None  # excluded: a 600 W part
    assert catalogue.find(["Tesla T4"]) is None
    assert catalogue.find(["NVIDIA H200", "NVIDIA H100 80GB HBM3"]) is None
    assert catalogue.find([]) is None


@pytest.mark.parametrize(("edit", "problem"), [
    (lambda d: d["models"]["h200"]["hbm_gbps"].pop("source"),
     "models.h200.hbm_gbps.source: required"),
    (lambda d: d["models"]["h200"]["h2d_gbps"].update(floor=0), "models.h200.h2d_gbps.floor"),
    (lambda d: d["models"]["l40s"].update(pcie="PCIe 4"), "models.l40s.pcie: expected 'GenN xW'"),
    (lambda d: d["models"]["b200"].update(tflops=1), "models.b200.tflops: unknown field"),
    (lambda d: d["models"]["b200"].pop("match"), "models.b200.match: required"),
    (lambda d: d["models"]["b200"].update(bf16="yes"), "models.b200.bf16: expected bool"),
])
def test_a_broken_entry_is_refused_naming_the_field(edit, problem):
    data = _data()
    edit(data)
    with pytest.raises(catalogue.CatalogueError) as e:
        catalogue.parse(data, "cat.toml")
    assert any(problem in p for p in e.value.problems), e.value.problems


def _profile(gpus: str) -> str:
    return f'[profile]\nname = "x"\n[gpus]\ncount = 2\nmodel = "NVIDIA H200"\n{gpus}'


def test_a_profile_naming_an_entry_takes_its_floors_and_keeps_its_own(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text(_profile('catalogue = "h200"\nmatmul_bf16_tflops = 650\n'))
    p = schema.load(path)
    h200 = catalogue.shipped()["h200"]
    assert p.matmul_bf16_tflops == 650  # measured on the node type: it wins
    assert (p.matmul_fp16_tflops, p.hbm_gbps, p.h2d_gbps, p.d2h_gbps) == (
        h200.floor("matmul_fp16_tflops"), h200.floor("hbm_gbps"), h200.floor("h2d_gbps"),
        h200.floor("d2h_gbps"))
    path.write_text(_profile('catalogue = "h300"\n'))
    with pytest.raises(schema.ProfileError, match=r"gpus.catalogue: no such entry .*h200"):
        schema.load(path)


def test_validate_accepts_the_catalogue_and_refuses_a_broken_one(tmp_path):
    ok = subprocess.run([sys.executable, "-m", "dsconform.cli", "validate",
                         str(catalogue.CATALOGUE_FILE)], capture_output=True, text=True)
    assert ok.returncode == 0 and "valid GPU catalogue (8 models" in ok.stdout, ok.stderr
    bad = tmp_path / "cat.toml"
    bad.write_text(catalogue.CATALOGUE_FILE.read_text().replace("floor = 3600, ", ""))
    out = subprocess.run([sys.executable, "-m", "dsconform.cli", "validate", str(bad)],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "models.h200.hbm_gbps.floor" in out.stderr, out.stderr
