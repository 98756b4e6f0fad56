"""Known upstream issues: DeepSpeed defects that a node cannot fix, in ONE registry.

A known issue turns the cases it covers into strict xfails, for the DeepSpeed versions it was
verified to affect and no others:

- on an affected version the case is expected to fail, and only the way the issue fails: an
  assertion whose message matches the entry's ``failure`` pattern (``expects``). Anything else
  (a rank that crashed or hung, a NaN, an error of another kind) FAILS the run, saying which
  issue covered the case and what it expected, so a known issue never hides a new defect in the
  cells it covers. The summary and the results JSON list the issue once, with the number of
  cases it covered;
- where it unexpectedly passes (a patched build), the strict xfail FAILS and says to narrow or
  drop the entry;
- on a version outside ``deepspeed``, the case runs as a normal test. A release that is still
  broken then fails red until someone verifies it and widens the range: the registry only ever
  holds what was seen.

Tolerances are never loosened for a known issue: the case keeps its check and fails it.

Two kinds of entry (``kind``): ``upstream``, a defect of DeepSpeed itself; ``torch``, an
incompatibility of DeepSpeed releases with torch releases ("DeepSpeed 0.18.9 with torch >=
2.13"): the same code works beside an older torch, so the entry names the torch versions it was
seen with (``torch``, a specifier with a lower bound) and covers its cases only where both the
DeepSpeed and the torch installed are in range. Either kind links upstream's fix where there is
one (``fixed_in``: the first release that carries it).

Cases are patterns over ``FILE::TEST[PARAMS]`` (the test file's name, not its directory) in
which only ``*`` is special (brackets are the literal brackets of a parametrized id), so the
registry names cells of a matrix without listing them one by one.
"""

from __future__ import annotations

import functools

from dsconform.gate import known_issues_check
from dsconform.gate.known_issue import (
    KINDS,
    TORCH,
    UPSTREAM,
    KnownIssue,
    KnownIssueFailure,
    installed_torch,
)
from dsconform.gate.registry import (
    checkpoint,
    clipping,
    deepnvme,
    moe,
    observability,
    onebit,
    optimizers,
    state,
    training,
)

# The entry's type lives in dsconform/gate/known_issue.py; its names are the registry's too.
__all__ = ["KINDS", "KNOWN_ISSUES", "TORCH", "UPSTREAM", "KnownIssue", "KnownIssueFailure",
           "by_id", "case_name", "check_registry", "expected_failure", "installed_torch",
           "issues_for"]

KNOWN_ISSUES: tuple[KnownIssue, ...] = (
    training.ISSUES + checkpoint.ISSUES + deepnvme.ISSUES + onebit.ISSUES
    + observability.ISSUES + moe.ISSUES + optimizers.ISSUES + state.ISSUES + clipping.ISSUES
)

def case_name(path_name: str, test_name: str) -> str:
    """The string cases are matched against: ``test_zero.py::test_zero_matches_ddp[cpu-z0-...]``."""
    return f"{path_name}::{test_name}"


def issues_for(case: str, deepspeed_version: str | None,
               issues: tuple[KnownIssue, ...] = KNOWN_ISSUES,
               torch_version: str | None = None) -> list[KnownIssue]:
    """The registry's issues that cover ``case`` on this DeepSpeed version (and torch:
    default the installed one)."""
    return [ki for ki in _affecting(issues, deepspeed_version, torch_version) if ki.covers(case)]


@functools.lru_cache(maxsize=32)
def _affecting(issues: tuple[KnownIssue, ...], deepspeed_version: str | None,
               torch_version: str | None) -> tuple[KnownIssue, ...]:
    """The issues of this DeepSpeed and torch (asked for each of a collection's cases)."""
    return tuple(ki for ki in issues if ki.affects(deepspeed_version, torch_version))


def by_id(issue_id: str, issues: tuple[KnownIssue, ...] = KNOWN_ISSUES) -> KnownIssue:
    for ki in issues:
        if ki.id == issue_id:
            return ki
    raise KeyError(f"no known issue {issue_id!r} (known: {', '.join(k.id for k in issues)})")


# The registry's rules live beside it (dsconform/gate/known_issues_check.py): how it checks
# itself, and what a covered case's exception becomes.
def check_registry(issues: tuple[KnownIssue, ...] | None = None) -> list[str]:
    """Every defect of the registry (default: the shipped one), one line each (empty: sound)."""
    return known_issues_check.check_registry(KNOWN_ISSUES if issues is None else issues)


expected_failure = known_issues_check.expected_failure
