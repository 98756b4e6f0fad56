"""Version numbers, parsed and ordered the one way: PEP 440 through ``packaging``.

Strings never compare as versions here: "0.19.10" > "0.19.9" and "2.28.9" < "2.28.10" only hold
for parsed versions. A local build tag ("2.11.0+cu130") is kept by ``parse`` and dropped by
``public`` (package metadata often omits it).
"""

from __future__ import annotations

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

__all__ = ["TORCH_RUN_WITH", "InvalidSpecifier", "InvalidVersion", "SpecifierSet", "Version",
           "at_least", "parse", "public", "specifier", "torch_note"]

#: The torch releases (major.minor) the suite has been run with; docs/install.md says where.
#: Another torch is judged all the same: the header and the summary only say so.
TORCH_RUN_WITH = ("2.7", "2.8", "2.10", "2.11", "2.12", "2.13", "2.14")


def parse(text: str | None) -> Version | None:
    """The version, or None when ``text`` is empty or not a version ("unknown", "abc")."""
    if not text:
        return None
    try:
        return Version(str(text))
    except InvalidVersion:
        return None


def public(text: str | None) -> Version | None:
    """The version without its local build tag: "2.11.0+cu130" -> 2.11.0."""
    v = parse(text)
    return Version(v.public) if v is not None else None


def at_least(found: str | None, minimum: str) -> bool:
    """found >= minimum; False when found is missing or not a version."""
    v = parse(found)
    return v is not None and v >= Version(minimum)


def specifier(spec: str) -> SpecifierSet:
    """A specifier set such as ">=0.19.6,<=0.19.8"; ValueError naming the text when invalid."""
    try:
        return SpecifierSet(spec)
    except InvalidSpecifier:
        raise ValueError(f"{spec!r} is not a version specifier such as '>=0.19,<0.19.7'") from None


def torch_note(found: str | None) -> str:
    """One line for the header and the summary: whether ``found`` is a torch release the suite
    has been run with."""
    v = public(found)
    listed = ", ".join(TORCH_RUN_WITH)
    if v is not None and f"{v.major}.{v.minor}" in TORCH_RUN_WITH:
        return f"torch {found}: a release this suite has been run with ({listed})"
    return (f"torch {found or 'unknown'}: not a release this suite has been run with "
            f"({listed}); its results are judged all the same (docs/install.md)")
