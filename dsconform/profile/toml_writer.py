"""Write the small TOML subset profiles use (tables, arrays of tables, scalars, arrays of scalars).

The standard library reads TOML but does not write it; a profile is simple enough not to need a
dependency for this.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any


def _scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"TOML cannot hold {v!r}")
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_scalar(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def _is_table_array(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, Mapping) for x in v)


def dumps(data: Mapping[str, Mapping[str, Any]], comments: Mapping[str, str] | None = None) -> str:
    """Render ``{table: {key: value}}``; ``comments[table]`` is written above that table."""
    comments = comments or {}
    out: list[str] = []
    for table, body in data.items():
        if comments.get(table):
            out.append(comments[table])
        out.append(f"[{table}]")
        nested = []
        for key, value in body.items():
            if _is_table_array(value):
                nested.append((key, value))
            else:
                out.append(f"{key} = {_scalar(value)}")
        for key, items in nested:
            for item in items:
                out.append("")
                out.append(f"[[{table}.{key}]]")
                out.extend(f"{k} = {_scalar(v)}" for k, v in item.items())
        out.append("")
    return "\n".join(out)
