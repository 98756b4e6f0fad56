"""The known-issues registry's rules (the registry: dsconform/gate/known_issues.py):
``check_registry`` names every defect of a registry's entries, one line each (the project's
tests hold the shipped registry's empty); ``expected_failure`` says what a covered case's
exception becomes.
"""

from __future__ import annotations

import re

from dsconform.base import versions
from dsconform.gate.known_issue import KINDS, TORCH, KnownIssueFailure

_ID_RE = re.compile(r"^[A-Z0-9][A-Z0-9-]+$")


def check_registry(issues: tuple) -> list[str]:
    """Every defect of the registry ``issues``, one line each (empty: sound)."""
    problems, ids = [], set()
    for ki in issues:
        if not _ID_RE.match(ki.id):
            problems.append(f"{ki.id!r}: id must be upper case letters, digits and dashes")
        if ki.id in ids:
            problems.append(f"{ki.id}: duplicate id")
        ids.add(ki.id)
        try:
            spec = versions.specifier(ki.deepspeed)
            if not any(s.operator in ("<", "<=", "==") for s in spec):
                problems.append(f"{ki.id}: deepspeed {ki.deepspeed!r} has no upper bound: scope "
                                "it to the versions it was verified on")
        except ValueError as e:
            problems.append(f"{ki.id}: deepspeed: {e}")
        if ki.kind not in KINDS:
            problems.append(f"{ki.id}: kind must be one of {', '.join(KINDS)}, found "
                            f"{ki.kind!r}")
        if ki.kind == TORCH and not ki.torch:
            problems.append(f"{ki.id}: a torch incompatibility must name the torch versions "
                            f"it was seen with (torch='>=2.13')")
        if ki.torch:
            try:
                tspec = versions.specifier(ki.torch)
                if not any(s.operator in (">", ">=", "==") for s in tspec):
                    problems.append(f"{ki.id}: torch {ki.torch!r} has no lower bound: name the "
                                    "first torch it was seen with")
            except ValueError as e:
                problems.append(f"{ki.id}: torch: {e}")
        if ki.fixed_in:
            fixed = versions.parse(ki.fixed_in)
            if fixed is None:
                problems.append(f"{ki.id}: fixed_in {ki.fixed_in!r} is not a version")
            elif _in_range(fixed, ki.deepspeed):
                problems.append(f"{ki.id}: fixed_in {ki.fixed_in} lies inside its own range "
                                f"{ki.deepspeed}: the fix cannot be there")
        if not ki.link.startswith("https://"):
            problems.append(f"{ki.id}: link must be an https URL, found {ki.link!r}")
        if not ki.cases or not all("::" in c for c in ki.cases):
            problems.append(f"{ki.id}: cases must be FILE::TEST[PARAMS] patterns")
        if not ki.failure:
            problems.append(f"{ki.id}: failure must say how the cases fail (a pattern of the "
                            f"assertion's message): without it no failure counts as the issue")
        else:
            try:
                re.compile(ki.failure)
            except re.error as e:
                problems.append(f"{ki.id}: failure {ki.failure!r} is not a regular expression: "
                                f"{e}")
    return problems


def _in_range(v: versions.Version, spec: str) -> bool:
    try:
        return v in versions.specifier(spec)
    except ValueError:
        return False  # named by the deepspeed check


def expected_failure(issues: list, exc: BaseException) -> BaseException:
    """What a covered case's exception becomes: a KnownIssueFailure (the strict xfail's
    expectation) when one of the case's issues fails this way (an intermittent issue's: an
    xfail of its own), else an AssertionError that says
    which issue covered the case, what it expected and what happened instead (a real failure)."""
    if isinstance(exc, BaseExceptionGroup):
        # hypothesis reports an example that failed once and passed on its replay as a group
        # (FlakyFailure): a race's signature; anything else stays the group it was.
        leaves = [e for e in _leaves(exc) if isinstance(e, AssertionError)]
        hit = [e for e in leaves for ki in issues if ki.intermittent and ki.expects(e)]
        return expected_failure(issues, hit[0]) if hit else exc
    for ki in issues:
        if ki.expects(exc):
            if ki.intermittent:  # no strict xfail mark: the failure itself is the xfail
                import pytest

                out: BaseException = pytest.xfail.Exception(f"{ki.reason}: {exc}")
            else:
                out = KnownIssueFailure(f"{ki.id}: {exc}")
            out.issue_id = ki.id  # type: ignore[attr-defined]  # which issue it was
            return out
    wanted = "; ".join(f"{ki.id} fails matching {ki.failure!r}" for ki in issues)
    return AssertionError(f"covered by known issue(s) ({wanted}), but failed another way, which "
                          f"the issue does not explain: {type(exc).__name__}: {exc}")


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    return [leaf for e in group.exceptions
            for leaf in (_leaves(e) if isinstance(e, BaseExceptionGroup) else [e])]
