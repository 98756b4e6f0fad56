"""The collectives suite's library logic, without ranks: exact data and its expected results,
the mismatch finder, bus factors and sweep sizes, GPU identity, straggler arithmetic, NCCL
settings, nccl-tests parsing, the profile fields, and the header/machine_info lines.

The red tests on real gloo collectives are in tests/suites/test_collectives_red.py.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsconform.checks import collectives
from dsconform.checks.collectives import GIB, MIB
from dsconform.node import gpu_health, nccl_env, nccl_tests
from dsconform.profile import schema as profile

# ------------------------------------------------------------------ exact data


def _simulate(collective: str, n: int, numel: int) -> None:
    """Every rank's expected output equals what the collective does to all ranks' inputs,
    computed independently here from the inputs alone."""
    cases = [collectives.exact_case(collective, r, n, numel) for r in range(n)]
    inputs = [c.input for c in cases]
    for r, case in enumerate(cases):
        if collective == "all_reduce":
            want = sum(inputs)
        elif collective == "broadcast":
            want = inputs[case.src]
        elif collective == "all_gather":
            want = torch.cat(inputs)
        elif collective == "reduce_scatter":
            part = inputs[0].numel() // n
            want = sum(inputs)[r * part:(r + 1) * part]
        else:
            assert [c.input_splits[r] for c in cases] == case.output_splits
            want = torch.cat([torch.split(inputs[src], cases[src].input_splits)[r]
                              for src in range(n)])
        assert torch.equal(case.expected, want), (collective, n, numel, r)


@given(collective=st.sampled_from(collectives.COLLECTIVES), n=st.integers(2, 8),
       numel=st.one_of(st.sampled_from([1, 2, 53]), st.integers(1, 300)))
def test_expected_output_is_what_the_collective_does_to_the_inputs(collective, n, numel):
    _simulate(collective, n, numel)


_TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# The other dtypes a collective of each dtype could be carried in and lose data: narrower in
# precision (fp32 in bf16 / fp16 / a tf32-like 11-bit mantissa, which fp16 rounding is for
# fp32's data range; fp16 in bf16) or in range (bf16 in fp16).
_OTHERS = {"fp32": ("bf16", "fp16"), "fp16": ("bf16",), "bf16": ("fp16",)}
_BITS = {"bf16": 8, "fp16": 11, "fp32": 24}


def _kept(values: torch.Tensor, dtype: str) -> torch.Tensor:
    """Which float64 ``values`` survive a round trip through ``dtype`` unchanged."""
    return values.to(_TORCH[dtype]).double().eq(values)


@pytest.mark.parametrize("dtype", collectives.DTYPES)
@pytest.mark.parametrize("collective", collectives.COLLECTIVES)
@pytest.mark.parametrize("n", [1, 2, 3, 8, 64])
def test_data_is_exact_in_its_dtype_and_in_no_other(collective, n, dtype):
    """Inputs, expected outputs and every partial sum are exact in the dtype (any order: the
    magnitudes of all inputs add up to less than 2**M units); every value a rank receives is
    not exact in any other dtype the collective could be carried in, and neither is, at every
    position, the input of the rank that carries the precision: casting the inputs or the
    output down changes every element."""
    numel = 997
    cases = [collectives.exact_case(collective, r, n, numel, dtype=dtype) for r in range(n)]
    limit = (1 << _BITS[dtype]) - 1
    reduces = collective in ("all_reduce", "reduce_scatter")
    if reduces:  # any partial sum, in any order
        total = sum(c.input.abs() for c in cases)
        assert int(total.max()) <= limit
    for c in cases:
        assert int(c.input.abs().max()) <= limit and int(c.expected.abs().max()) <= limit
        for t in (c.input, c.expected):
            assert _kept(c.as_float(t, torch.float64), dtype).all()
    carriers = [cases[0]] if reduces else cases
    for c in cases:
        received = c.as_float(c.expected, torch.float64)
        nonzero = received.ne(0)
        # zeros only where ZeRO pads the flat buffer
        padded = -(-numel // n) * n - numel if collective in ("all_gather",
                                                               "reduce_scatter") else 0
        assert int((~nonzero).sum()) <= padded
        for other in _OTHERS[dtype]:
            assert not _kept(received[nonzero], other).any(), (other, c.layout)
    for c in carriers:
        sent = c.as_float(c.input, torch.float64)
        nonzero = sent.ne(0)
        assert int((~nonzero).sum()) <= (-(-numel // n) * n - numel)
        for other in _OTHERS[dtype]:
            assert not _kept(sent[nonzero], other).any(), (other, c.layout)


def test_position_and_rank_change_the_values():
    """An output from the wrong rank or in the wrong order must not look right."""
    a0 = collectives.exact_case("all_gather", 0, 2, 53)
    a1 = collectives.exact_case("all_gather", 1, 2, 53)
    assert not torch.equal(a0.input, a1.input[:a0.input.numel()])
    b = [collectives.exact_case("broadcast", r, 2, 53) for r in range(2)]
    assert not torch.equal(b[0].input, b[1].input)  # a no-op broadcast fails on rank 0
    assert len(set(collectives.exact_case("all_reduce", 0, 2, 53).expected.tolist())) > 5


def test_sizes_not_a_multiple_of_the_world_size_are_laid_out_like_zero():
    case = collectives.exact_case("all_gather", 1, 2, 53)
    assert case.layout == "53 elements padded to 54 (27 per rank)"
    assert case.expected[53:].eq(0).all() and case.input.numel() == 27
    rs = collectives.exact_case("reduce_scatter", 1, 2, 53)
    assert rs.input.numel() == 54 and rs.expected.numel() == 27 and rs.expected[-1] == 0
    for n in (2, 3, 4, 8):
        for r in range(n):
            splits = collectives.exact_case("all_to_all", r, n, 53).input_splits
            assert len(set(splits)) > 1 and sum(splits) % n, (n, r, splits)


def test_find_mismatch_names_first_wrong_element():
    expected = torch.arange(10, dtype=torch.bfloat16)
    assert collectives.find_mismatch(expected.clone(), expected) is None
    found = expected.clone()
    found[3] += 1
    found[7] = float("nan")
    assert collectives.find_mismatch(found, expected) == (3, 3.0, 4.0, 2)
    with pytest.raises(ValueError, match="shape"):
        collectives.find_mismatch(found[:5], expected)


def test_wrong_output_message_names_each_wrong_rank():
    assert collectives.wrong_output_message("all_gather", MIB, [0, 0], ["a", "b"]) == ""
    assert collectives.wrong_output_message("all_gather", MIB, [0, 7], ["GPU 0", "GPU 1"]) == (
        f"all_gather at {MIB} bytes returned wrong values after the timed calls (input rank + "
        f"1 on every rank): GPU 1: 7 elements")


def test_exactness_message_lists_every_mismatch():
    m = collectives.Mismatch("all_gather", "bf16", 53, 1, 17, 4.0, 5.0, 1, 54,
                             "53 elements padded to 54 (27 per rank)", "rank 1 (cpu)")
    text = collectives.exactness_message([m, m])
    assert text.startswith("2 collective output(s) differ from the exact result:")
    assert ("all_gather bf16 numel=53 (53 elements padded to 54 (27 per rank)): rank 1 on rank "
            "1 (cpu): element 17 is 5, expected 4 (1 of 54 elements wrong)") in text
    assert collectives.exactness_message([]) == ""


# ------------------------------------------------------------------ bandwidth naming and sizes

def test_bus_factors_are_nccl_tests():
    assert collectives.bus_factor("all_reduce", 8) == 2 * 7 / 8
    for c in ("all_gather", "reduce_scatter", "all_to_all"):
        assert collectives.bus_factor(c, 4) == 3 / 4
    assert collectives.bus_factor("broadcast", 8) == 1.0
    with pytest.raises(ValueError, match="unknown collective"):
        collectives.bus_factor("allreduce", 2)


def test_cuda_iterations_are_the_rule_the_floors_were_measured_with():
    # The suite's former _iters: max(5, min(200, int(2e10 // nbytes))).
    for nbytes in (MIB, 64 * MIB, GIB, 4 * GIB, 16 * GIB):
        assert collectives.iterations(nbytes, "cuda") == max(5, min(200, int(2e10 // nbytes)))
    assert collectives.iterations(MIB, "cpu") == 20 and collectives.iterations(64 * MIB,
                                                                              "cpu") == 3


def test_sweeps_span_1_mib_to_the_largest_floor_and_the_acceptance_tier_is_smaller():
    floors = [profile.NcclFloor("all_reduce", 4 * GIB, 310.0),
              profile.NcclFloor("all_gather", GIB, 235.0)]
    top = collectives.sweep_top(floors, "cuda")
    assert top == 4 * GIB and collectives.sweep_top([], "cuda") == 4 * GIB
    assert collectives.sweep_top(floors, "cpu") == 64 * MIB
    for c in collectives.COLLECTIVES:
        for accel in ("cuda", "cpu"):
            t = collectives.sweep_top(floors, accel)
            full = collectives.sweep_sizes(c, t, accelerator=accel, full=True)
            small = collectives.sweep_sizes(c, t, accelerator=accel, full=False)
            assert full[0] == MIB and full[-1] == t and list(full) == sorted(full)
            assert set(small) < set(full) and small[0] == MIB
    assert collectives.sweep_sizes("all_reduce", 4 * GIB, accelerator="cuda", full=True) == (
        MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB, GIB, 4 * GIB)
    assert collectives.sweep_sizes("all_reduce", 3 * GIB, accelerator="cuda", full=True)[-1] \
        == 3 * GIB  # a floor size off the 4x ladder is still the end point


# ------------------------------------------------------------------ identity and stragglers

@pytest.mark.parametrize("text, canonical", [
    ("00000000:2A:00.0", "0000:2a:00.0"), ("0000:2a:00.0", "0000:2a:00.0"),
    ("0000:2a:00", "0000:2a:00.0"), ("2a:00.0", "0000:2a:00.0"), ("0001:c1:1f.3", "0001:c1:1f.3"),
    ("", None), (None, None), ("GPU-1234", None)])
def test_bus_ids_in_every_spelling_map_to_one(text, canonical):
    assert gpu_health.canonical_bus_id(text) == canonical


def test_identity_maps_torch_order_to_nvml_index_by_bus_id():
    # torch's cuda:0 is NVML's GPU 1 here (CUDA_DEVICE_ORDER=FASTEST_FIRST, or a reordered
    # CUDA_VISIBLE_DEVICES): the bus id decides, not the index.
    nvml = ["00000000:18:00.0", "00000000:2A:00.0"]
    ids = gpu_health.identify([
        {"rank": 0, "device": "cuda:0", "bus_id": "0000:2a:00.0", "visible": "1"},
        {"rank": 1, "device": "cuda:1", "bus_id": "0000:18:00.0", "visible": "0"},
        {"rank": 2, "device": "cuda:2", "bus_id": "0000:99:00.0", "visible": "2"},
        {"rank": 3, "device": "cpu", "bus_id": None}], nvml)
    assert [i.gpu for i in ids] == [1, 0, None, None]
    assert ids[0].label == "GPU 1 (PCI 0000:2a:00.0, rank 0)"
    assert ids[2].label == "GPU cuda:2 (PCI 0000:99:00.0, rank 2)"
    assert ids[3].label == "rank 3 (cpu)"
    assert ids[0].params("src_") == {"src_rank": 0, "src_gpu": 1, "src_bus_id": "0000:2a:00.0",
                                     "src_device": "cuda:0"}


def test_waited_for_names_the_late_rank():
    # Rank 2 arrives 6 ms late to a 10 ms call: the others sit inside the call 6 ms longer.
    pct = gpu_health.waited_for_pct([0.009, 0.0091, 0.003, 0.009], job_seconds=0.010)
    assert pct[2] == pytest.approx(60.0)
    assert max(pct[:2] + pct[3:]) < 1.0
    with pytest.raises(ValueError):
        gpu_health.waited_for_pct([0.1], 0.1)


def test_peer_median_compares_two_gpus_with_each_other():
    assert gpu_health.pct_of_peer_median([100.0, 80.0]) == [125.0, 80.0]
    assert gpu_health.pct_of_peer_median([10, 10, 10, 5])[3] == 50.0
    with pytest.raises(ValueError):
        gpu_health.pct_of_peer_median([1.0])


def test_straggler_threshold_comes_from_the_profile_else_the_default():
    assert gpu_health.straggler_pct(None) == gpu_health.DEFAULT_STRAGGLER_PCT
    assert gpu_health.straggler_pct(7) == 7.0
    assert gpu_health.matmul_flops(8192, 8192, 8192) == 2 * 8192 ** 3


# ------------------------------------------------------------------ NCCL settings

def test_nccl_settings_environment_then_conf_files(tmp_path):
    user, system = tmp_path / "user.conf", tmp_path / "etc.conf"
    user.write_text("NCCL_IB_HCA=mlx5_0  # HCAs\nNCCL_ALGO=Tree\n")
    system.write_text("NCCL_SOCKET_IFNAME=eth0\nNCCL_IB_HCA=mlx5_9\nNCCL_DEBUG=INFO\n")
    env = {"NCCL_ALGO": "Ring", "NCCL_NVLS_ENABLE": "0", "NCCL_DEBUG": "WARN",
           "TORCH_NCCL_BLOCKING_WAIT": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1", "HOME": "/x",
           "PATH": "/bin"}
    found = {s.name: (s.value, s.source) for s in nccl_env.nccl_settings(env, [user, system])}
    assert found == {
        "NCCL_ALGO": ("Ring", "environment"),  # the environment wins over the files
        "NCCL_NVLS_ENABLE": ("0", "environment"),
        "TORCH_NCCL_BLOCKING_WAIT": ("1", "environment"),
        "CUDA_DEVICE_MAX_CONNECTIONS": ("1", "environment"),
        "NCCL_IB_HCA": ("mlx5_0", str(user)),  # the user file before /etc/nccl.conf
        "NCCL_SOCKET_IFNAME": ("eth0", str(system)),
    }  # NCCL_DEBUG only changes logging: not shown
    line = nccl_env.header_line(nccl_env.nccl_settings(env, [user, system]))
    assert line.startswith("NCCL settings: CUDA_DEVICE_MAX_CONNECTIONS=1, NCCL_ALGO=Ring, ")
    assert f"NCCL_IB_HCA=mlx5_0 [{user}]" in line
    assert nccl_env.header_line([]) == "NCCL settings: none set (NCCL's defaults)"


def test_nccl_conf_file_variable_replaces_the_user_file():
    files = nccl_env.conf_files({"NCCL_CONF_FILE": "/opt/nccl.conf", "HOME": "/h"})
    assert files == [Path("/opt/nccl.conf"), Path("/etc/nccl.conf")]
    assert nccl_env.conf_files({"HOME": "/h"})[0] == Path("/h/.nccl.conf")


# ------------------------------------------------------------------ nccl-tests

_ROWS = [  # size count type redop root | out-of-place time algbw busbw #wrong | in-place ...
    "1073741824 268435456 float sum -1 6466.0 166.06 332.12 0 6460.3 166.21 332.42 0",
    "1073741824 268435456 float sum -1 6470.1 165.95 331.90 0 6461.0 166.19 332.38 0",
    "1073741824 268435456 float sum -1 6480.9 165.68 331.35 2 6462.2 166.16 332.32 N/A",
]
# all_reduce_perf's output as it prints it (src/util.cu), fields padded to its column widths.
TABLE = "\n".join([
    "# nccl-tests version 2.17.6 nccl-headers=22803 nccl-library=22803",
    "# nThread 1 nGpus 2 minBytes 1073741824 maxBytes 1073741824 step: 2(factor)",
    "# Using devices",
    "#  Rank  0 Group  0 Pid  12345 on       node device  0 [0000:18:00] NVIDIA H200",
    "#  Rank  1 Group  0 Pid  12345 on       node device  1 [0000:2a:00] NVIDIA H200",
    "#       size         count      type   redop    root     time   algbw   busbw #wrong ...",
    *("  " + "  ".join(f"{f:>7}" for f in row.split()) for row in _ROWS),
    "# Out of bounds values : 0 OK",
    "# Avg bus bandwidth    : 331.8",
]) + "\n"


def test_parse_reads_out_of_place_rows():
    rows = nccl_tests.parse(TABLE)
    assert len(rows) == 3
    assert rows[0] == nccl_tests.Row(1073741824, "float", "sum", pytest.approx(6466.0e-6),
                                     166.06, 332.12, 0)
    assert [r.wrong for r in rows] == [0, 0, 2]
    assert nccl_tests.parse(TABLE.replace(" 0   6460.3", " N/A   6460.3"))[0].wrong == 0


def test_parse_counts_the_in_place_run_wrong_elements_too():
    in_place_wrong = TABLE.replace("332.42        0", "332.42        5")
    assert in_place_wrong != TABLE
    assert [r.wrong for r in nccl_tests.parse(in_place_wrong)] == [5, 0, 2]
    unchecked = TABLE.replace(" 0   6460.3", " N/A   6460.3").replace("332.42        0",
                                                                       "332.42      N/A")
    assert nccl_tests.parse(unchecked)[0].wrong is None


def _fake_perf(tmp_path: Path, body: str) -> str:
    exe = tmp_path / "all_reduce_perf"
    exe.write_text(f"#!{sys.executable}\n" + body)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return str(exe)


# A stand-in for all_reduce_perf: logs its argv, prints one row per size of its 2x ladder and
# cycle, the way the real one does.
LADDER = """
import os, sys
args = sys.argv[1:]
opt = dict(zip(args[::2], args[1::2]))
with open({log!r}, "a") as f:
    f.write(os.environ.get("CUDA_VISIBLE_DEVICES", "") + " " + " ".join(args) + "\\n")
size = int(opt["-b"])
while size <= int(opt["-e"]):
    for _ in range(int(opt["-N"])):
        print(f"  {{size}}  {{size // 4}}  float  sum  -1  100.0  1.00  2.00  0  99.0  1.0  2.0 0")
    size *= 2
"""


def test_run_passes_gpus_and_sizes_and_reads_rows(tmp_path):
    log = tmp_path / "argv"
    exe = _fake_perf(tmp_path, LADDER.format(log=str(log)))
    found, commands = nccl_tests.run(exe, [1 << 30, 64 << 20, 4 << 30], ["3", "5"], iters=20,
                                     timeout_s=30)
    assert sorted(found) == [64 << 20, 1 << 30, 4 << 30]
    assert all(len(rows) == 3 and rows[0].busbw_gbps == 2.0 for rows in found.values())
    [argv] = [line.split() for line in log.read_text().splitlines()]  # one start-up
    assert argv[0] == "3,5" and argv[argv.index("-g") + 1] == "2"
    assert (argv[argv.index("-b") + 1], argv[argv.index("-e") + 1]) == (str(64 << 20),
                                                                         str(4 << 30))
    assert argv[argv.index("-n") + 1] == "20" and argv[argv.index("-N") + 1] == "3"
    assert commands[0].startswith("CUDA_VISIBLE_DEVICES=3,5 ")


def test_run_measures_a_size_off_the_ladder_on_its_own(tmp_path):
    log = tmp_path / "argv"
    exe = _fake_perf(tmp_path, LADDER.format(log=str(log)))
    found, commands = nccl_tests.run(exe, [1024, 3000], ["0", "1"], iters=5, timeout_s=30)
    assert len(found[3000]) == 3 and len(commands) == 2
    assert [line.split()[2] for line in log.read_text().splitlines()] == ["1024", "3000"]


@pytest.mark.parametrize("body, message", [
    ("print('NCCL failure common.cu:1 invalid usage'); raise SystemExit(3)", "exit code 3"),
    ("print('# nothing measured')", "no result rows in its output"),
])
def test_run_failures_name_the_command_and_output(tmp_path, body, message):
    exe = _fake_perf(tmp_path, body + "\n")
    with pytest.raises(nccl_tests.NcclTestsError, match=message) as err:
        nccl_tests.run(exe, [1024], ["0", "1"], iters=5, timeout_s=30)
    assert "all_reduce_perf -b 1024 -e 1024" in str(err.value)


def test_find_uses_path(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert nccl_tests.find() is None
    _fake_perf(tmp_path, "pass\n")
    assert nccl_tests.find() == str(tmp_path / "all_reduce_perf")


# ------------------------------------------------------------------ profile fields

GPU2 = "[profile]\nname = 't'\n[gpus]\ncount = 2\n"


@pytest.mark.parametrize("extra, field, reason", [
    ("straggler_pct = 0", "gpus.straggler_pct", "percentage"),
    ("straggler_pct = 100", "gpus.straggler_pct", "percentage"),
    ("straggler_pct = '10%'", "gpus.straggler_pct", "expected number"),
    ("matmul_bf16_tflops = 0", "gpus.matmul_bf16_tflops", "must be > 0"),
    ("matmul_fp16_tflops = true", "gpus.matmul_fp16_tflops", "expected number"),
])
def test_profile_health_fields_are_validated(extra, field, reason):
    problems = profile.validate_data(profile.tomllib.loads(GPU2 + extra), "p.toml")
    assert any(f"p.toml: {field}:" in p and reason in p for p in problems), problems


def test_profile_health_fields_load():
    p = profile.from_data(profile.tomllib.loads(
        GPU2 + "straggler_pct = 12.5\nmatmul_bf16_tflops = 600\nmatmul_fp16_tflops = 610\n"), "x")
    assert (p.straggler_pct, p.matmul_bf16_tflops, p.matmul_fp16_tflops) == (12.5, 600, 610)
    cpu = "[profile]\nname = 'c'\n[gpus]\ncount = 0\n"
    problems = profile.validate_data(profile.tomllib.loads(cpu + "matmul_bf16_tflops = 1"), "c")
    assert any("gpus.matmul_bf16_tflops: makes no sense with gpus.count = 0" in p
               for p in problems)
    # CPU ranks are held to each other too.
    assert not profile.validate_data(profile.tomllib.loads(cpu + "straggler_pct = 40"), "c")


# ------------------------------------------------------------------ header and machine_info

def test_header_and_machine_info_show_nccl_settings(pytester, tmp_path, monkeypatch):
    pytester.makepyfile(test_one="def test_one():\n    pass\n")
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    monkeypatch.setenv("NCCL_IB_HCA", "mlx5_0,mlx5_1")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.delenv("NCCL_CONF_FILE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.nccl.conf of the machine's
    prof = tmp_path / "p0.toml"
    prof.write_text('[profile]\nname = "p0"\n[gpus]\ncount = 0\n')
    result = pytester.runpytest("-p", "fixtures.plugin", "--profile", str(prof),
                                "--results", str(pytester.path / "results"))
    result.stdout.fnmatch_lines(["dsconform NCCL settings: *NCCL_ALGO=Ring, "
                                 "NCCL_IB_HCA=mlx5_0,mlx5_1*"])
    assert "NCCL_DEBUG" not in result.stdout.str()
    doc = json.loads((pytester.path / "results" / "benchmarks.json").read_text())
    settings = doc["machine_info"]["nccl_settings"]
    assert settings["NCCL_ALGO"] == {"value": "Ring", "source": "environment"}
    assert settings["NCCL_IB_HCA"]["value"] == "mlx5_0,mlx5_1"
    assert "NCCL_DEBUG" not in settings
    assert os.environ["NCCL_ALGO"] == "Ring"  # (monkeypatch restores it afterwards)


def test_waits_are_held_to_the_threshold_only_where_a_call_is_long_enough():
    """Microseconds of launch jitter on a 40 us call are recorded, not failed; the same share
    of a 1 ms call fails, naming the rank."""
    from dsconform.results.records import MetricsRecorder
    from suites.test_collectives import record_point

    ids = gpu_health.identify([{"rank": 0, "device": "cpu"}, {"rank": 1, "device": "cpu"}])
    for per_call, held in ((4e-5, False), (1e-3, True)):
        point = {"bytes": MIB, "seconds": [per_call] * 3,
                 "inside": [[per_call] * 3, [per_call * 0.2] * 3],  # rank 1 arrives late
                 "wrong": [0, 0], "wrong_ds": [0, 0]}
        metrics = MetricsRecorder("t", "collectives", lambda m: None)
        record_point(metrics, "all_reduce", point, ids, 20.0, bytes=MIB)
        waits = [m for m in metrics.recorded if m.name == "all_reduce.waited_for_pct"]
        assert len(waits) == 2 and waits[1].value == pytest.approx(80.0)
        assert [v.split(" =")[0] for v in metrics.violations()] == (
            ["all_reduce.waited_for_pct"] if held else [])


def test_launch_skew_on_a_call_just_over_the_minimum_is_not_a_straggler():
    """A host-bound 1 MiB all_reduce of 103 us on healthy 2xH200 GPUs, one rank waiting 12 us
    each round (12%): recorded, not failed; a 3.3 ms call whose rank waits 12% fails."""
    from dsconform.results.records import MetricsRecorder
    from suites.test_collectives import record_point

    ids = gpu_health.identify([{"rank": 0, "device": "cpu"}, {"rank": 1, "device": "cpu"}])
    for per_call, held in ((1.03e-4, False), (3.3e-3, True)):
        point = {"bytes": MIB, "seconds": [per_call] * 3,
                 "inside": [[per_call] * 3, [per_call * 0.88] * 3],
                 "wrong": [0, 0], "wrong_ds": [0, 0]}
        metrics = MetricsRecorder("t", "collectives", lambda m: None)
        record_point(metrics, "all_reduce", point, ids, 10.0, bytes=MIB)
        assert [v.split(" =")[0] for v in metrics.violations()] == (
            ["all_reduce.waited_for_pct"] if held else [])
