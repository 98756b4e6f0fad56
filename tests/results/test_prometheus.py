"""dsconform.prom MUST tell Prometheus what the run found: the node's verdict (0 for a failed,
interrupted or unfinished run), tests per capability as summary.json counts them, every rate in
base units beside its floor, the hardware gate's counters, the run's start and end and the
versions; written atomically into --results and --prometheus-textfile DIR, and cluster.prom by
``dsconform aggregate``.

The unit tests build the series from results folders (the 1xH200 reference run of
results/reference/h200-x1/ds-0.19.8, and folders crafted with the plugin's own writers) and
parse them back with prometheus_client's parser. The integration test runs a real CPU-tier run,
a real node_exporter (Debian's prometheus-node-exporter) reading its textfile folder, and
promtool (Debian's prometheus) on the file and on the scrape.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from datetime import datetime
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dsconform.results import aggregate, prometheus, records, summary
from dsconform.results.render import aggregate as aggregate_report

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "results" / "reference" / "h200-x1" / "ds-0.19.8"
BUSBW = "suites/test_collectives.py::test_busbw_floor[all_reduce-1073741824B-8gpu]"
ZERO = "suites/test_zero.py::test_zero_matches_ddp[cuda-z2-off_none-bf16-sgd-gas1-ws8]"
#: The binaries and the Debian packages that ship them.
NODE_EXPORTER = ("prometheus-node-exporter", "prometheus-node-exporter")
PROMTOOL = ("promtool", "prometheus")


# ------------------------------------------------------------------ helpers

def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of an exposition: (name, labels) -> value."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in out, f"duplicate series {key}"  # node_exporter refuses those
            out[key] = s.value
    return out


def value(series: dict, name: str, **labels: str) -> float:
    """The one sample of ``name`` whose labels include ``labels``."""
    found = [v for (n, ls), v in series.items() if n == name and set(labels.items()) <= ls]
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples"
    return found[0]


def exposition(folder: Path) -> str:
    path = prometheus.write_run(folder)[0]
    return path.read_text()


def outcome(nodeid: str, kind: str = "passed", reason: str = "", known: str = "") -> dict:
    cap = "collectives" if "collectives" in nodeid else "zero"
    return {"nodeid": nodeid, "outcome": kind, "capability": cap, "reason": reason,
            "known_issue": known}


def busbw(gbps: float, floor: float | None = 200.0, nodeid: str = BUSBW) -> records.Metric:
    amount = float(1 << 30)
    seconds = [amount / 1e9 / gbps] * 3
    rate = records.Rate(unit="GB/s", amount=amount, scale=1e9, limit=floor)
    return records.Metric(nodeid, "all_reduce.busbw", seconds, "s", "lower", None,
                          {"bytes": 1 << 30, "dtype": "fp32", "world_size": 8,
                           "amount": amount}, "collectives", rate)


def write_node(folder: Path, *, outcomes: list[dict], metrics: list[records.Metric] = (),
               exitstatus: int | None = None, facts: list[records.Fact] = ()) -> Path:
    """A node's --results folder as the plugin writes it (summary.json, benchmarks.json)."""
    folder.mkdir(parents=True, exist_ok=True)
    objs = [records.Outcome(**o) for o in outcomes]
    result = summary.summarize(objs)
    doc = records.document(
        metrics, objs, machine_info={"node": folder.name, "deepspeed": "0.19.8",
                                     "torch": "2.11.0", "dsconform": "0.1.0",
                                     "profile": "h200-x8"},
        commit_info={}, profile={"name": "h200-x8"}, started="2026-11-30T01:00:00+0000",
        facts=facts)
    failed = any(o["outcome"] in summary.FAILED for o in outcomes)
    result.update(profile={"name": "h200-x8"}, node={"hostname": folder.name},
                  exitstatus=(1 if failed else 0) if exitstatus is None else exitstatus,
                  notices=[], rendezvous=None)
    (folder / "benchmarks.json").write_text(json.dumps(doc))
    (folder / "summary.json").write_text(json.dumps(result))
    return folder


# ------------------------------------------------------------------ the reference GPU run

@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("ref") / "h200-x1"
    shutil.copytree(REFERENCE, folder)  # write_run writes beside the results
    return samples(exposition(folder))


def test_reference_run_verdict_and_capabilities_match_its_summary(reference):
    summ = json.loads((REFERENCE / "summary.json").read_text())
    assert value(reference, "dsconform_node_passed") == 1.0
    assert value(reference, "dsconform_run_exit_status", status="passed") == 0.0
    for cap, counts in summ["capabilities"].items():
        expect = {"passed": counts.get("passed", 0), "skipped": counts.get("skipped", 0),
                  "failed": sum(counts.get(k, 0) for k in summary.FAILED),
                  "known": counts.get("xfailed", 0)}
        for column, n in expect.items():
            assert value(reference, "dsconform_capability_tests", capability=cap,
                         outcome=column) == n, (cap, column)
    assert value(reference, "dsconform_capability_tests", capability="zero",
                 outcome="known") == 10


def test_reference_rates_in_base_units_with_gpu_bus_id_and_floor(reference):
    doc = json.loads((REFERENCE / "benchmarks.json").read_text())
    rates = {b["extra_info"]["metric"]: b["extra_info"]["rate"] for b in doc["benchmarks"]
             if b["extra_info"].get("rate") and "fast" not in b["fullname"]}
    hbm = {"metric": "gpu.hbm", "gpu": "0", "bus_id": "0000:00:06.0",
           "size_bytes": "4294967296"}
    assert value(reference, "dsconform_rate_bytes_per_second", **hbm) == \
        pytest.approx(rates["gpu.hbm"]["median"] * 1e9, rel=1e-12)
    assert value(reference, "dsconform_rate_floor_bytes_per_second", **hbm) == 3600e9
    mm = {"metric": "matmul.bf16", "bus_id": "0000:00:06.0", "test": "GPU-MATMUL-1[bf16]"}
    assert value(reference, "dsconform_rate_flop_per_second", **mm) == \
        pytest.approx(rates["matmul.bf16"]["median"] * 1e12, rel=1e-12)
    assert value(reference, "dsconform_rate_floor_flop_per_second", **mm) == 600e12
    assert value(reference, "dsconform_rate_bytes_per_second", metric="checkpoint.save",
                 test="CKPT-PERF-1[cuda-torch-ws1]", dtype="fp32") == \
        pytest.approx(rates["checkpoint.save"]["median"] * 1e9, rel=1e-12)
    # A rate without a floor has no floor series.
    assert not [k for k in reference if k[0] == "dsconform_rate_floor_bytes_per_second"
                and ("metric", "checkpoint.save") in k[1]]
    assert value(reference, "dsconform_rates_below_floor") == 0


def test_reference_health_counters_per_gpu_and_phase(reference):
    gpu = {"gpu": "0", "bus_id": "0000:00:06.0"}
    for when in ("start", "end", "check"):
        assert value(reference, "dsconform_gpu_pcie_link_width", when=when, **gpu) == 16
        assert value(reference, "dsconform_gpu_ecc_errors_total", when=when, kind="uncorrected",
                     scope="aggregate", **gpu) == 0
        assert value(reference, "dsconform_gpu_remap_pending", when=when, **gpu) == 0
        for action in ("ISOLATE", "REBOOT", "RESET", "MONITOR"):
            assert value(reference, "dsconform_health_findings", when=when, action=action) == 0
    # Read at the end, while the run's own ranks were still on the GPU; at the start the run's
    # fork server and first ranks may be up already (how many depends on timing).
    assert value(reference, "dsconform_gpu_compute_processes", when="end", **gpu) == 3
    assert value(reference, "dsconform_gpu_compute_processes", when="start", **gpu) >= 0
    assert value(reference, "dsconform_health_check_exit_code") == 0
    # Retired pages pending is not supported on an H200: no series, never a 0 that was not read.
    assert not [k for k in reference if k[0] == "dsconform_gpu_retired_pages_pending"]


def test_reference_timestamps_and_versions(reference):
    doc = json.loads((REFERENCE / "benchmarks.json").read_text())
    ds, mi = doc["dsconform"], doc["machine_info"]
    assert value(reference, "dsconform_run_start_timestamp_seconds") == \
        datetime.strptime(ds["started"], "%Y-%m-%dT%H:%M:%S%z").timestamp()
    assert value(reference, "dsconform_run_end_timestamp_seconds") == \
        pytest.approx(datetime.fromisoformat(ds["finished"]).timestamp())
    info = [dict(ls) for (n, ls), _ in reference.items() if n == "dsconform_versions_info"]
    assert info == [{"deepspeed": "0.19.8", "torch": "2.11.0", "cuda": "13.0",
                     "nccl": "2.28.9", "driver": "580.159.04", "python": "3.12.3",
                     "dsconform": mi["dsconform"]}]
    assert value(reference, "dsconform_run_info", profile="auto-h200-x1",
                 gpu_model="NVIDIA H200") == 1


# ------------------------------------------------------------------ red cases

def test_a_failed_run_gives_verdict_0_and_counts_the_failure(tmp_path):
    reason = "all_reduce.busbw = 120 GB/s is below its floor 200 GB/s"
    s = samples(exposition(write_node(tmp_path / "n", outcomes=[
        outcome(BUSBW, "failed", reason), outcome(ZERO)], metrics=[busbw(120.0)])))
    assert value(s, "dsconform_node_passed") == 0
    assert value(s, "dsconform_node_problems") == 1
    assert value(s, "dsconform_run_exit_status", status="tests failed") == 1
    assert value(s, "dsconform_capability_tests", capability="collectives",
                 outcome="failed") == 1
    assert value(s, "dsconform_capability_tests", capability="zero", outcome="passed") == 1


def test_a_rate_below_its_floor_is_visible(tmp_path):
    s = samples(exposition(write_node(tmp_path / "n", outcomes=[outcome(BUSBW)],
                                      metrics=[busbw(120.0)])))
    labels = {"metric": "all_reduce.busbw", "capability": "collectives", "dtype": "fp32",
              "size_bytes": str(1 << 30)}
    rate = value(s, "dsconform_rate_bytes_per_second", **labels)
    floor = value(s, "dsconform_rate_floor_bytes_per_second", **labels)
    assert rate == pytest.approx(120e9) and floor == 200e9 and rate < floor
    assert value(s, "dsconform_rates_below_floor") == 1


def test_a_rate_above_its_floor_is_not_counted_below(tmp_path):
    s = samples(exposition(write_node(tmp_path / "n", outcomes=[outcome(BUSBW)],
                                      metrics=[busbw(300.0)])))
    assert value(s, "dsconform_node_passed") == 1
    assert value(s, "dsconform_rates_below_floor") == 0


def test_an_interrupted_run_gives_verdict_0(tmp_path):
    s = samples(exposition(write_node(tmp_path / "n", outcomes=[outcome(ZERO)],
                                      exitstatus=2)))
    assert value(s, "dsconform_node_passed") == 0
    assert value(s, "dsconform_run_exit_status", status="interrupted") == 2


def test_health_findings_and_counters_are_counted(tmp_path):
    gpu = {"index": 3, "bus_id": "0000:9a:00.0", "uncorrected_volatile": 2,
           "remapped_rows": {"corrected": 1, "uncorrected": 0, "pending": True,
                             "failed": False},
           "pcie_replays": 7, "nvlinks": [{"link": 5, "active": False, "replay": 4,
                                           "recovery": None, "crc_flit": 0, "crc_data": 9}],
           "lost": None, "unreadable": {"PCIe replays": "NVMLError_Unknown"}}
    n = "suites/test_health.py::test_health_at_end"
    facts = [records.Fact(n, "health.end.gpu3", gpu, "health"),
             records.Fact(n, "health.end.findings", [
                 "RESET (drain the node and reset the GPU (nvidia-smi -r)): GPU 3: ...",
                 "RESET (drain ...): GPU 3: remapped rows pending", "MONITOR (no action): x"],
                 "health"),
             records.Fact(n, "health.end.kernel_xids", ["Xid 79 0000:9a:00.0"], "health")]
    s = samples(exposition(write_node(tmp_path / "n", outcomes=[outcome(ZERO)], facts=facts)))
    at = {"gpu": "3", "bus_id": "0000:9a:00.0", "when": "end"}
    assert value(s, "dsconform_gpu_ecc_errors_total", kind="uncorrected", scope="volatile",
                 **at) == 2
    assert value(s, "dsconform_gpu_remapped_rows", kind="corrected", **at) == 1
    assert value(s, "dsconform_gpu_remap_pending", **at) == 1
    assert value(s, "dsconform_gpu_pcie_replays_total", **at) == 7
    assert value(s, "dsconform_gpu_nvlink_active", link="5", **at) == 0
    assert value(s, "dsconform_gpu_nvlink_errors_total", link="5", kind="crc_data", **at) == 9
    assert not [k for k in s if k[0] == "dsconform_gpu_nvlink_errors_total"
                and ("kind", "recovery") in k[1]]  # not read: no series
    assert value(s, "dsconform_gpu_unreadable_counters", **at) == 1
    assert value(s, "dsconform_health_findings", when="end", action="RESET") == 2
    assert value(s, "dsconform_health_findings", when="end", action="MONITOR") == 1
    assert value(s, "dsconform_health_findings", when="end", action="ISOLATE") == 0
    assert value(s, "dsconform_health_xids", when="end", source="kernel_log") == 1
    assert not [k for k in s if ("when", "start") in k[1]]  # HEALTH-1 not in this run


def test_missing_fields_and_damaged_files_do_not_crash(tmp_path):
    """A folder of a killed run, a summary without most keys, damaged facts and a health.json
    that is not JSON give fewer series and a verdict, never an exception."""
    empty = tmp_path / "empty"
    empty.mkdir()
    s = samples(exposition(empty))
    assert value(s, "dsconform_node_passed") == 0 and value(s, "dsconform_run_finished") == 0

    killed = tmp_path / "killed"
    killed.mkdir()
    (killed / "records.jsonl").write_text(json.dumps({"outcome": outcome(ZERO)}) + "\n{cut")
    s = samples(prometheus.write_run(killed, started="2026-11-30T01:00:00+0000")[0].read_text())
    assert value(s, "dsconform_node_passed") == 0 and value(s, "dsconform_run_finished") == 0
    assert value(s, "dsconform_run_start_timestamp_seconds") == 1796000400.0
    assert value(s, "dsconform_capability_tests", capability="zero", outcome="passed") == 1

    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "summary.json").write_text(json.dumps({"capabilities": {"zero": {"passed": 2}},
                                                   "exitstatus": "interrupted"}))
    (bare / "health.json").write_text("dsconform health: NVML cannot be read\n{")
    s = samples(exposition(bare))
    assert value(s, "dsconform_node_passed") == 0  # no benchmarks.json beside it
    assert value(s, "dsconform_capability_tests", capability="zero", outcome="passed") == 2
    assert not [k for k in s if k[0] == "dsconform_run_exit_status"]

    odd = write_node(tmp_path / "odd", outcomes=[outcome(ZERO)], facts=[
        records.Fact("x", "health.start.gpu0", {"index": 0, "remapped_rows": None,
                                                "pcie_replays": "n/a", "nvlinks": [7]}),
        records.Fact("x", "health.start.findings", "not a list")])
    doc = json.loads((odd / "benchmarks.json").read_text())
    del doc["dsconform"]["started"], doc["machine_info"]
    (odd / "benchmarks.json").write_text(json.dumps(doc))
    s = samples(exposition(odd))
    assert value(s, "dsconform_node_passed") == 1
    assert value(s, "dsconform_gpu_lost", gpu="0", when="start") == 0
    assert not [k for k in s if k[0] in ("dsconform_run_start_timestamp_seconds",
                                         "dsconform_versions_info",
                                         "dsconform_gpu_pcie_replays_total")]


def test_two_values_of_one_test_and_metric_get_distinct_series(tmp_path):
    """One test measuring one metric twice with the same labels (two links) are two series:
    node_exporter refuses a file with a duplicate series."""
    nodeid = "suites/test_collectives.py::test_p2p"
    ms = [busbw(300.0, None, nodeid), busbw(310.0, None, nodeid)]
    s = samples(exposition(write_node(tmp_path / "n", outcomes=[outcome(nodeid)], metrics=ms)))
    tests = sorted(dict(ls)["test"] for (n, ls) in s if n == "dsconform_rate_bytes_per_second")
    assert tests == [nodeid, f"{nodeid} #2"]


def test_write_replaces_the_file_by_a_rename(tmp_path):
    """node_exporter never reads half a file: the new file is written beside the old one and
    renamed over it; a reader holding the old file still reads it whole."""
    folder = write_node(tmp_path / "n", outcomes=[outcome(ZERO)])
    path = prometheus.write_run(folder)[0]
    before = path.read_text()
    with open(path) as reader:
        write_node(folder, outcomes=[outcome(ZERO, "failed", "boom")])
        prometheus.write_run(folder)
        assert reader.read() == before  # the old inode, untouched
    after = path.read_text()
    assert "dsconform_node_passed 0.0" in after and "dsconform_node_passed 1.0" in before
    assert sorted(p.name for p in folder.iterdir()) == [
        "benchmarks.json", "dsconform.prom", "summary.json"]  # no temporary file left


def test_an_unwritable_textfile_dir_names_it(tmp_path):
    folder = write_node(tmp_path / "n", outcomes=[outcome(ZERO)])
    with pytest.raises(prometheus.TextfileError, match="cannot write dsconform.prom into "
                                                       "/proc/dsconform"):
        prometheus.write_run(folder, "/proc/dsconform")


# ------------------------------------------------------------------ the cluster view

def test_aggregate_writes_cluster_prom_per_node_verdict_and_capabilities(tmp_path):
    root = tmp_path / "nightly"
    write_node(root / "gpu-a01", outcomes=[outcome(BUSBW), outcome(ZERO)], metrics=[busbw(300)])
    write_node(root / "gpu-a02", outcomes=[outcome(BUSBW), outcome(ZERO)], metrics=[busbw(310)])
    write_node(root / "gpu-a03", outcomes=[outcome(BUSBW, "failed", "slow"), outcome(ZERO)],
               metrics=[busbw(150.0)])
    code = aggregate_report.main([str(root)], out=str(tmp_path / "out"), outlier_pct=90,
                                 plot=False)
    assert code == 1
    text = (tmp_path / "out" / prometheus.CLUSTER_PROM).read_text()
    s = samples(text)
    assert value(s, "dsconform_cluster_passed") == 0
    assert value(s, "dsconform_cluster_node_passed", node="gpu-a01") == 1
    assert value(s, "dsconform_cluster_node_passed", node="gpu-a03") == 0
    assert value(s, "dsconform_cluster_capability_tests", node="gpu-a03",
                 capability="collectives", outcome="failed") == 1
    assert value(s, "dsconform_cluster_capability_tests", node="gpu-a01", capability="zero",
                 outcome="passed") == 1
    assert value(s, "dsconform_cluster_node_outliers", node="gpu-a03") == 1
    assert value(s, "dsconform_cluster_node_outliers", node="gpu-a01") == 0
    assert value(s, "dsconform_cluster_performance_ratio", node="gpu-a03") == \
        pytest.approx(150 / 300)
    assert value(s, "dsconform_cluster_outlier_threshold_ratio") == 0.9


# ------------------------------------------------------------------ the plugin writes it

FAILING = '''
def test_ok(metrics):
    metrics.record_rate("copy", [0.5, 0.5, 0.5], amount=1e9, unit="GB/s", scale=1e9,
                        floor=5.0, bytes=1000000000)

def test_boom():
    assert False, "boom"
'''


def test_the_plugin_writes_both_files_for_a_failing_run(pytester, tmp_path):
    pytester.makepyfile(test_fail=FAILING)
    textfile = tmp_path / "textfile"
    result = pytester.runpytest("-p", "fixtures.plugin", "--results", str(tmp_path / "res"),
                                "--prometheus-textfile", str(textfile))  # value after a space
    result.assert_outcomes(failed=2)
    mine = (textfile / prometheus.PROM_FILE).read_text()
    assert mine == (tmp_path / "res" / prometheus.PROM_FILE).read_text()
    s = samples(mine)
    assert value(s, "dsconform_node_passed") == 0 and value(s, "dsconform_run_finished") == 1
    assert value(s, "dsconform_run_exit_status", status="tests failed") == 1
    assert value(s, "dsconform_capability_tests", outcome="failed") == 2
    assert value(s, "dsconform_rate_bytes_per_second", metric="copy") == pytest.approx(2e9)
    assert value(s, "dsconform_rate_floor_bytes_per_second", metric="copy") == 5e9
    assert value(s, "dsconform_rates_below_floor") == 1
    assert [dict(ls)["dsconform"] for (n, ls) in s if n == "dsconform_versions_info"] == \
        [__import__("dsconform").__version__]


def test_an_unwritable_prometheus_textfile_is_a_usage_error(pytester, tmp_path):
    pytester.makepyfile(test_ok="def test_ok(): pass\n")
    result = pytester.runpytest("-p", "fixtures.plugin", "--results", str(tmp_path / "res"),
                                "--prometheus-textfile", "/proc/dsconform")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--prometheus-textfile: cannot write dsconform.prom into "
                                 "/proc/dsconform*"])


def test_while_running_and_when_interrupted_the_verdict_is_0(tmp_path):
    """While the run runs, the textfile says it has not finished (a run killed now leaves no
    earlier pass behind); SIGINT (a time limit's `timeout -s INT`) writes verdict 0."""
    (tmp_path / "test_stop.py").write_text(
        "import time\ndef test_a(): pass\ndef test_b(): time.sleep(60)\n")
    out, textfile = tmp_path / "results", tmp_path / "textfile"
    (textfile).mkdir()
    (textfile / prometheus.PROM_FILE).write_text("dsconform_node_passed 1\n")  # last night's
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "test_stop.py", "-p", "fixtures.plugin", "-p",
         "no:cacheprovider", "--rootdir", str(tmp_path), "--results", str(out),
         "--prometheus-textfile", str(textfile), "-q"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while '"test_stop.py::test_a"' not in _read(out / "records.jsonl"):
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[0]
        time.sleep(0.1)
    running = samples((textfile / prometheus.PROM_FILE).read_text())
    assert value(running, "dsconform_node_passed") == 0
    assert value(running, "dsconform_run_finished") == 0
    assert value(running, "dsconform_run_start_timestamp_seconds") > 0
    time.sleep(0.5)  # test_b is running
    proc.send_signal(signal.SIGINT)
    text = proc.communicate(timeout=60)[0]
    assert proc.returncode == pytest.ExitCode.INTERRUPTED, text
    s = samples((textfile / prometheus.PROM_FILE).read_text())
    assert value(s, "dsconform_node_passed") == 0 and value(s, "dsconform_run_finished") == 1
    assert value(s, "dsconform_run_exit_status", status="interrupted") == 2


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


# ------------------------------------------------------------------ real node_exporter, promtool

def _binary(name: str, package: str) -> str:
    """The binary's path; without it a failure under CI (env CI), a skip elsewhere."""
    path = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").is_file()
                                  else None)
    if path:
        return path
    why = (f"{name} not found: install Debian's {package} (apt-get install -y "
           f"--no-install-recommends {package}; .ci/run does)")
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail(why)
    pytest.skip(why)


def _promtool_clean(promtool: str, text: str, what: str) -> None:
    proc = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and not (proc.stdout + proc.stderr).strip(), \
        f"promtool check metrics on {what}: exit {proc.returncode}: {proc.stdout}{proc.stderr}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(exporter: str, textfile: Path) -> str:
    """Start node_exporter with only its textfile collector on a free loopback port, scrape
    /metrics once, stop it."""
    last = ""
    for _ in range(3):  # the port may be taken between choosing it and binding it
        port = _free_port()
        proc = subprocess.Popen(
            [exporter, f"--web.listen-address=127.0.0.1:{port}", "--collector.disable-defaults",
             "--collector.textfile", f"--collector.textfile.directory={textfile}",
             "--web.disable-exporter-metrics"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                                timeout=5) as r:
                        return r.read().decode()
                except OSError:
                    time.sleep(0.2)
        finally:
            proc.terminate()
            try:
                last = proc.communicate(timeout=10)[1]
            except subprocess.TimeoutExpired:
                proc.kill()
                last = proc.communicate()[1]
    pytest.fail(f"node_exporter did not serve /metrics: {last[-2000:]}")


def test_a_real_run_scraped_by_node_exporter_matches_its_summary(tmp_path):
    exporter, promtool = _binary(*NODE_EXPORTER), _binary(*PROMTOOL)
    results, textfile = tmp_path / "results", tmp_path / "textfile"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "suites/test_profile.py",
         "suites/test_checkpoint_files.py", "-k", "test_profile or test_save_throughput", "-m",
         "not gpu and not slow",
         "--results", str(results), "--prometheus-textfile", str(textfile),
         "-p", "no:cacheprovider", "-q"],
        cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = (textfile / prometheus.PROM_FILE).read_text()
    _promtool_clean(promtool, text, "dsconform.prom")
    scraped = _scrape(exporter, textfile)
    _promtool_clean(promtool, scraped, "node_exporter's /metrics")
    s = samples(scraped)
    assert value(s, "node_textfile_scrape_error") == 0
    assert value(s, "node_textfile_mtime_seconds",
                 file=str(textfile / prometheus.PROM_FILE)) > 0
    summ = json.loads((results / "summary.json").read_text())
    assert value(s, "dsconform_node_passed") == (1 if summ["exitstatus"] == 0 else 0)
    assert value(s, "dsconform_run_exit_status") == summ["exitstatus"]
    assert {"checkpoint", "profile"} <= set(summ["capabilities"])
    for cap, counts in summ["capabilities"].items():
        for column, kinds in prometheus.OUTCOME_COLUMNS:
            assert value(s, "dsconform_capability_tests", capability=cap, outcome=column) == \
                sum(counts.get(k, 0) for k in kinds), (cap, column)
    doc = json.loads((results / "benchmarks.json").read_text())
    [save] = [b["extra_info"] for b in doc["benchmarks"]
              if b["extra_info"].get("metric") == "checkpoint.save"]
    assert value(s, "dsconform_rate_bytes_per_second", metric="checkpoint.save",
                 size_bytes=str(save["params"]["bytes"])) == \
        pytest.approx(save["rate"]["median"] * 1e9, rel=1e-12)
    assert value(s, "dsconform_run_end_timestamp_seconds") >= \
        value(s, "dsconform_run_start_timestamp_seconds")


def test_without_the_binaries_ci_fails_naming_the_package(monkeypatch):
    monkeypatch.setenv("CI", "1")
    with pytest.raises(pytest.fail.Exception, match="install Debian's no-such-package"):
        _binary("dsconform-no-such-binary", "no-such-package")
    monkeypatch.setenv("CI", "")
    with pytest.raises(pytest.skip.Exception, match="install Debian's no-such-package"):
        _binary("dsconform-no-such-binary", "no-such-package")


# ------------------------------------------------------------------ docs/fleet.md

FLEET = ROOT / "docs" / "fleet.md"


def test_the_docs_list_every_series(reference, tmp_path):
    """docs/fleet.md's tables name every family the node and cluster files hold."""
    folder = write_node(tmp_path / "n", outcomes=[outcome(BUSBW)], metrics=[busbw(120.0)],
                        exitstatus=2)
    report = aggregate.analyse(aggregate.collect([folder]))
    names = {n for n, _ in reference} | {n for n, _ in samples(exposition(folder))} | {
        n for n, _ in samples((prometheus.write_cluster(report, tmp_path)).read_text())}
    doc = FLEET.read_text()
    missing = sorted(n for n in names if f"`{n}`" not in doc)
    assert not missing, f"docs/fleet.md does not list {missing}"


def test_the_docs_alert_rules_pass_promtool(tmp_path):
    promtool = _binary(*PROMTOOL)
    text = FLEET.read_text()
    block = text.split("### Alert rules", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    rules = tmp_path / "dsconform.rules.yml"
    rules.write_text(block)
    proc = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS: 6 rules found" in proc.stdout + proc.stderr
