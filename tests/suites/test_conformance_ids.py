"""Conformance ids (ZERO-EQ-1, CKPT-CLIENT-1) are the suites' stable names: a result, a
comparison and a known issue name a check by them. Each one a suite lists after "Stable ids:" or
opens a test's docstring with MUST be documented in docs/suites.md, and an id names one check:
listed by one suite, leading one test."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUITES = sorted((ROOT / "suites").glob("test_*.py"))
DOC = ROOT / "docs" / "suites.md"
ID = r"[A-Z][A-Z0-9]*(?:-[A-Z0-9]+)*-\d+"
LEADING = re.compile(rf"^({ID})\b")
LISTED = re.compile(rf"\b({ID})(?:\.\.(\d+))?\b")
#: Ids that lead more than one test, with the tests: the results of each are already filed under
#: the id (``dsconform compare``, the radar's timelines), so the id stays.
SHARED = {
    "LOSS-SCALE-1": {"test_scaler_follows_model", "test_scaler_follows_model_on_sequence"},
}


def _listed(docstring: str) -> list[str]:
    """The ids after "Stable ids:", to the end of that paragraph; ``X-1..4`` is X-1 to X-4."""
    if "Stable ids:" not in docstring:
        return []
    paragraph = docstring.split("Stable ids:", 1)[1].split("\n\n", 1)[0]
    ids = []
    for first, last in LISTED.findall(paragraph):
        if not last:
            ids.append(first)
            continue
        stem, start = first.rsplit("-", 1)
        ids.extend(f"{stem}-{n}" for n in range(int(start), int(last) + 1))
    return ids


def _suite_ids() -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(id -> the suites that list it, id -> the tests whose docstring it leads)."""
    listed: dict[str, list[str]] = defaultdict(list)
    leading: dict[str, list[str]] = defaultdict(list)
    for path in SUITES:
        tree = ast.parse(path.read_text())
        for cid in _listed(ast.get_docstring(tree) or ""):
            listed[cid].append(path.name)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
                m = LEADING.match(ast.get_docstring(node) or "")
                if m:
                    leading[m.group(1)].append(f"{path.name}::{node.name}")
    return listed, leading


def test_the_suites_name_their_checks():
    listed, leading = _suite_ids()
    assert len(leading) > 50 and len(listed) > 20, (len(leading), len(listed))


def test_every_id_is_in_the_suites_doc():
    listed, leading = _suite_ids()
    doc = DOC.read_text()
    missing = sorted(cid for cid in set(listed) | set(leading) if f"`{cid}`" not in doc)
    assert not missing, f"docs/suites.md does not name {missing}"


def test_an_id_is_listed_by_one_suite():
    listed, _ = _suite_ids()
    twice = {cid: where for cid, where in listed.items() if len(where) > 1}
    assert not twice, twice


def test_an_id_leads_one_test():
    _, leading = _suite_ids()
    many = {cid: tests for cid, tests in leading.items() if len(tests) > 1
            and {t.split("::")[1] for t in tests} != SHARED.get(cid)}
    assert not many, many


def test_a_listed_id_leads_a_test():
    listed, leading = _suite_ids()
    orphans = sorted(set(listed) - set(leading))
    assert not orphans, f"listed after 'Stable ids:', but no test's docstring opens with {orphans}"
