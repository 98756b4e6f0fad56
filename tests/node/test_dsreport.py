"""ds_report as data: parse_ds_report on real captured outputs, and run_ds_report on this machine.

Every `*.txt` directly under tests/data/ds_report/ is a real ds_report output (README.md there says
how each was produced); each is parsed by the generic tests, and the files listed in EXPECTED are
also checked against what is known about them.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
from pathlib import Path

import pytest

from dsconform.node.dsreport import parse_ds_report, run_ds_report, shm_bytes, strip_ansi

DATA = Path(__file__).parents[1] / "data" / "ds_report"
CAPTURES = sorted(DATA.glob("*.txt"))

CPU_OPS_0198 = ["deepspeed_not_implemented", "async_io", "deepspeed_ccl_comm", "deepspeed_shm_comm",
                "cpu_adagrad", "cpu_adam", "cpu_lion", "fused_adam", "pin_memory"]
# 0.19.6's CPU accelerator has no cpu_adagrad / cpu_lion builders.
CPU_OPS_0196 = [op for op in CPU_OPS_0198 if op not in ("cpu_adagrad", "cpu_lion")]
ACCEL_WARNING = ("Setting accelerator to CPU. "
                 "If you have GPU or other accelerator, we were unable to detect it.")
LIBAIO_WARNINGS = [
    "async_io requires the dev libaio .so object and headers but these were not found.",
    "async_io: please install the libaio-dev package with apt",
    "If libaio is already installed (perhaps from source), try setting the CFLAGS and LDFLAGS "
    "environment variables to where it can be found.",
]
CUTLASS_WARNING = ("Unable to locate CUTLASS. Install nvidia-cutlass, clone CUTLASS next to "
                   "DeepSpeed, or set CUTLASS_PATH to the CUTLASS checkout.")
CPU_SHM = {"shm_size_text": "23.54 GB", "shm_size_bytes": round(23.54 * 1024**3)}

EXPECTED = {
    "cpu-0.19.8.txt": {
        "ops": CPU_OPS_0198, "incompatible": [], "op_warnings": {}, "accelerator": "cpu",
        "env": {"deepspeed_version": "0.19.8", "torch_version": "2.13.0+cpu",
                "torch_cuda_version": None,
                "nvcc_version": None, "deepspeed_wheel_compiled": "torch 0.0", **CPU_SHM},
    },
    "cpu-0.19.6.txt": {
        "ops": CPU_OPS_0196, "incompatible": [], "op_warnings": {}, "accelerator": "cpu",
        "env": {"deepspeed_version": "0.19.6", "torch_version": "2.13.0+cpu",
                "deepspeed_install_path": "/tmp/ds0196/lib/python3.11/site-packages/deepspeed",
                **CPU_SHM},
    },
    # 2xH200, TORCH_CUDA_ARCH_LIST=9.0a: async_io, fused_adam, gds all [OKAY] although none of them
    # builds there (tests/data/compare/ops-arch-9.0a): compatible is not loads.
    "h200-0.19.8.txt": {
        "ops": None, "incompatible": ["evoformer_attn"], "accelerator": "cuda",
        "op_warnings": {"evoformer_attn": [CUTLASS_WARNING]}, "warnings": [],
        "env": {"deepspeed_version": "0.19.8", "torch_version": "2.11.0+cu130",
                "torch_cuda_version": "13.0", "nvcc_version": "13.0", "shm_size_text": "256.00 GB"},
    },
    # 0.19.6 still has sparse_attn (removed in 0.19.7), incompatible with torch 2.11.
    "h200-0.19.6.txt": {
        "ops": None, "incompatible": ["evoformer_attn", "fp_quantizer", "sparse_attn"],
        "accelerator": "cuda", "warnings": [], "op_warnings": {
            "evoformer_attn": [CUTLASS_WARNING],
            "fp_quantizer": [
                "FP Quantizer is using an untested triton version (3.6.0), only 2.3.(0, 1) "
                "and 3.0.0 are known to be compatible with these kernels"],
            "sparse_attn": [
                "sparse_attn requires a torch version >= 1.5 and < 2.0 but detected 2.11",
                "using untested triton version (3.6.0), only 1.0.0 is known to be compatible"]},
        "env": {"deepspeed_version": "0.19.6", "torch_version": "2.11.0+cu130",
                "torch_cuda_version": "13.0", "nvcc_version": "13.0"},
    },
    "cpu-0.19.8-no-libaio-dev.txt": {
        "ops": CPU_OPS_0198, "incompatible": ["async_io"],
        "op_warnings": {"async_io": LIBAIO_WARNINGS},
        "accelerator": "cpu", "env": {"deepspeed_version": "0.19.8", **CPU_SHM},
    },
}


def _parsed(path: Path) -> dict:
    return parse_ds_report(path.read_text())


def test_expected_captures_exist() -> None:
    missing = [name for name in EXPECTED if not (DATA / name).is_file()]
    assert not missing, f"captured ds_report outputs missing from {DATA}: {missing}"


@pytest.mark.parametrize("path", CAPTURES, ids=[p.name for p in CAPTURES])
def test_capture_parses_completely(path: Path) -> None:
    report = _parsed(path)
    assert report["ops"], f"{path.name}: no ops parsed"
    for name, op in report["ops"].items():
        assert isinstance(op["installed"], bool) and isinstance(op["compatible"], bool), (name, op)
    assert report["ninja"] in (True, False), f"{path.name}: ninja line not parsed"
    assert report["unparsed"] == [], \
        f"{path.name}: lines the parser does not know: {report['unparsed']}"
    env = report["env"]
    assert env["torch_version"] and env["deepspeed_version"], env
    m = re.search(r"-(\d+\.\d+\.\d+)", path.name)
    if m:  # files are named NODE-DSVERSION[-VARIANT].txt
        assert env["deepspeed_version"] == m[1], f"{path.name} says {env['deepspeed_version']}"
    assert env["shm_size_bytes"] is None or env["shm_size_bytes"] > 0
    if report["accelerator"] == "cuda":
        assert env["torch_cuda_version"] or env["torch_hip_version"], env


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_capture_matches_expectations(name: str) -> None:
    want = EXPECTED[name]
    report = _parsed(DATA / name)
    if want["ops"] is None:  # GPU captures: the ops the suite's GPU profiles promise are listed
        assert {"async_io", "fused_adam", "cpu_adam", "gds"} <= set(report["ops"])
    else:
        assert list(report["ops"]) == want["ops"]
    assert [n for n, op in report["ops"].items() if not op["compatible"]] == want["incompatible"]
    assert not any(op["installed"] for op in report["ops"].values()), "captures are all JIT ops"
    assert {n: op["warnings"] for n, op in report["ops"].items()
            if op["warnings"]} == want["op_warnings"]
    assert report["warnings"] == want.get("warnings", [ACCEL_WARNING]), \
        "only the CPU accelerator fallback is a general warning"
    assert report["accelerator"] == want["accelerator"]
    assert report["ninja"] is True
    for key, value in want["env"].items():
        assert report["env"][key] == value, (key, report["env"][key])


def test_colours_do_not_matter() -> None:
    text = (DATA / "cpu-0.19.8-no-libaio-dev.txt").read_text()
    assert "\x1b[" in text, "the capture is meant to be raw, with colour codes"
    assert parse_ds_report(strip_ansi(text)) == parse_ds_report(text)


def test_env_block_keys_are_snake_cased() -> None:
    env = _parsed(DATA / "cpu-0.19.8.txt")["env"]
    assert env["torch_install_path"].endswith("site-packages/torch")
    assert env["deepspeed_info"] == "0.19.8, unknown, unknown"
    assert (env["deepspeed_git_hash"], env["deepspeed_git_branch"]) == ("unknown", "unknown")
    assert all(re.fullmatch(r"[a-z0-9_]+", key) for key in env), list(env)


@pytest.mark.parametrize("text, expected", [
    ("23.54 GB", round(23.54 * 1024**3)),  # env_report divides by 1024 although it prints "GB"
    ("1.50 KB", 1536), ("512.00 MB", 512 * 1024**2), ("0.00 B", 0), ("UNKNOWN", None),
])
def test_shm_size_is_binary(text: str, expected: int | None) -> None:
    assert shm_bytes(text) == expected


def test_unknown_lines_are_kept_not_fatal() -> None:
    lines = (DATA / "cpu-0.19.8.txt").read_text().splitlines()
    env_at = lines.index("DeepSpeed general environment info:")
    lines.insert(env_at + 1, "something new in a later DeepSpeed")
    lines.insert(2, "a stray line in the preamble")
    report = parse_ds_report("\n".join(lines))
    assert report["unparsed"] == ["a stray line in the preamble",
                                  "something new in a later DeepSpeed"]
    assert list(report["ops"]) == CPU_OPS_0198


def test_probe_output_attaches_to_the_op_it_names() -> None:
    # A probe prints before its op's row; a warning that names another op of the table goes there.
    lines = (DATA / "cpu-0.19.8.txt").read_text().splitlines()
    row = next(i for i, ln in enumerate(lines) if strip_ansi(ln).startswith("fused_adam "))
    lines[row:row] = [" [WARNING]  fused_adam needs a newer compiler",
                      " [WARNING]  cpu_adam shares this kernel"]
    ops = parse_ds_report("\n".join(lines))["ops"]
    assert ops["fused_adam"]["warnings"] == ["fused_adam needs a newer compiler"]
    assert ops["cpu_adam"]["warnings"] == ["cpu_adam shares this kernel"]
    assert ops["cpu_lion"]["warnings"] == []


@pytest.mark.parametrize("text", [
    "", "hello\nworld\n",
    "Traceback (most recent call last):\nModuleNotFoundError: No module named 'deepspeed'",
    # ds_report --hide_operator_status
    (DATA / "no_op_table" / "cpu-0.19.8-hide-operator-status.txt").read_text(),
])
def test_text_without_op_table_is_an_error(text: str) -> None:
    with pytest.raises(ValueError, match="no DeepSpeed op table"):
        parse_ds_report(text)


def test_run_ds_report_here() -> None:
    report = parse_ds_report(run_ds_report(timeout_s=120))
    assert report["env"]["deepspeed_version"] == importlib.metadata.version("deepspeed")
    assert report["env"]["torch_version"] == importlib.metadata.version("torch")
    st = os.statvfs("/dev/shm")
    # printed with two decimals in binary units: within half a hundredth of the unit
    assert abs(report["env"]["shm_size_bytes"] - st.f_frsize * st.f_blocks) <= 0.005 * 1024**3
    assert report["ops"] and report["unparsed"] == []


def test_run_ds_report_finds_the_script_of_a_target_install(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``pip install --target SITE`` puts DeepSpeed's scripts in SITE/bin, while its installed
    files list them at a path that does not exist there: the report is still run, with this
    interpreter, from the script beside the package."""
    from dsconform.node import dsreport

    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "ds_report").write_text("print('the report of SITE/bin')\n")

    class TargetInstall:
        version = "0.0.0"
        files = [Path("../../bin/ds_report")]

        def locate_file(self, path: object) -> Path:
            return tmp_path / str(path)

    monkeypatch.setattr(dsreport.metadata, "distribution", lambda name: TargetInstall())
    monkeypatch.setattr(dsreport.sysconfig, "get_path", lambda name: str(tmp_path / "scripts"))
    assert dsreport.run_ds_report(timeout_s=60).strip() == "the report of SITE/bin"
    (tmp_path / "bin" / "ds_report").unlink()
    with pytest.raises(dsreport.DsReportError, match="ds_report script is not installed"):
        dsreport.run_ds_report(timeout_s=60)
