"""dsconform radar: the radar tier's selection, the releases' order, the timeline (changes named
by the first release that shows them), the verdict's exit codes, and the runner end to end with
a stand-in interpreter per release."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from dsconform.cli import main
from dsconform.results import records
from dsconform.results import timeline as tl
from dsconform.results.render import timeline as render
from dsconform.tools import radar
from tests.compare_docs import doc, outcome

EQ = "ZERO-EQ-1: ZeRO MUST give DDP's losses."
DEF = "ZERO-DEF-1: DeepSpeed's effective defaults MUST be the ones the suite assumes."
VER = "ONEBIT-VER-1: a 1-bit optimizer MUST be available or its removal named."
Z1 = "suites/test_zero.py::test_zero_matches_ddp[cpu-z1-off_none-fp32-sgd-gas1-ws2]"
Z0 = "suites/test_zero.py::test_zero_matches_ddp[cpu-z0-off_none-bf16-adam-gas1-ws2]"
OB = "suites/test_onebit.py::test_optimizer_available[OneBitAdam]"
DEFAULTS = "suites/test_zero.py::test_effective_defaults[cpu]"
SPLIT = "RankError: rank 0 of 2 raised RuntimeError: Output 0 of Split is a view"
REMOVED = ("Requires: [OneBitAdam (removed in DeepSpeed 0.19.7, PR #8490 "
           "https://github.com/deepspeedai/DeepSpeed/pull/8490) (found DeepSpeed 0.19.8)]")


def run(version: str, z1: str, z0: str = "passed", onebit: str = "passed",
        clipping: object = 1.0, z1_reason: str = "", z0_issue: str = "") -> dict:
    outcomes = [outcome(Z1, z1, z1_reason, EQ), outcome(Z0, z0, "", EQ, z0_issue),
                outcome(OB, onebit, REMOVED if onebit == "skipped" else "", VER),
                outcome(DEFAULTS, "passed", "", DEF)]
    facts = [records.Fact(DEFAULTS, "default.gradient_clipping", clipping, "zero")]
    return doc(outcomes=outcomes, facts=facts, deepspeed=version, gpu_model=None, gpu_count=0,
               profile="cpu-ci")


RUNS = [("0.16.9", run("0.16.9", "passed", clipping=0.0)),
        ("0.18.9", run("0.18.9", "failed", z1_reason=SPLIT)),
        ("0.19.0", run("0.19.0", "passed")),
        ("0.19.6", run("0.19.6", "passed", z0="xfailed", z0_issue="DS-5104-Z0-ADAM-INIT-STEP")),
        ("0.19.8", run("0.19.8", "passed", z0="xfailed", onebit="skipped",
                       z0_issue="DS-5104-Z0-ADAM-INIT-STEP"))]


def timeline(runs=RUNS) -> tl.Timeline:
    return tl.build([(v, d, f"ds-{v}") for v, d in runs])


# ------------------------------------------------------------------ the timeline

def test_each_change_is_named_by_the_first_release_that_shows_it():
    t = timeline()
    changes = {(c.kind, c.row.split("[")[0], c.first) for c in t.changes}
    assert changes == {
        (tl.FAILS, "ZERO-EQ-1", "0.18.9"),          # the split-view crash appears
        (tl.FIXED, "ZERO-EQ-1", "0.19.0"),          # ... and goes away
        (tl.KNOWN_FROM, "ZERO-EQ-1", "0.19.6"),     # DS-5104 from 0.19.6
        (tl.REMOVED_FROM, "ONEBIT-VER-1", "0.19.8"),  # removed (PR #8490)
        (tl.MOVED, "ZERO-DEF-1", "0.18.9"),  # a default moved (gradient_clipping)
    }
    [moved] = [c for c in t.changes if c.kind == tl.MOVED]
    assert (moved.before, moved.after) == ("0.0", "1.0")
    [known] = [c for c in t.changes if c.kind == tl.KNOWN_FROM]
    assert known.detail.startswith("DS-5104-Z0-ADAM-INIT-STEP")


def test_cells_and_capability_counts():
    t = timeline()
    row = {r.key: r for r in t.tests}["ZERO-EQ-1[cpu-z1-off_none-fp32-sgd-gas1-ws2]"]
    assert row.cells == ["passed", "failed", "passed", "passed", "passed"]
    caps = {r.key: r.cells for r in t.capabilities}
    assert caps["c"][1] == "3/1/0/0" and caps["c"][-1] == "2/0/1/1"  # passed/failed/known/skip
    assert {r.key: r.cells for r in t.known_issues}["DS-5104-Z0-ADAM-INIT-STEP"] == \
        ["-", "-", "-", "1", "1"]


def test_the_verdict_is_the_comparison_of_the_first_release_with_the_last():
    t = timeline()
    # 1-bit Adam passed on 0.16.9 and is removed on 0.19.8; stage-0 Adam became a known issue
    assert t.regressed
    assert {c.name.split("[")[0] for c in t.verdict.of("regression")} == {"ONEBIT-VER-1",
                                                                         "ZERO-EQ-1"}
    quiet = timeline([RUNS[2], ("0.19.1", run("0.19.1", "passed"))])
    assert not quiet.regressed and not quiet.changes


def test_markdown_lists_changes_by_release_and_every_test():
    md = render.markdown(timeline())
    assert "- **0.18.9**: 1 x fails (passed -> failed): ZERO-EQ-1[cpu-z1-" in md
    assert "Output 0 of Split is a view" in md
    assert "- **0.19.8**: 1 x removed (passed -> skipped): ONEBIT-VER-1[OneBitAdam]" in md
    assert "| ZERO-DEF-1[cpu]::default.gradient_clipping | 0.0 | 1.0 | 1.0 | 1.0 | 1.0 |" in md
    assert "| ZERO-EQ-1[cpu-z1-off_none-fp32-sgd-gas1-ws2] | pass | FAIL | pass | pass | pass |" \
        in md


def test_report_writes_the_timeline_and_exits_like_compare(tmp_path, capsys):
    folders = []
    for v, d in RUNS:
        (tmp_path / v).mkdir()
        (tmp_path / v / "benchmarks.json").write_text(json.dumps(d))
        folders.append((v, str(tmp_path / v)))
    assert render.report(folders, tmp_path / "out", plot=False) == 1  # a regression
    printed = capsys.readouterr().out
    assert "0.16.9 -> 0.19.8: REGRESSION" in printed and "0.18.9: 1 x fails" in printed
    summary = json.loads((tmp_path / "out" / "timeline.json").read_text())
    assert [r["release"] for r in summary["releases"]] == [v for v, _ in RUNS]
    assert summary["regressed"] and (tmp_path / "out" / "timeline.md").is_file()
    assert render.report(folders[2:4][:1] + [folders[2]], tmp_path / "o2", plot=False) == 2
    assert render.report(folders[1:3], tmp_path / "o3", plot=False) == 0  # 0.18.9 -> 0.19.0
    (tmp_path / "0.19.0" / "benchmarks.json").write_text("{")
    assert render.report(folders, tmp_path / "o4", plot=False) == 2
    assert "0.19.0: " in capsys.readouterr().err


def test_the_chart_is_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    from dsconform.results.render import timeline_chart
    t = timeline()
    grid, left_out = timeline_chart.rows(t)
    assert [r.key.split("[")[0] for r in grid] == ["ONEBIT-VER-1", "ZERO-EQ-1", "ZERO-EQ-1"]
    timeline_chart.draw(t, tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


# ------------------------------------------------------------------ the radar tier

TIER = [
    "suites/test_profile.py::test_cpu_cores",
    "suites/test_zero.py::test_zero_matches_ddp[cpu-z0-off_none-fp32-sgd-gas1-ws2]",
    "suites/test_zero.py::test_zero_matches_ddp[cpu-z0-off_none-bf16-adam-gas1-ws1]",
    "suites/test_zero.py::test_zero_matches_ddp[cpu-z1-off_none-fp32-sgd-gas1-ws2]",
    "suites/test_zero.py::test_zero_matches_ddp[cpu-z1-off_none-fp32-sgd-gas1-ws1]",
    "suites/test_zero.py::test_zero_matches_ddp[cpu-z2-off_opt-fp32-cpu_adam-gas1-ws2]",
    "suites/test_zero.py::test_zero_matches_ddp[cpu-z2-off_opt-fp32-sgd-gas1-ws2]",
    "suites/test_zero.py::test_zero_matches_ddp[cpu-z3-off_none-bf16-sgd-gas1-ws2]",
    "suites/test_loss_scaler.py::test_scaler_follows_model",
    "suites/test_loss_scaler.py::test_scaler_follows_model_on_sequence[h1-clean-between]",
]


NIGHTLY = [f"suites/test_zero.py::test_zero_matches_ddp[cpu-z{s}-{off}-{dt}-{opt}-gas{g}-ws{w}]"
           for s in range(4) for off in ("off_none", "off_opt") for dt in ("fp32", "bf16")
           for opt in ("sgd", "adam") for g in (1, 4) for w in (1, 2)]


def test_the_radar_tier_is_the_cpu_tier_with_a_three_way_zero_array():
    chosen = radar.radar_selection(TIER, NIGHTLY)
    # every CPU-tier cell but the property test left out for its budget
    assert chosen[:len(TIER) - 1] == [t for t in TIER if not t.endswith("follows_model")]
    assert "suites/test_loss_scaler.py::test_scaler_follows_model" not in chosen
    added = chosen[len(TIER) - 1:]
    assert added and all(c in NIGHTLY and c.endswith("ws2]") for c in added)
    # every triple of (stage, offload, dtype, optimizer, GAS) values the nightly matrix has is
    # in a chosen cell, and far fewer cells than the full product do it
    zero = [c for c in chosen if "test_zero_matches_ddp" in c]
    def parts(c):
        return c.split("[")[1].rstrip("]").split("-")[1:6]
    import itertools
    for combo in itertools.combinations(range(5), 3):
        want = {tuple(parts(c)[i] for i in combo) for c in NIGHTLY}
        have = {tuple(parts(c)[i] for i in combo) for c in zero}
        assert want <= have, combo
    assert len(added) < len(NIGHTLY) // 4
    assert radar.radar_selection(TIER[:1]) == TIER[:1]  # no nightly matrix: the tier alone


def test_three_way_takes_only_what_the_given_cells_miss():
    assert radar.three_way(NIGHTLY, NIGHTLY) == []  # all given: nothing to add
    alone = radar.three_way(NIGHTLY)
    assert len(radar.three_way(NIGHTLY, alone[:3])) < len(alone)
    assert radar.three_way(["suites/test_zero.py::test_zero_matches_ddp[cpu-z0-ws2]"]) == []


# ------------------------------------------------------------------ releases

def test_releases_are_ordered_as_versions_and_say_where_they_come_from(tmp_path):
    rs = radar.releases(["0.19.8", "0.18.9@2.13"], [f"0.16.9={tmp_path}"], [f"0.17.6={tmp_path}"])
    assert [(r.version, r.torch) for r in rs] == [("0.16.9", None), ("0.17.6", None),
                                                  ("0.18.9", "2.13.0"), ("0.19.8", "2.14.1")]
    assert rs[0].results == tmp_path and rs[1].python == tmp_path / "bin" / "python"
    assert [r.label for r in rs] == ["0.16.9", "0.17.6", "0.18.9", "0.19.8"]
    for bad, message in ((["x.y", "0.19.8"], "not a DeepSpeed version"), (["0.19.8"], "two"),
                         (["0.99.1", "0.19.8"], "0.99.1@TORCH"),
                         (["0.19.8@two", "0.19.6"], "expected a torch release")):
        with pytest.raises(radar.RadarError, match=message):
            radar.releases(bad)
    with pytest.raises(radar.RadarError, match="VERSION=PATH"):
        radar.releases(["0.19.8"], ["0.19.6"])


def test_each_release_gets_the_torch_of_its_time_unless_given():
    from dsconform.tools.periods import period_torch
    # the newest torch on PyPI before each release (Python 3.11 wheels)
    assert {v: period_torch(v, 11) for v in ("0.16.9", "0.17.6", "0.18.9", "0.19.2", "0.19.8")} \
        == {"0.16.9": "2.7.0", "0.17.6": "2.8.0", "0.18.9": "2.11.0", "0.19.2": "2.12.0",
            "0.19.8": "2.14.1"}
    assert period_torch("0.16.0", 13) == "2.5.1"  # torch 2.4 had no Python 3.13 wheel
    rs = radar.releases(["0.19.6", "0.19.8"], torches=["2.13"])
    assert [(r.version, r.torch, r.label) for r in rs] == [("0.19.6", "2.13.0", "0.19.6"),
                                                          ("0.19.8", "2.13.0", "0.19.8")]


def test_several_torches_with_one_release_are_a_torch_axis():
    rs = radar.releases(["0.19.8"], torches=["2.14.1", "2.13"])
    assert [(r.torch, r.label, r.folder) for r in rs] == [
        ("2.13.0", "torch 2.13.0", "ds-0.19.8-torch-2.13.0"),
        ("2.14.1", "torch 2.14.1", "ds-0.19.8-torch-2.14.1")]
    with pytest.raises(radar.RadarError, match="exactly one DeepSpeed"):
        radar.releases(["0.19.6", "0.19.8"], torches=["2.13", "2.14.1"])
    rs = radar.releases(["0.19.8@2.13.0", "0.19.8@2.14.1", "0.19.6"])
    assert [r.label for r in rs] == ["0.19.6", "0.19.8@2.13.0", "0.19.8@2.14.1"]


def test_a_ready_venv_is_reused_without_installing(tmp_path, monkeypatch):
    from dsconform.tools import radar_envs
    where = radar_envs.venv_dir(tmp_path, "2.13.0")
    (where / "bin").mkdir(parents=True)
    (where / "bin" / "python").write_text("")
    checkout = Path(__file__).resolve().parents[2]
    (where / radar_envs.READY).write_text(json.dumps({"torch": "2.13.0",
                                                      "suite": str(checkout)}))
    monkeypatch.setattr(radar_envs, "installed_deepspeed", lambda python: "0.18.9")
    said = []
    assert radar_envs.ensure_env(tmp_path, "2.13.0", "0.18.9", checkout, said.append) == \
        where / "bin" / "python"
    assert said == [f"venv {where} (cached)"]


def test_the_radar_constraints_leave_torch_and_deepspeed_free(tmp_path):
    from dsconform.tools import radar_envs
    checkout = Path(__file__).resolve().parents[2]
    where = tmp_path / "torch-2.13.0"  # not made yet: the venv step makes (and clears) it
    [_, path] = radar_envs._constraints(checkout, where)
    assert not Path(path).is_relative_to(where)
    lines = Path(path).read_text().splitlines()
    assert not [ln for ln in lines if ln.startswith(("deepspeed", "torch", "triton"))]
    assert any(ln.startswith("pytest==") for ln in lines)
    assert any(ln.startswith("nvidia-ml-py") for ln in lines)


# ------------------------------------------------------------------ end to end

FAKE = r"""#!{python}
import json, os, sys
ver = os.path.basename(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if sys.argv[1] == "-c":  # the radar asks which DeepSpeed this interpreter imports
    if "pytest11" in sys.argv[2]:  # ... and whether it sees the suite
        print(os.environ.get("FAKE_SEES_SUITE", "True"))
    else:
        print(ver if "importlib.metadata" in sys.argv[2] else "warm")
    sys.exit(0)
args = sys.argv[1:]
if "--collect-only" in args:
    print("\n".join(json.loads(os.environ["FAKE_TIER"])))
    print("4 tests collected")
    sys.exit(0)
out = args[args.index("--results") + 1]
os.makedirs(out, exist_ok=True)
runs = json.loads(open(os.environ["FAKE_RUNS"]).read())
if ver not in runs:
    sys.exit(4)  # a run that writes nothing
open(os.path.join(out, "benchmarks.json"), "w").write(json.dumps(runs[ver]))
print("pytest", " ".join(args))
sys.exit(1)
"""


def _fake_envs(tmp_path: Path, versions) -> list[str]:
    given = []
    for v in versions:
        python = tmp_path / "envs" / v / "bin" / "python"
        python.parent.mkdir(parents=True)
        python.write_text(FAKE.format(python=sys.executable))
        python.chmod(python.stat().st_mode | stat.S_IEXEC)
        given += ["--venv", f"{v}={tmp_path / 'envs' / v}"]
    return given


def test_the_radar_end_to_end_prints_progress_and_keeps_each_run(tmp_path, capsys, monkeypatch):
    runs = dict(RUNS)
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    monkeypatch.setenv("FAKE_RUNS", str(tmp_path / "runs.json"))
    monkeypatch.setattr(radar, "has_gpu", lambda: True)  # no CPU comm op to warm up
    out = tmp_path / "radar"
    args = ["radar", *_fake_envs(tmp_path, runs), "--out", str(out), "--no-plot",
            "--suites", str(Path(__file__).resolve().parents[2] / "suites")]
    assert main(args) == 1
    printed = capsys.readouterr().out
    assert "dsconform radar: 5 columns (0.16.9, 0.18.9, 0.19.0, 0.19.6, 0.19.8)" in printed
    assert "[2/5] 0.18.9: running pytest -m gpu" in printed
    assert "[2/5] 0.18.9: done in 0 s: 3 passed, 1 failed (pytest exit 1)" in printed
    for v in runs:
        assert (out / f"ds-{v}" / "benchmarks.json").is_file()
        assert "pytest" in (out / f"ds-{v}" / "pytest.log").read_text()
    assert "0.19.6: 1 x known issue" in printed and (out / "timeline.md").is_file()


def test_a_release_that_ran_nothing_is_named_and_exits_2(tmp_path, capsys, monkeypatch):
    (tmp_path / "runs.json").write_text(json.dumps({v: d for v, d in RUNS[2:4]}))
    monkeypatch.setenv("FAKE_RUNS", str(tmp_path / "runs.json"))
    monkeypatch.setattr(radar, "has_gpu", lambda: True)
    args = ["radar", *_fake_envs(tmp_path, ["0.18.9", "0.19.0", "0.19.6"]), "--out",
            str(tmp_path / "r"), "--no-plot", "--suites",
            str(Path(__file__).resolve().parents[2] / "suites")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "0.18.9 is not on the timeline: its run wrote no benchmarks.json (pytest " \
           "exit 4" in err
    assert (tmp_path / "r" / "timeline.md").is_file()  # the other two still compared


def test_the_radar_tier_runs_its_selection_only(tmp_path, capsys, monkeypatch):
    (tmp_path / "runs.json").write_text(json.dumps(dict(RUNS[2:4])))
    monkeypatch.setenv("FAKE_RUNS", str(tmp_path / "runs.json"))
    monkeypatch.setenv("FAKE_TIER", json.dumps(TIER))
    monkeypatch.setattr(radar, "has_gpu", lambda: True)
    suites = Path(__file__).resolve().parents[2] / "suites"
    args = ["radar", *_fake_envs(tmp_path, ["0.19.0", "0.19.6"]), "--tier", "radar", "--out",
            str(tmp_path / "r"), "--no-plot", "--suites", str(suites)]
    assert main(args) == 1  # DS-5104 appeared from 0.19.0 to 0.19.6
    chosen = radar.radar_selection(TIER, TIER)  # the stand-in collects TIER both times
    assert (tmp_path / "r" / "radar-tier.txt").read_text().split() == chosen
    assert f"radar tier: the CPU tier's {len(TIER)} tests less 4 left out, and 0 ZeRO cells " \
           f"of the nightly matrix for 3-way coverage: {len(chosen)} tests" in \
        capsys.readouterr().out
    ran = (tmp_path / "r" / "ds-0.19.6" / "pytest.log").read_text().splitlines()[0]
    assert chosen[1] in ran and f" {suites} " not in ran  # the folder would add the tier back
    assert "-m 'not gpu' --nightly" in ran  # its nightly ZeRO cells are `slow`


def test_an_environment_that_cannot_see_the_suite_is_named(tmp_path, capsys, monkeypatch):
    (tmp_path / "runs.json").write_text(json.dumps(dict(RUNS[2:4])))
    monkeypatch.setenv("FAKE_RUNS", str(tmp_path / "runs.json"))
    monkeypatch.setenv("FAKE_SEES_SUITE", "False")
    monkeypatch.setattr(radar, "has_gpu", lambda: True)
    args = ["radar", *_fake_envs(tmp_path, ["0.19.0", "0.19.6"]), "--out", str(tmp_path / "r"),
            "--no-plot", "--suites", str(Path(__file__).resolve().parents[2] / "suites")]
    assert main(args) == 2
    assert "cannot import dsconform" in capsys.readouterr().out


def test_the_radar_is_a_command_a_tox_environment_and_documented():
    import configparser
    root = Path(__file__).resolve().parents[2]
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(root / "tox.ini")
    commands = tox["testenv:radar"]["commands"]
    assert "dsconform radar" in commands and "--tier radar" in commands
    for v in ("0.16.9", "0.17.6", "0.18.9", *(f"0.19.{n}" for n in range(9))):
        assert v in commands, v
    assert "`dsconform radar VERSION...`" in (root / "docs" / "options.md").read_text()
    with pytest.raises(SystemExit) as e:
        main(["radar", "--help"])
    assert e.value.code == 0


def test_finished_runs_are_named_by_what_they_ran_on(tmp_path):
    """A radar of --from-results folders only runs nothing here: its tier line names the runs'
    node and profile, never this machine's tier."""
    from dsconform.tools.radar import Release, finished_runs_words
    ref = Path(__file__).resolve().parents[2] / "results" / "reference" / "h200-x1"
    words = finished_runs_words([Release("0.19.6", results=ref / "ds-0.19.6"),
                                 Release("0.19.8", results=ref / "ds-0.19.8")])
    assert words == ("the finished runs given with --from-results (1x NVIDIA H200, profile "
                     "auto-h200-x1)")
    assert "CPU tier" not in words
    assert finished_runs_words([Release("0.19.6", results=tmp_path)]) == \
        "the finished runs given with --from-results"
