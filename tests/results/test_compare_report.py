"""dsconform compare's outputs: the terminal table, --markdown, --plot (a PNG whose red bars are
exactly the regressions), and the one-line message when matplotlib is missing."""

from __future__ import annotations

import math
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from dsconform.cli import main
from dsconform.results import compare, records
from dsconform.results.render import compare as compare_report
from dsconform.results.render import compare_chart as compare_plot
from tests.compare_docs import ISSUE, doc, metric, outcome, rate, write

GIB = 2**30
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
ZERO_MUST = "ZERO-EQ-1: ZeRO MUST give DDP's losses."
DEF = "suites/test_zero.py::test_effective_defaults"
DEF_MUST = "ZERO-DEF-1: DeepSpeed's effective defaults MUST equal the ones the suite assumes."


def upgrade_pair():
    """0.19.6 -> 0.19.8 as the issue pictures it: 1-bit Adam lost, a default moved, a known
    issue fixed upstream, bandwidth down, a ZeRO difference drifting, one metric noisy."""
    onebit = "suites/test_onebit.py::test_onebit_converges[cuda-onebit_adam]"
    z0 = "suites/test_zero.py::test_zero_matches_ddp[cuda-z0-fp16]"
    z3 = "suites/test_zero.py::test_zero_matches_ddp[cuda-z3-bf16]"
    bw = "suites/test_collectives.py::test_busbw_floor[all_reduce-1073741824B-2gpu]"
    base = doc(
        [rate("all_reduce.busbw", [0.0032] * 3, 2 * GIB, test=bw, bytes=GIB),
         metric("zero.loss_max_rel_diff", [1e-4], "1", test=z3),
         metric("zero.grad_max_abs_diff", [0.0], "1", test=z3),
         metric("step_seconds", [1.0, 1.5, 2.0], test=z3)],
        [outcome(onebit, "passed", must="ONEBIT-1: 1-bit Adam MUST converge like Adam."),
         outcome(z0, "xfailed", "known upstream issue", ZERO_MUST, "DS-1-BROKEN"),
         outcome(z3, "passed", must=ZERO_MUST), outcome(bw, "passed"),
         outcome(DEF, "passed", must=DEF_MUST)],
        [records.Fact(DEF, "default.gradient_clipping", 0.0, "zero"),
         records.Fact(DEF, "default.adam.eps", 1e-8, "zero")],
        [{**ISSUE, "count": 1}])
    new = doc(
        [rate("all_reduce.busbw", [0.0040] * 3, 2 * GIB, test=bw, bytes=GIB),
         metric("zero.loss_max_rel_diff", [1e-4], "1", test=z3),
         metric("zero.grad_max_abs_diff", [1e-7], "1", test=z3),
         metric("step_seconds", [1.2, 1.6, 2.4], test=z3)],
        [outcome(onebit, "skipped", "Requires: [DeepSpeed<0.19.7 (found 0.19.8)]",
                 must="ONEBIT-1: 1-bit Adam MUST converge like Adam."),
         outcome(z0, "passed", must=ZERO_MUST), outcome(z3, "passed", must=ZERO_MUST),
         outcome(bw, "passed"), outcome(DEF, "passed", must=DEF_MUST)],
        [records.Fact(DEF, "default.gradient_clipping", 1.0, "zero"),
         records.Fact(DEF, "default.adam.eps", 1e-8, "zero")],
        deepspeed="0.19.8")
    return base, new


@pytest.fixture
def pair_files(tmp_path):
    base, new = upgrade_pair()
    return write(tmp_path / "base.json", base), write(tmp_path / "new.json", new)


def test_sections_answer_the_four_questions():
    base, new = upgrade_pair()
    result = compare.compare(base, new)
    by_title = {s.title: s for s in compare_report.sections(result)}
    stopped = by_title["What stopped working"].rows
    assert stopped == [("ONEBIT-1[cuda-onebit_adam]", "passed", "skipped",
                        "Requires: [DeepSpeed<0.19.7 (found 0.19.8)]")]
    slower = {r[0]: r for r in by_title["What got slower or drifted"].rows}
    bw = slower["suites/test_collectives.py::test_busbw_floor[all_reduce-1073741824B-2gpu]"
                "::all_reduce.busbw"]
    assert bw[1:] == ("671.1 GB/s", "536.9 GB/s", "-20.0%", "±10.0%", "higher")
    drift = slower["ZERO-EQ-1[cuda-z3-bf16]::zero.grad_max_abs_diff"]
    assert drift[1:4] == ("0", "1e-07", "from 0") and "noise unknown" in drift[4]
    assert "ZERO-EQ-1[cuda-z3-bf16]::step_seconds" not in slower  # +7%, noise band ±100%
    assert by_title["What silently changed"].rows == [
        ("ZERO-DEF-1::default.gradient_clipping", "0.0", "1.0")]
    fixed = by_title["What improved or was fixed"].rows
    assert [r[:3] for r in fixed] == [("ZERO-EQ-1[cuda-z0-fp16]", "xfailed", "passed")]
    [issue] = by_title["Known upstream issues"].rows
    assert issue[0] == "DS-1-BROKEN" and "fixed upstream" in issue[3]
    env = {r[0]: r for r in by_title["Environment"].rows}
    assert env["DeepSpeed"] == ("DeepSpeed", "0.19.6", "0.19.8", "changed")
    assert env["torch"][3] == ""


def test_terminal_table(pair_files, capsys):
    assert main(["compare", *pair_files]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("dsconform compare: BASE ")
    heads = [ln for ln in out if ln.startswith("== ")]
    assert heads == ["== Environment ==", "== What stopped working (1) ==",
                     "== What got slower or drifted (2) ==", "== What silently changed (1) ==",
                     "== Known upstream issues (1) ==", "== What improved or was fixed (1) =="]
    assert "  DeepSpeed  0.19.6          0.19.8          changed" in out
    assert ("  ZERO-EQ-1[cuda-z0-fp16]  xfailed  passed  fixed upstream: DS-1-BROKEN no longer "
            "fails") in out
    assert out[-1] == "REGRESSION: 3 (1 outcomes, 2 metrics)"
    assert out[-2] == ("unchanged: 2 metrics within their noise band (1 of them measured once: "
                       "noise unknown), 3 outcomes, 1 facts")


def test_markdown_to_stdout_and_to_a_file(pair_files, tmp_path, capsys):
    assert main(["compare", *pair_files, "--markdown"]) == 1
    md = capsys.readouterr().out
    assert md.startswith("# dsconform comparison: DeepSpeed 0.19.6 -> 0.19.8\n")
    assert "**REGRESSION: 3 (1 outcomes, 2 metrics)**" in md
    for heading in ("## Environment", "## What stopped working", "## What got slower or drifted",
                    "## What silently changed", "## Known upstream issues",
                    "## What improved or was fixed"):
        assert f"\n{heading}\n" in md
    assert "| DeepSpeed | 0.19.6 | **0.19.8** | changed |" in md
    # The pipe inside a reason would split the table's cell: escaped.
    assert ("| ONEBIT-1[cuda-onebit_adam] | passed | skipped | Requires: [DeepSpeed<0.19.7 "
            "(found 0.19.8)] |") in md
    assert "| ZERO-DEF-1::default.gradient_clipping | 0.0 | 1.0 |" in md
    target = tmp_path / "upgrade.md"
    assert main(["compare", *pair_files, "--markdown", str(target)]) == 1
    captured = capsys.readouterr()
    assert "== What stopped working (1) ==" in captured.out  # the table still prints
    assert target.read_text() == md
    assert f"markdown: {target}" in captured.err


def test_markdown_escapes_pipes_and_lists_every_row():
    many = [outcome(f"t.py::test_{i}", "passed") for i in range(compare_report.ROWS_SHOWN + 5)]
    gone = [outcome(f"t.py::test_{i}", "failed", "a | b") for i in range(len(many))]
    result = compare.compare(doc(outcomes=many), doc(outcomes=gone))
    md = compare_report.markdown(result)
    assert md.count("| passed | failed | a \\| b |") == len(many)
    text = "\n".join(compare_report.terminal(result))
    assert text.count("  passed  failed  a | b") == compare_report.ROWS_SHOWN
    assert "... 5 more (the markdown report lists them all)" in text


def test_empty_headline_sections_say_none():
    md = compare_report.markdown(compare.compare(doc(), doc()))
    assert "## What stopped working\n\nNone." in md and "**no regression**" in md


def test_plot_is_a_png_with_regressions_red(pair_files, tmp_path, capsys):
    base, new = upgrade_pair()
    result = compare.compare(base, new)
    png = tmp_path / "chart.png"
    fig = compare_plot.draw(result, png)
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    ax = fig.axes[0]
    bars = ax.containers[0]
    # Which label a bar stands beside: by position, as a reader sees it.
    at = {round(y): t.get_text() for y, t in zip(ax.get_yticks(), ax.get_yticklabels())}
    labels = list(at.values())
    assert len(bars) == len(labels) == 4  # every metric measured in both runs
    red = {at[round(bar.get_y() + bar.get_height() / 2)] for bar in bars
           if _hex(bar.get_facecolor()) == compare_plot.COLORS[compare.REGRESSION]}
    regressions = {c.name for c in result.of(compare.REGRESSION, compare.METRIC)}
    assert {lbl.rsplit(" (", 1)[0] for lbl in red} == regressions and len(regressions) == 2
    bold = {t.get_text() for t in ax.get_yticklabels() if t.get_fontweight() == "bold"}
    assert bold == red
    assert any(lbl.endswith("(↑ better)") for lbl in labels)
    # The noise bands: one grey rectangle per row, as wide as the band held to.
    bands = [p for p in ax.patches if p not in list(bars)]
    step = next(c for c in result.of(compare.UNCHANGED, compare.METRIC)
                if c.name.endswith("step_seconds"))
    assert any(p.get_width() == pytest.approx(2 * step.band) for p in bands)
    # And through the command line.
    assert main(["compare", *pair_files, "--plot", str(tmp_path / "cli.png")]) == 1
    assert (tmp_path / "cli.png").read_bytes()[:8] == PNG_SIGNATURE
    assert f"chart: {tmp_path / 'cli.png'}" in capsys.readouterr().err


def _hex(rgba) -> str:
    return "#" + "".join(f"{round(x * 255):02x}" for x in rgba[:3])


def test_plot_rows_keep_every_regression_and_say_what_was_left_out():
    base = doc([metric(f"m{i}", [1.0] * 3) for i in range(10)])
    new = doc([metric(f"m{i}", [2.0 if i < 3 else 1.01] * 3) for i in range(10)])
    rows, left_out = compare_plot.rows(compare.compare(base, new), max_rows=2)
    assert [r.kind for r in rows] == ["regression"] * 3
    assert left_out == "7 metrics within their noise band"


def test_plot_without_metrics_still_writes_a_png(tmp_path):
    compare_plot.draw(compare.compare(doc(), doc()), tmp_path / "empty.png")
    assert (tmp_path / "empty.png").read_bytes()[:8] == PNG_SIGNATURE


def test_an_infinite_noise_band_is_drawn_across_the_axis_without_warnings(tmp_path):
    """A metric whose median is 0 with samples spread around it (waited_for_pct) has an infinite
    noise band: the chart spans it across the axis, with no NaN in matplotlib's transforms."""
    base = doc([metric("wait", [0.0, 0.0, 3.0], "%"), metric("t", [1.0, 1.0, 1.0])])
    new = doc([metric("wait", [0.0, 1.0, 4.0], "%"), metric("t", [1.5, 1.5, 1.5])])
    result = compare.compare(base, new)
    rows, _ = compare_plot.rows(result)
    assert any(r.band == float("inf") for r in rows), rows
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fig = compare_plot.draw(result, tmp_path / "inf.png")
    ax = fig.axes[0]
    lo, hi = ax.get_xlim()
    bands = [p for p in ax.patches if p.get_zorder() == 0]
    assert all(math.isfinite(p.get_width()) and p.get_width() <= hi - lo for p in bands)


def test_missing_matplotlib_is_one_line_and_exit_2(pair_files, tmp_path):
    # A None entry in sys.modules makes `import matplotlib` raise ImportError, as when the
    # optional extra is not installed.
    code = ("import sys; sys.modules['matplotlib'] = None; from dsconform.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    target = tmp_path / "chart.png"
    proc = subprocess.run([sys.executable, "-c", code, "compare", *pair_files, "--plot",
                           str(target)], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parents[2])
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [compare_plot.MISSING]
    assert "pip install 'dsconform[plot]'" in proc.stderr
    assert not target.exists()
    # Without --plot the same interpreter compares as usual.
    proc = subprocess.run([sys.executable, "-c", code, "compare", *pair_files],
                          capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parents[2])
    assert proc.returncode == 1 and "REGRESSION" in proc.stdout
