"""dsconform compare on real runs: two warm runs of one unchanged 2xH200 stack compare as no
regression both ways (their noise is measured from their own rounds), while a floor missed by
NEW, a timing slowed 2x with tight rounds and a share of time that grew by points still do.
The runs are tests/data/reference-runs (README there); each test copies one and changes what
it says."""

from __future__ import annotations

import copy
import gzip
import json
import statistics
from pathlib import Path

import pytest

from dsconform.cli import main
from dsconform.node import gpu_health
from dsconform.results import compare, noise
from tests.compare_docs import doc, metric, write

RUNS = Path(__file__).parents[1] / "data" / "reference-runs"
BUSBW_4G = "COLL-BW-2[all_reduce-4294967296B-2gpu]::all_reduce.busbw"
RANK_4G = "COLL-BW-2[all_reduce-4294967296B-2gpu]::all_reduce.rank_seconds"
WAIT_4G = "COLL-BW-2[all_reduce-4294967296B-2gpu]::all_reduce.waited_for_pct #2"
WAIT_1G = "COLL-BW-2[all_gather-1073741824B-2gpu]::all_gather.waited_for_pct #2"
RANK_1M = "COLL-BW-1[cuda-all_reduce]::all_reduce.rank_seconds"
CKPT_LOAD = "CKPT-PERF-2[cuda-torch]::checkpoint.load"
CPU_ADAM_LOAD = "OPS-LOAD-1[cpu_adam]::cpu_adam.load_seconds"


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    return {r: json.loads(gzip.decompress((RUNS / f"h200-x2-{r}.benchmarks.json.gz")
                                          .read_bytes())) for r in "ABC"}


def entry(d: dict, key: str) -> dict:
    """The benchmark entry compare names ``key`` (stable id::metric, #n for repeats)."""
    keys = list(compare.read_run(d).measures)
    return d["benchmarks"][keys.index(key)]


def slow_down(e: dict, factor: float) -> None:
    """Every round of a timed entry takes ``factor`` times as long: its rounds keep their
    shape, a rate's falls by the same factor."""
    st = e["stats"]
    st["data"] = [v * factor for v in st["data"]]
    for k in ("min", "max", "mean", "median", "stddev", "q1", "q3", "iqr"):
        st[k] *= factor
    rate = e["extra_info"].get("rate")
    if rate:
        rate["samples"] = [v / factor for v in rate["samples"]]
        rate["median"] /= factor
        rate["stddev"] /= factor


def set_rates(e: dict, rates: list[float]) -> None:
    """A rate entry whose rounds measured ``rates`` (seconds derived as the recorder does)."""
    rate = e["extra_info"]["rate"]
    seconds = [rate["amount"] / rate["scale"] / r for r in rates]
    e["stats"].update(data=seconds, median=statistics.median(seconds),
                      stddev=statistics.stdev(seconds))
    rate.update(samples=rates, median=statistics.median(rates), stddev=statistics.stdev(rates))


def cli(tmp_path: Path, base: dict, new: dict, *extra: str) -> int:
    return main(["compare", write(tmp_path / "base.json", base),
                 write(tmp_path / "new.json", new), *extra])


def change(result: compare.RunComparison, name: str) -> compare.Change:
    [c] = [c for c in result.changes if c.name == name]
    return c


# ------------------------------------------------------------------ two runs of one stack

@pytest.mark.parametrize("base, new", [("B", "C"), ("C", "B"), ("A", "C"), ("C", "A")])
def test_two_runs_of_one_stack_are_no_regression(runs, tmp_path, capsys, base, new):
    """B and C are two warm runs, A the cold one beside them: no regression either way,
    although small-message busbw moved by 40-90% and a wait by +6672%."""
    assert cli(tmp_path, runs[base], runs[new]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == "no regression"
    assert "== What got slower or drifted (0) ==" in out


def test_a_run_compared_with_itself_is_no_regression_and_judges_everything(runs, tmp_path):
    assert cli(tmp_path, runs["B"], runs["B"]) == 0
    result = compare.compare(runs["B"], runs["B"])
    assert not result.of(compare.NOT_JUDGED)  # nothing moved: nothing to leave out


def test_the_shortest_timing_judged_is_the_shortest_call_whose_waits_are_held():
    assert noise.MIN_SECONDS.value == gpu_health.MIN_WAIT_CHECK_SECONDS


def test_what_is_not_judged_is_listed_with_why(runs, capsys, tmp_path):
    """B -> C: the op loads (one round, +35% for cpu_adam) and the 1 MiB collectives
    (35-90 us) are reported under "Not judged", with the reason."""
    result = compare.compare(runs["B"], runs["C"])
    load = change(result, CPU_ADAM_LOAD)
    assert (load.kind, load.change) == (compare.NOT_JUDGED, "+35.5%")
    assert "not judged: one-off cost" in load.detail
    short = change(result, RANK_1M)
    assert short.kind == compare.NOT_JUDGED and "under 100 us" in short.detail
    assert cli(tmp_path, runs["B"], runs["C"]) == 0
    out = capsys.readouterr().out
    assert "== Not judged (reported, never a regression) (31) ==" in out
    assert "; not judged: 31 metrics (see 'Not judged')" in out


def test_a_tiny_share_of_time_is_under_its_floor(runs):
    """C -> B: a rank's wait at 1 GiB went 0.0017% -> 0.11% of the call (+6672%)."""
    c = change(compare.compare(runs["C"], runs["B"]), WAIT_1G)
    assert (c.kind, c.change) == (compare.UNCHANGED, "+6672.2%")
    assert "within the 1-point floor of a share" in c.detail


def test_storage_noise_between_runs_is_within_its_minimum_change(runs):
    """checkpoint.load moved 1.42 -> 1.10 GB/s (-22%) with rounds within 3%: beyond the
    rounds' noise, within the storage family's minimum change."""
    c = change(compare.compare(runs["C"], runs["B"]), CKPT_LOAD)
    assert (c.kind, c.change) == (compare.UNCHANGED, "-22.2%")
    assert c.band == pytest.approx(noise.MIN_CHANGE["checkpoint."].value)


GRAD_CLIP = ("ZERO-CLIP-1[cuda-z1-off_opt-bf16-cpu_adam-gas1-ws1-clip0.4]::"
             "zero.grad_max_abs_diff")


@pytest.fixture(scope="module")
def h100() -> dict[str, dict]:
    return {r: json.loads(gzip.decompress((RUNS / f"h100-x1-{r}.benchmarks.json.gz")
                                          .read_bytes())) for r in ("W1", "W2")}


@pytest.mark.parametrize("base, new", [("W1", "W2"), ("W2", "W1")])
def test_two_warm_1xh100_runs_are_no_regression(h100, tmp_path, capsys, base, new):
    """The worst bf16 gradient difference moved 0.00146 <-> 0.00195 (+33%) between two warm
    runs of one stack: within its family's minimum change."""
    assert cli(tmp_path, h100[base], h100[new]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "no regression"
    c = change(compare.compare(h100[base], h100[new]), GRAD_CLIP)
    assert c.kind == compare.UNCHANGED and c.change in ("+33.3%", "-25.0%")


def test_a_gradient_difference_grown_tenfold_is_still_a_regression(h100, tmp_path, capsys):
    new = copy.deepcopy(h100["W2"])
    slow_down(entry(new, GRAD_CLIP), 10)  # every round's value ten times as large
    assert cli(tmp_path, h100["W1"], new) == 1
    assert change(compare.compare(h100["W1"], new), GRAD_CLIP).kind == compare.REGRESSION


# ------------------------------------------------------------------ what must still be caught

def test_a_floor_missed_by_30_percent_is_a_regression_named(runs, tmp_path, capsys):
    new = copy.deepcopy(runs["C"])
    e = entry(new, BUSBW_4G)
    floor = e["extra_info"]["rate"]["limit"]
    slow_down(e, e["extra_info"]["rate"]["median"] / (0.7 * floor))
    assert cli(tmp_path, runs["B"], new) == 1
    out = capsys.readouterr().out
    assert "== What got slower or drifted (1) ==" in out
    [row] = [ln for ln in out.splitlines() if ln.startswith(f"  {BUSBW_4G} ")]
    assert f"beyond its floor {floor:g} GB/s" in row and "217 GB/s" in row, row
    assert out.splitlines()[-1] == "REGRESSION: 1 (0 outcomes, 1 metrics)"


def test_a_missed_floor_counts_however_noisy_and_however_small(runs):
    """Below its floor NEW regressed, whatever its rounds' spread and the family's minimum:
    wild rounds around 0.7 x the floor; a checkpoint load 23% down (storage moves by 30%
    between runs) but 1% under its floor."""
    new = copy.deepcopy(runs["C"])
    e = entry(new, BUSBW_4G)
    floor = e["extra_info"]["rate"]["limit"]
    set_rates(e, [0.7 * floor * f for f in (0.2, 1.0, 3.0)])
    load = entry(new, CKPT_LOAD)
    load_floor = load["extra_info"]["rate"]["limit"]
    slow_down(load, load["extra_info"]["rate"]["median"] / (0.99 * load_floor))
    result = compare.compare(runs["B"], new)
    assert {c.name for c in result.of(compare.REGRESSION)} == {BUSBW_4G, CKPT_LOAD}
    assert change(result, CKPT_LOAD).beyond == f"beyond its floor {load_floor:g} GB/s"


def test_a_timing_slowed_2x_with_tight_rounds_is_a_regression(runs, tmp_path, capsys):
    new = copy.deepcopy(runs["C"])
    slow_down(entry(new, RANK_4G), 2.0)
    assert cli(tmp_path, runs["B"], new) == 1
    out = capsys.readouterr().out
    [row] = [ln for ln in out.splitlines() if ln.startswith(f"  {RANK_4G} ")]
    assert "+98.3%" in row and row.rstrip().endswith("lower"), row


def test_a_short_timing_slowed_2x_and_a_cold_op_load_are_not_judged(runs, tmp_path):
    new = copy.deepcopy(runs["C"])
    slow_down(entry(new, RANK_1M), 2.0)
    slow_down(entry(new, CPU_ADAM_LOAD), 300.0)  # a cold cache: a build, 35 s
    result = compare.compare(runs["B"], new)
    assert not result.regressed
    assert change(result, RANK_1M).kind == change(result, CPU_ADAM_LOAD).kind == (
        compare.NOT_JUDGED)
    assert cli(tmp_path, runs["B"], new) == 0


def test_a_share_of_time_that_grew_by_points_is_a_regression(runs):
    """The 1-point floor hides 0.1-point moves, not a rank that now waits 5% of every call."""
    new = copy.deepcopy(runs["C"])
    e = entry(new, WAIT_4G)
    e["stats"].update(data=[5.0, 5.1, 5.2], median=5.1, stddev=0.1)
    c = change(compare.compare(runs["B"], new), WAIT_4G)
    assert c.kind == compare.REGRESSION, c.detail


def test_one_wild_round_does_not_hide_a_slowdown_but_noise_in_both_runs_does():
    base = doc([metric("t", [1.0, 1.01, 0.99])])
    wild = doc([metric("t", [1.5, 1.52, 0.9])])  # two slow rounds of three
    assert change(compare.compare(base, wild), "t.py::test_m::t").kind == compare.REGRESSION
    noisy = doc([metric("t", [0.6, 1.0, 1.4])])
    noisier = doc([metric("t", [0.8, 1.3, 1.8])])  # +30%, within 3 pooled spreads
    assert change(compare.compare(noisy, noisier), "t.py::test_m::t").kind == compare.UNCHANGED


# ------------------------------------------------------------------ long facts

def test_long_facts_are_one_line_and_whole_in_the_json(runs, tmp_path, capsys):
    """A GPU's health snapshot (2,157 characters) is summarised by what changed in it; the
    JSON output holds both values whole."""
    out_json = tmp_path / "cmp.json"
    assert cli(tmp_path, runs["C"], runs["B"], "--json", str(out_json)) == 0
    out = capsys.readouterr().out.splitlines()
    start = out.index("== What silently changed (5) ==")
    rows = out[start + 2:start + 7]
    assert all(len(r) < 160 for r in rows), max(rows, key=len)
    gpu1 = next(r for r in rows if r.startswith("  HEALTH-1::health.start.gpu1 "))
    assert "{21 fields}" in gpu1 and ("2 of 21 fields changed: compute_processes 4 -> 1, "
                                      "nvlinks; full values in the JSON (--json FILE)") in gpu1
    data = json.loads(out_json.read_text())
    assert data["format"] == "dsconform-compare/1" and data["regressed"] is False
    assert data["noise_rules"]["min_seconds"] == {"value": 1e-4, "why": noise.MIN_SECONDS.why}
    [fact] = [c for c in data["changes"] if c["name"] == "HEALTH-1::health.start.gpu1"]
    facts = {f["name"]: f["value"] for f in runs["B"]["dsconform"]["facts"]
             if f["nodeid"].endswith("test_health_at_start")}
    assert fact["new_value"] == facts["health.start.gpu1"]
    assert len(json.dumps(fact["new_value"])) > 2000


def test_markdown_summarises_long_facts_too(runs, tmp_path, capsys):
    assert cli(tmp_path, runs["C"], runs["B"], "--markdown") == 0
    md = capsys.readouterr().out
    assert max(len(ln) for ln in md.splitlines() if "health." in ln) < 200


@pytest.mark.parametrize("base, new", [("p", "q"), ("q", "p")])
def test_two_cpu_tier_runs_of_one_machine_are_no_regression(tmp_path, capsys, base, new):
    """The CPU accelerator's timings follow the machine's other load (2x between two runs of
    one CPU machine): reported, never judged."""
    pair = {r: json.loads(gzip.decompress((RUNS / f"cpu-{r}.benchmarks.json.gz").read_bytes()))
            for r in (base, new)}
    assert cli(tmp_path, pair[base], pair[new]) == 0, capsys.readouterr().out[-3000:]
    result = compare.compare(pair[base], pair[new])
    reasons = [c.detail for c in result.changes if c.kind == compare.NOT_JUDGED]
    assert any("CPU accelerator" in r for r in reasons), reasons
