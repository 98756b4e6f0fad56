"""One entry of the known-issues registry (dsconform/gate/known_issues.py): what a known issue
is, how it recognises its own failure, and which DeepSpeed and torch releases it covers. The
registry's module holds the entries; this one their type.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
from dataclasses import dataclass
from typing import Any

from dsconform.base import versions

UPSTREAM, TORCH = "upstream", "torch"
KINDS = (UPSTREAM, TORCH)


class KnownIssueFailure(AssertionError):
    """A covered case failed the way its known issue fails: what the strict xfail expects."""


@dataclass(frozen=True)
class KnownIssue:
    id: str          # stable, upper case: DS-8393-Z0-FP16-UNSCALED
    title: str       # one line: what goes wrong
    deepspeed: str   # the versions it was verified on, as a specifier: ">=0.19.6,<=0.19.8"
    link: str        # the upstream issue or pull request
    cases: tuple[str, ...]
    seen: str        # where and how it was observed
    # How the covered cases fail: a regular expression searched in the assertion's message
    # (as the case's check words it, seen on a real run). Nothing else counts as this issue.
    # A match with named groups ``gain`` and ``scale`` counts only if gain x scale is 1 (1%).
    failure: str = ""
    kind: str = UPSTREAM  # UPSTREAM: DeepSpeed's defect; TORCH: a DeepSpeed x torch mismatch
    torch: str = ""  # TORCH: the torch versions it was seen with, as a specifier (">=2.13")
    fixed_in: str = ""  # the first DeepSpeed release that carries upstream's fix, if any
    # A race: the failure shows in some runs only. A covered case that fails its way is an
    # xfail, one that passes passes (it is not a fixed build); any other failure still FAILS.
    intermittent: bool = False

    def expects(self, exc: BaseException) -> bool:
        """Is ``exc`` this issue's failure? An assertion (a rank's error comes back as one)
        whose message matches ``failure``; a timeout never does."""
        from dsconform.harness.errors import RankTimeout

        if not isinstance(exc, AssertionError) or isinstance(exc, RankTimeout) or \
                not self.failure:
            return False
        for m in re.finditer(self.failure, str(exc), re.DOTALL):
            groups = m.groupdict()
            if groups.get("gain") is None or groups.get("scale") is None:
                return True
            # A pattern naming a gain and the loss scale in force: the gain must be
            # 1 / scale (within 1%: fp16 rounding), the signature of a loss never scaled.
            if abs(float(groups["gain"]) * float(groups["scale"]) - 1) <= 0.01:
                return True
        return False

    def affects(self, deepspeed_version: str | None, torch_version: str | None = None) -> bool:
        """This DeepSpeed (and, for a torch incompatibility, this torch: default the installed
        one) is one the entry was verified on."""
        v = versions.parse(deepspeed_version)
        if v is None or v not in versions.specifier(self.deepspeed):
            return False
        if not self.torch:
            return True
        t = versions.public(torch_version if torch_version is not None else installed_torch())
        return t is not None and t in versions.specifier(self.torch)

    def covers(self, case: str) -> bool:
        return any(_pattern(p).fullmatch(case) for p in self.cases)

    @property
    def reason(self) -> str:
        """The xfail reason: also what an unexpected pass prints, so it says what to do then."""
        what = ("known upstream issue" if self.kind == UPSTREAM else
                f"known incompatibility with torch {self.torch}")
        fixed = f"; fixed in DeepSpeed {self.fixed_in}" if self.fixed_in else ""
        if self.intermittent:
            return (f"{what} {self.id} (intermittent): {self.title} ({self.link}); verified on "
                    f"DeepSpeed {self.deepspeed}{self._with_torch}{fixed}. A run that passes "
                    f"proves nothing here: the failure is timing-dependent")
        return (f"{what} {self.id}: {self.title} ({self.link}); verified on "
                f"DeepSpeed {self.deepspeed}{self._with_torch}{fixed}. If this case passes, "
                f"this build is fixed: narrow or drop the entry in dsconform/gate/known_issues.py")

    @property
    def _with_torch(self) -> str:
        return f" with torch {self.torch}" if self.torch else ""

    def summary(self) -> dict[str, str]:
        """What the results list of an entry hit (summary.json, benchmarks.json)."""
        out: dict[str, Any] = {"title": self.title, "link": self.link,
                               "deepspeed": self.deepspeed, "kind": self.kind}
        out.update({k: v for k, v in (("torch", self.torch), ("fixed_in", self.fixed_in),
                                      ("intermittent", self.intermittent)) if v})
        return out


def installed_torch() -> str | None:
    """The installed torch's version, from its package metadata (no import of torch)."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def _pattern(case: str) -> re.Pattern[str]:
    return re.compile(".*".join(re.escape(part) for part in case.split("*")))
