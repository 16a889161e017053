"""forgepack's one TOML writer (recipes, manifests, the gate's recipe copy).

Written here rather than with `tomli_w`: the GPU machines that build packs may not have it, and one
writer keeps every file forgepack writes in one layout (guard arguments as one-line inline tables).
Only the build side writes TOML; the pack runtime only reads it (`tomllib`, or `tomli` on 3.10), so
the writer need not live in the runtime. The subset needed (tables, arrays of tables, inline tables,
strings, numbers, booleans, arrays) is small; `tomllib.loads(dumps(d)) == d` for plain data.
"""

from __future__ import annotations

import json
import math
from typing import Any


def dumps(doc: dict[str, Any]) -> str:
    """TOML for plain data (None values must already be dropped). Tables nest as [a.b] and [[a.b]]
    two levels deep; deeper dicts are written inline so each guard argument stays on one line."""
    lines: list[str] = []
    _table(lines, (), doc)
    return "\n".join(lines).strip() + "\n"


def _is_table_array(v: Any) -> bool:
    return isinstance(v, list | tuple) and len(v) > 0 and all(isinstance(x, dict) for x in v)


def _table(lines: list[str], path: tuple[str, ...], d: dict[str, Any]) -> None:
    inline = len(path) >= 2
    nested = {k: v for k, v in d.items() if not inline and (isinstance(v, dict) or _is_table_array(v))}
    for k, v in d.items():
        if k not in nested:
            lines.append(f"{_key(k)} = {_value(v)}")
    for k, v in nested.items():
        sub = (*path, k)
        if isinstance(v, dict):
            lines += ["", f"[{'.'.join(map(_key, sub))}]"]
            _table(lines, sub, v)
        else:
            for item in v:
                lines += ["", f"[[{'.'.join(map(_key, sub))}]]"]
                _table(lines, sub, item)


def _key(k: str) -> str:
    return k if k and all(c.isalnum() or c in "_-" for c in k) else json.dumps(k)


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} {v!r} to TOML")
