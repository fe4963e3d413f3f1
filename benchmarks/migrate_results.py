"""One-off (2026-12-04): rewrite the results files written before :mod:`benchmarks.schema` in it.

    python -m benchmarks.migrate_results [--check]

Every measured number is kept: the rows' figures move into the schema's fields (strings such as
"76.8" or "166 ms" become numbers, the unit going to ``extra.unit``; a drift written "2 %" becomes
0.02), the figures the rows came from stay under ``raw``, and whatever else a file held moves
into ``raw`` too. ``met`` is worked out from the ratio and the target the row (or its script)
states; a row without a target keeps ``target`` and ``met`` null. Rows whose run time was not
recorded are dated by day; ``raw.converted`` says from what. A file already in the schema is left
alone; ``--check`` only says which files would change.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from pathlib import Path

from .schema import RESULTS, SCHEMA, check, meets, row

_NUM = re.compile(r"^\s*([-+]?[\d,]*\.?\d+)\s*(.*)$")


def _num(s: str) -> tuple[float, str]:
    """'166 ms' -> (166.0, 'ms'); '1,884' -> (1884.0, '')."""
    m = _NUM.match(s)
    if not m:
        raise ValueError(f"not a number: {s!r}")
    return float(m.group(1).replace(",", "")), m.group(2).strip()


def _target(t: str) -> tuple[float, bool]:
    """'≥ 0.8' -> (0.8, False); '≤ 0.2' -> (0.2, True); '≥ 4×' -> (4.0, False)."""
    m = re.match(r"^([≥≤])\s*([\d.]+)", t)
    if not m:
        raise ValueError(f"not a numeric target: {t!r}")
    return float(m.group(2)), m.group(1) == "≤"


def _drift(s: str) -> float:
    v, unit = _num(s)
    assert unit == "%", s
    return v / 100


def _day(path: Path) -> str:
    """The day the file was last committed (its run's own time was not recorded)."""
    out = subprocess.run(["git", "log", "-1", "--format=%cd", "--date=format-local:%Y-%m-%d %H:%M", "--", str(path)],
                         capture_output=True, text=True, cwd=path.parent, check=True).stdout.strip()
    return out


def _tuple_row(name, ours, peer, ratio, target, drift, flag, date, **extra) -> dict:
    o, unit = _num(ours)
    p, unit_p = _num(peer)
    assert unit == unit_p, (ours, peer)
    d = _drift(drift)
    if target == "reported":
        r = row(name, o, p, float(ratio), drift=d, date=date, unit=unit or "tok/s", note="reported (no target)",
                **extra)
    else:
        tv, lower = _target(target)
        r = row(name, o, p, float(ratio), target, target_value=tv, lower_is_better=lower, drift=d, date=date,
                unit=unit or "tok/s", **extra)
    assert r["busy"] == (flag == "busy"), (name, drift, flag)  # the flag was drift > DRIFT_LIMIT
    if flag in ("met", "missed"):
        assert r["met"] == (flag == "met"), (name, flag)
    return r


def _engine(doc, date):
    return [_tuple_row(n, o, p, ra, t, d, f, date, rpc_per_token=float(rpc), same_tokens=same == "True")
            for n, o, p, ra, t, rpc, same, d, f in doc["rows"]], doc["raw"]


def _seven(doc, date):
    return [_tuple_row(*r, date) for r in doc["rows"]], doc["raw"]


def _dicts(to_row, busy_key=True):
    def conv(doc, date):
        out = []
        for rec in doc["rows"]:
            r = to_row(rec, date)
            if busy_key:
                assert r["busy"] == rec["busy"], rec
            out.append(r)
        rest = {k: v for k, v in doc.items() if k not in ("rows", "raw")}
        return out, {**doc.get("raw", {}), **rest}
    return conv


_PREFIX_SECTIONS = {"TTFT": "ttft", "multi-turn": "chat", "Generate n=4": "n4"}


def _prefix(doc, date):
    out = []
    for r in doc["rows"]:
        sec = next(v for k, v in _PREFIX_SECTIONS.items() if r["name"].startswith(k))
        x = row(r["name"], r["ours"], r["base"], r["ratio"], r["target"], target_value=r["target_value"],
                lower_is_better=r["lower_is_better"], drift=doc["drift"][sec], note=r["note"], date=date)
        assert x["met"] == r["met"], r
        out.append(x)
    raw = {k: v for k, v in doc.items() if k not in ("rows", "raw")}
    raw["sections"] = doc["raw"]
    return out, raw


def _latest_sections(name: str) -> tuple[str, ...]:
    """The sections of ``benchmarks.run`` a row of latest.json was measured in (as run.py now records)."""
    table = [
        ("BatchDecode B=8 (sampled token) via gRPC", ("pair_b8",)),
        ("stub Decode round trip over Session, Go", ("stub_go",)),
        ("stub Decode round trip over Session, Python", ("stub", "floor")),
        ("BatchDecode B=8 step time", ("decode_vs_context",)),
        ("one 800-token prompt", ("prompt_joins",)),
        ("aggregate decode tok/s, 16", ("gen_b16", "pair_gen_b1")),
        ("Generate tok/s ÷ transformers generate(), B=1", ("pair_gen_b1",)),
        ("Generate tok/s ÷ transformers generate(), B=8", ("pair_gen_b8",)),
        ("best aggregate", ("pair_gen_b1", "pair_gen_b8", "gen_b16", "gen_b32", "served_bf16", "served_int8",
                            "llama_cpp", "llama_cpp_batched")),
        ("B=1 tok/s ÷ memory-bandwidth limit, fp32", ("bandwidth", "inproc_b1")),
        ("B=1 tok/s ÷ memory-bandwidth limit", ("bandwidth", "variants")),
        ("prompt-lookup speculative", ("plain", "spec", "plain2", "spec2")),
        ("TTFT / ITL p50·p99, 1 streams", ("pair_gen_b1",)),
        ("TTFT / ITL p50·p99, 8 streams", ("pair_gen_b8",)),
        ("TTFT / ITL p50·p99, 32 streams", ("gen_b32",)),
        ("KV-cache bytes per token", ("kv",)),
        ("server RSS", ("rss",)),
        ("Loads RPC", ("loads", "loads_smollm2")),
        ("KV-event lag", ("kv_lag",)),
    ]
    return next(s for prefix, s in table if name.startswith(prefix))


def _latest(doc, date):
    out = []
    for r in doc["rows"]:
        drift = max(doc["drift"][s] for s in _latest_sections(r["name"]))
        target, note, met = r["target"], r["note"], r["met"]
        if target.startswith("report (") and met is None:  # reported only: no target
            note = (note + "; " if note else "") + f"reported ({target[8:-1]}), no target"
            target = None
        x = row(r["name"], r["ours"], r["base"], r["ratio"], target, met=met, target_value=r["target_value"],
                lower_is_better=r["lower_is_better"], drift=drift, note=note, date=doc["date"])
        if r["target_value"] is not None and r["ratio"] is not None:
            assert meets(r["ratio"], r["target_value"], r["lower_is_better"]) == met, r
        out.append(x)
    return out, {k: v for k, v in doc.items() if k != "rows"}


def converters():
    from . import lora_kernels, lora_rows, structured_overlap, structured_rows

    return {
        "engine_rows": _engine, "engine_rows-release": _engine,
        "handoff_rows": _seven, "llama_cpp_rows": _seven,
        "lora_kernels": _dicts(lora_kernels.to_row), "lora_rows": _dicts(lora_rows.to_row),
        "structured_overlap-hf": _dicts(structured_overlap.to_row),
        "structured_overlap-llama": _dicts(structured_overlap.to_row),
        "structured_rows": _dicts(structured_rows.to_row),
        "prefix_rows": _prefix, "prefix_rows-ttft-chat": _prefix, "prefix_rows-ttft-n4": _prefix,
        "latest": _latest,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args(argv)
    conv = converters()
    for path in sorted(RESULTS.glob("*.json")):
        doc = json.loads(path.read_text())
        if isinstance(doc, dict) and doc.get("schema") == SCHEMA:
            continue
        committed = _day(path)
        rows, raw = conv[path.stem](doc, committed[:10])
        raw = dict(raw)
        raw["converted"] = (f"rewritten in the results schema on 2026-12-04 by benchmarks/migrate_results.py; "
                            f"the old file was last committed {committed} UTC; rows without a recorded run "
                            f"time carry that day")
        new = {"schema": SCHEMA, "name": path.stem, "date": doc.get("date") or committed[:10], "rows": rows,
               "raw": raw}
        new = json.loads(json.dumps(new, default=str))
        bad = check(new)
        assert not bad, (path, bad)
        print(f"{path.name}: {len(rows)} rows{' (would change)' if a.check else ''}")
        if not a.check:
            path.write_text(json.dumps(new, indent=1, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
