"""Facts whose value changed between two runs ("what silently changed"), each on one line.

A fact is any JSON value a test recorded: an effective default (``1.0``), or a GPU's health
snapshot (ECC counters and every NVLink's state: 2,000 characters). A value whose JSON is at
most ``LONG_FACT_CHARS`` long is shown whole; a longer one by its shape (``{21 fields}``) and by
what changed in it (``2 of 21 fields changed: compute_processes 3 -> 1, nvlinks``). The full
values stay in the comparison's JSON (``dsconform compare --json FILE``).
"""

from __future__ import annotations

import json
from typing import Any

from dsconform.results.changes import CHANGED, FACT, NEW, UNCHANGED, VANISHED, Change

LONG_FACT_CHARS = 100  # a console line's worth: longer values are summarised
SHOWN_FIELDS = 3  # changed fields named in a summary, the rest counted
SHORT_FIELD_CHARS = 24  # a changed field shown as "key old -> new" when both are this short
FULL = "full values in the JSON (--json FILE)"
_ABSENT = object()


def shown(value: Any) -> str:
    """A fact's value as JSON, whole (for the JSON output and short values)."""
    return json.dumps(value, sort_keys=True)


def is_long(value: Any) -> bool:
    return len(shown(value)) > LONG_FACT_CHARS


def shape(value: Any) -> str:
    """A value in a few characters: itself when short, else what it is."""
    if not is_long(value):
        return shown(value)
    if isinstance(value, dict):
        return f"{{{len(value)} fields}}"
    if isinstance(value, list):
        return f"[{len(value)} items]"
    if isinstance(value, str):
        return f"{shown(value[:40])[:-1]}...\" ({len(value)} characters)"
    return f"{type(value).__name__} ({len(shown(value))} characters)"


def what_changed(b: Any, n: Any) -> str:
    """One line saying what differs between two values of a fact, at least one of them long."""
    if isinstance(b, dict) and isinstance(n, dict):
        keys = sorted(set(b) | set(n))
        changed = [k for k in keys if b.get(k, _ABSENT) != n.get(k, _ABSENT)]
        parts = [_field(k, b.get(k, _ABSENT), n.get(k, _ABSENT)) for k in changed[:SHOWN_FIELDS]]
        more = len(changed) - SHOWN_FIELDS
        named = ", ".join(parts) + (f", {more} more" if more > 0 else "")
        return f"{len(changed)} of {len(keys)} fields changed: {named}; {FULL}"
    if isinstance(b, list) and isinstance(n, list):
        differ = sum(1 for x, y in zip(b, n) if x != y) + abs(len(b) - len(n))
        return f"{len(b)} -> {len(n)} items, {differ} differ; {FULL}"
    return f"{shape(b)} -> {shape(n)}; {FULL}"


def _field(key: str, b: Any, n: Any) -> str:
    if b is _ABSENT:
        return f"{key} added"
    if n is _ABSENT:
        return f"{key} removed"
    bs, ns = shown(b), shown(n)
    if max(len(bs), len(ns)) <= SHORT_FIELD_CHARS:
        return f"{key} {bs} -> {ns}"
    return key


def compare_facts(base: dict[str, Any], new: dict[str, Any]) -> list[Change]:
    """Every fact of either run (``"stable id::fact" -> value``): changed, unchanged, only in
    one run."""
    out = []
    for key in sorted(set(base) | set(new)):
        if key not in new:
            out.append(Change(VANISHED, key, "not recorded in NEW", FACT,
                              base=shape(base[key]), base_value=base[key]))
        elif key not in base:
            out.append(Change(NEW, key, "not recorded in BASE", FACT, new=shape(new[key]),
                              new_value=new[key]))
        elif base[key] != new[key]:
            b, n = base[key], new[key]
            if is_long(b) or is_long(n):
                bs, ns = shape(b), what_changed(b, n)
            else:
                bs, ns = shown(b), shown(n)
            out.append(Change(CHANGED, key, f"{bs} -> {ns}", FACT, base=bs, new=ns,
                              base_value=b, new_value=n))
        else:
            out.append(Change(UNCHANGED, key, shape(new[key]), FACT))
    return out
