"""The results a run writes into --results, and the ONE reader that compare, aggregate and the
project's tools share: file names, outcome names, and the checked loading of benchmarks.json,
summary.json and records.jsonl. The writer is dsconform.plugin.recorder (with
dsconform.results.records); docs/results-format.md describes the files for users."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

BENCHMARKS_JSON = "benchmarks.json"  # pytest-benchmark's format, machine_info extended
SUMMARY_JSON = "summary.json"
SUMMARY_TXT = "summary.txt"
RECORDS_JSONL = "records.jsonl"  # one line per test as it ends: what survives a killed run
JUNIT_XML = "junit.xml"
DS_REPORT_JSON = "ds_report.json"  # written by the ops suite
PROM_FILE = "dsconform.prom"  # the verdict in node_exporter's textfile format
#: summary.json's section of a --soak run (the burn-in's per-GPU report), and the fact of
#: benchmarks.json it comes from (dsconform/checks/soak.py ``summary``).
SOAK_SECTION = "soak"
#: What aggregate reads of a node's folder, in the order it prefers them.
RESULT_FILES = (SUMMARY_JSON, BENCHMARKS_JSON, RECORDS_JSONL)
#: Every file a reader may take for a run's verdict. A run sets the previous run's aside before
#: anything can refuse it (dsconform.results.run_files), so none of them outlives its run.
VERDICT_FILES = (SUMMARY_JSON, SUMMARY_TXT, BENCHMARKS_JSON, JUNIT_XML, DS_REPORT_JSON,
                 RECORDS_JSONL, PROM_FILE)
#: summary.json's ``status``: how the run ended.
STATUSES = ("passed", "failed", "interrupted", "refused")
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")


def previous_name(name: str) -> str:
    """Where a verdict file of the previous run is kept: ``summary.previous.json``. The .prom
    keeps its suffix last (``dsconform.prom.previous``): node_exporter reads every ``*.prom`` of
    its folder, and an old verdict must never be one of them."""
    if name == PROM_FILE:
        return name + ".previous"
    stem, dot, suffix = name.partition(".")
    return f"{stem}.previous{dot}{suffix}"


class ResultsFormatError(ValueError):
    """A file that is not a results file of this suite (or of pytest-benchmark), named with
    the field that is wrong."""


def load_benchmarks(path: str | Path) -> dict[str, Any]:
    """Read and check a results file (``benchmarks.json``, or a results directory holding one).
    Raises ResultsFormatError with one line naming the file and the field."""
    p = Path(path)
    if p.is_dir():
        p = p / BENCHMARKS_JSON
    try:
        doc = json.loads(p.read_text())
    except FileNotFoundError:
        refused = _refusal(p.parent / SUMMARY_JSON)
        if refused is not None:
            raise ResultsFormatError(f"{p.parent}: its newest run was refused before its first "
                                     f"test ({refused}): it measured nothing") from None
        raise ResultsFormatError(f"{p}: no such file (give a benchmarks.json or the --results "
                                "directory of a run)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ResultsFormatError(f"{p}: cannot read: {e}") from None
    except json.JSONDecodeError as e:
        hint = ""
        if p.name in ("junit.xml", "records.jsonl") or p.suffix in (".xml", ".jsonl"):
            hint = " (give the benchmarks.json beside it, or the results directory)"
        raise ResultsFormatError(f"{p}: not JSON: {e}{hint}") from None
    check_benchmarks(doc, str(p))
    if not isinstance(doc.get("dsconform"), dict):
        raise ResultsFormatError(f"{p}: a pytest-benchmark file without dsconform outcomes (no "
                                "'dsconform' section): not a suite run")
    return doc


def _refusal(summary_path: Path) -> str | None:
    """The reason of a refused run's summary.json; None for any other summary, or none."""
    try:
        doc = json.loads(summary_path.read_text())
    except (OSError, ValueError):
        return None
    if isinstance(doc, dict) and doc.get("status") == "refused":
        return str(doc.get("reason") or "no reason recorded")
    return None


def ran_nothing(doc: dict[str, Any]) -> bool:
    """A results document with no test outcome and no measurement: a --collect-only run, a
    selection that matched nothing, or a run stopped before its first test ended. Comparing it
    would compare nothing."""
    return not doc["dsconform"].get("outcomes") and not doc["benchmarks"]


def is_number(v: Any) -> bool:
    # Infinity and NaN are numbers here: Python's json writes them, and a diverged comparison
    # records one (the void fp16 rows of tests/data/compare/zero-full).
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class _Checker:
    def __init__(self, where: str):
        self.where = where

    def fail(self, field_: str, msg: str) -> None:
        raise ResultsFormatError(f"{self.where}: {field_}: {msg}")

    def kind(self, value: Any, field_: str, types: type | tuple[type, ...], what: str,
             optional: bool = True) -> None:
        if value is None and optional:
            return
        if isinstance(value, bool) or not isinstance(value, types):  # JSON true is no int
            self.fail(field_, f"expected {what}, found {_short(value)}")

    def number(self, value: Any, field_: str, optional: bool = True) -> None:
        if value is None and optional:
            return
        if not is_number(value):
            self.fail(field_, f"expected a number, found {_short(value)}")


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def check_benchmarks(doc: Any, where: str) -> None:
    """Every field compare reads, with the type it needs: a foreign or damaged file fails here
    with one line, never later with a traceback."""
    c = _Checker(where)
    if not isinstance(doc, dict) or not isinstance(doc.get("benchmarks"), list):
        hint = ""
        if isinstance(doc, dict) and "capabilities" in doc:
            hint = " (this is a summary.json: give the benchmarks.json beside it)"
        raise ResultsFormatError(f"{where}: not a benchmark JSON (no 'benchmarks' list){hint}")
    c.kind(doc.get("machine_info"), "machine_info", dict, "an object")
    for i, b in enumerate(doc["benchmarks"]):
        at = f"benchmarks[{i}]"
        c.kind(b, at, dict, "an object", optional=False)
        c.kind(b.get("fullname"), f"{at}.fullname", str, "a string", optional=False)
        c.kind(b.get("stats"), f"{at}.stats", dict, "an object", optional=False)
        st = b["stats"]
        c.number(st.get("median"), f"{at}.stats.median", optional=False)
        c.number(st.get("stddev"), f"{at}.stats.stddev")
        c.kind(st.get("rounds"), f"{at}.stats.rounds", int, "an integer")
        info = b.get("extra_info")
        c.kind(info, f"{at}.extra_info", dict, "an object")
        info = info or {}
        if info.get("better") is not None and info["better"] not in ("lower", "higher"):
            c.fail(f"{at}.extra_info.better", f"expected 'lower' or 'higher', found "
                                              f"{_short(info['better'])}")
        for key in ("unit", "metric", "nodeid"):
            c.kind(info.get(key), f"{at}.extra_info.{key}", str, "a string")
        c.number(info.get("limit"), f"{at}.extra_info.limit")
        c.number(info.get("bound"), f"{at}.extra_info.bound")
        c.kind(info.get("params"), f"{at}.extra_info.params", dict, "an object")
        rate = info.get("rate")
        if rate is not None:
            ra = f"{at}.extra_info.rate"
            c.kind(rate, ra, dict, "an object")
            c.kind(rate.get("unit"), f"{ra}.unit", str, "a string", optional=False)
            c.number(rate.get("median"), f"{ra}.median", optional=False)
            c.number(rate.get("limit"), f"{ra}.limit")
            c.number(rate.get("stddev"), f"{ra}.stddev")
            c.kind(rate.get("samples"), f"{ra}.samples", list, "a list", optional=False)
            if not rate["samples"] or not all(is_number(x) for x in rate["samples"]):
                c.fail(f"{ra}.samples", "expected a non-empty list of numbers")
    ds = doc.get("dsconform")
    c.kind(ds, "dsconform", dict, "an object")
    ds = ds or {}
    for key, required in (("outcomes", ("nodeid", "outcome")), ("facts", ("nodeid", "name")),
                          ("known_issues", ("id",))):
        c.kind(ds.get(key), f"dsconform.{key}", list, "a list")
        for i, entry in enumerate(ds.get(key) or []):
            at = f"dsconform.{key}[{i}]"
            c.kind(entry, at, dict, "an object", optional=False)
            for name in required:
                c.kind(entry.get(name), f"{at}.{name}", str, "a string", optional=False)
            if key == "outcomes":
                if entry["outcome"] not in OUTCOMES:
                    c.fail(f"{at}.outcome", f"expected one of {', '.join(OUTCOMES)}, found "
                                            f"{_short(entry['outcome'])}")
                for name in ("reason", "must", "known_issue"):
                    c.kind(entry.get(name), f"{at}.{name}", str, "a string")


def read_json(path: Path, error: type[Exception] = ResultsFormatError) -> Any:
    """A results JSON file (summary.json, cluster.json); ``error`` names the file and what is
    wrong with it."""
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"{path}: cannot read: {e}") from None
    except json.JSONDecodeError as e:
        raise error(f"{path}: not JSON ({e}); a node's results folder holds the "
                                  "files a `pytest suites --results DIR` run writes") from None


def read_journal(path: Path) -> list[dict[str, Any]]:
    """Outcomes from records.jsonl; a line cut by the kill that ended the run is skipped."""
    outcomes = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(entry, dict) and isinstance(entry.get("outcome"), dict):
            outcomes.append(entry["outcome"])
    return outcomes
