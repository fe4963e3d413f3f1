"""The one shape of a benchmark results file, and its one writer.

Every script under ``benchmarks/`` writes ``results/NAME.json`` through :func:`write_rows`::

    {"schema": "ferrum-bench/1", "name": NAME, "date": "2026-12-04 07:00 UTC",
     "rows": [ROW, ...], "raw": {every measured figure the rows came from, load averages, ...}}

and each ``ROW`` is made by :func:`row`::

    {"name": str,                     what was measured, ours ÷ peer
     "ours": number | str | null,     our figure (a string when it carries a unit or two numbers)
     "peer": number | str | null,     the baseline or peer figure
     "ratio": number | null,          ours ÷ peer (or as the name says)
     "target": str | null,            e.g. "≥ 0.9"; null: reported only
     "met": bool | null,              null when there is no target
     "drift": number | null,          machine drift while the row ran (|after − before| ÷ before of
                                      a fixed reference workload); null: not probed
     "busy": bool | null,             drift > DRIFT_LIMIT: the figure is not to be trusted
     "note": str,
     "date": str,                     when it was measured ("YYYY-MM-DD HH:MM UTC")
     "extra": {...}}                  optional: fields one script needs (target_value, RPCs/token...)

``python -m benchmarks.targets`` prints every row of every results file.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
from pathlib import Path

SCHEMA = "ferrum-bench/1"
RESULTS = Path(__file__).resolve().parent / "results"
#: Drift of the reference workload above which a row is flagged ``busy``.
DRIFT_LIMIT = 0.15
FIELDS = ("name", "ours", "peer", "ratio", "target", "met", "drift", "busy", "note", "date")
_OPTIONAL = ("extra",)
_NUM = (int, float)


def now() -> str:
    """The time a row is measured, as rows record it."""
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def meets(ratio: float | None, target_value: float | None, lower_is_better: bool = False) -> bool | None:
    """Whether ``ratio`` meets a numeric target (None without a target or a ratio)."""
    if ratio is None or target_value is None or (isinstance(ratio, float) and math.isnan(ratio)):
        return None
    return ratio <= target_value if lower_is_better else ratio >= target_value


def row(name: str, ours, peer, ratio: float | None = None, target: str | None = None, *,
        met: bool | None = None, target_value: float | None = None, lower_is_better: bool = False,
        drift: float | None = None, busy: bool | None = None, note: str = "", date: str | None = None,
        **extra) -> dict:
    """One result row. ``met`` defaults to ``ratio`` against ``target_value`` (kept in ``extra``
    with ``lower_is_better``); ``busy`` to ``drift > DRIFT_LIMIT``; ``date`` to now; any other
    keyword goes to ``extra``."""
    if met is None and target is not None:
        met = meets(ratio, target_value, lower_is_better)
    if busy is None and drift is not None:
        busy = drift > DRIFT_LIMIT
    if target_value is not None:
        extra = {"target_value": target_value, "lower_is_better": lower_is_better, **extra}
    r = {"name": name, "ours": ours, "peer": peer, "ratio": ratio, "target": target, "met": met,
         "drift": drift, "busy": busy, "note": note, "date": date or now()}
    if extra:
        r["extra"] = extra
    return r


def problems(r) -> list[str]:
    """What is wrong with one row (empty: it has the schema)."""
    if not isinstance(r, dict):
        return [f"a row is a {type(r).__name__}, not an object"]
    out = [f"missing {k!r}" for k in FIELDS if k not in r]
    out += [f"unknown field {k!r}" for k in r if k not in FIELDS + _OPTIONAL]
    if out:
        return out

    def want(k, ok, what):
        if not ok(r[k]):
            out.append(f"{k} = {r[k]!r}: not {what}")

    want("name", lambda v: isinstance(v, str) and v, "a non-empty string")
    for k in ("ours", "peer"):
        want(k, lambda v: v is None or isinstance(v, (str, *_NUM)) and not isinstance(v, bool), "a number, string or null")
    for k in ("ratio", "drift"):
        want(k, lambda v: v is None or isinstance(v, _NUM) and not isinstance(v, bool), "a number or null")
    want("target", lambda v: v is None or isinstance(v, str) and v, "a non-empty string or null")
    for k in ("met", "busy"):
        want(k, lambda v: v is None or isinstance(v, bool), "true, false or null")
    want("note", lambda v: isinstance(v, str), "a string")
    want("date", lambda v: isinstance(v, str) and len(v) >= 10, "a date string")
    if "extra" in r:
        want("extra", lambda v: isinstance(v, dict), "an object")
    if r["target"] is None and r["met"] is not None:
        out.append(f"met = {r['met']!r} without a target")
    if r["drift"] is not None and r["busy"] is None:
        out.append("drift without busy")
    return out


def check(doc) -> list[str]:
    """What is wrong with a whole results file (empty: it has the schema)."""
    if not isinstance(doc, dict):
        return ["not a JSON object"]
    out = []
    if doc.get("schema") != SCHEMA:
        out.append(f"schema = {doc.get('schema')!r}, expected {SCHEMA!r}")
    extra_keys = set(doc) - {"schema", "name", "date", "rows", "raw"}
    if extra_keys:
        out.append(f"unknown top-level keys {sorted(extra_keys)} (they belong in raw)")
    if not isinstance(doc.get("name"), str) or not isinstance(doc.get("date"), str):
        out.append("name and date must be strings")
    if not isinstance(doc.get("raw"), dict):
        out.append("raw must be an object")
    rows = doc.get("rows")
    if not isinstance(rows, list):
        return out + ["rows must be a list"]
    for i, r in enumerate(rows):
        out += [f"rows[{i}]: {p}" for p in problems(r)]
    return out


def load(path: Path) -> dict:
    """A results file, checked (ValueError naming every problem)."""
    doc = json.loads(Path(path).read_text())
    bad = check(doc)
    if bad:
        raise ValueError(f"{path}: " + "; ".join(bad))
    return doc


def result_files(folder: Path = RESULTS) -> list[Path]:
    return sorted(Path(folder).glob("*.json"))


def _plain(x):
    """JSON-safe: NaN / inf become null (JSON has neither)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def write_rows(name: str, rows: list[dict], raw: dict, *, folder: Path = RESULTS, date: str | None = None) -> Path:
    """Write ``results/NAME.json`` in the schema (rows checked first: a script that builds a bad
    row fails before it overwrites anything), with the load average after the run in ``raw``
    next to the one before; print both load averages."""
    raw = dict(raw)
    raw.setdefault("load_after", os.getloadavg())
    doc = _plain({"schema": SCHEMA, "name": name, "date": date or now(), "rows": rows,
                  "raw": json.loads(json.dumps(raw, default=str))})
    bad = check(doc)
    if bad:
        raise ValueError(f"results/{name}.json would not have the schema: " + "; ".join(bad))
    out = Path(folder) / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    print(f"load average before {raw.get('load_before')}, after {raw['load_after']}")
    return out
