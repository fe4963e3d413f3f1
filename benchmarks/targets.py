"""Every row of every benchmark results file in one table, with met / missed / busy.

    python -m benchmarks.targets [--results DIR] [--missed]

Reads ``benchmarks/results/*.json`` (each in the schema of :mod:`benchmarks.schema`); a file that
does not have the schema is named on stderr and the exit status is 1. ``--missed`` shows only the
rows whose target is missed or that ran on a busy machine.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .schema import RESULTS, load, result_files


def status(r: dict) -> str:
    """met / missed / reported (no target), with "busy" when the machine drifted while it ran."""
    s = "reported" if r["target"] is None else ("met" if r["met"] else "missed" if r["met"] is False else "—")
    return f"{s}, busy" if r.get("busy") else s


def _num(x, unit: str = "") -> str:
    if x is None:
        return "—"
    if isinstance(x, str):
        return x
    s = f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.1f}" if abs(x) >= 10 else f"{x:.3g}"
    return f"{s} {unit}" if unit else s


def _cell(x, unit: str = "") -> str:
    return _num(x, unit).replace("|", "\\|")


def table(docs: list[tuple[str, dict]], missed_only: bool = False) -> tuple[str, dict[str, int]]:
    """The Markdown table of every row of ``docs`` (file name, document) and the count per status."""
    lines = ["| file | # | row | ours | peer | ratio | target | status | drift | date |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    counts: dict[str, int] = {}
    for fname, doc in docs:
        for i, r in enumerate(doc["rows"], 1):
            st = status(r)
            counts[st] = counts.get(st, 0) + 1
            if missed_only and not ("missed" in st or "busy" in st):
                continue
            drift = "—" if r["drift"] is None else f"{100 * r['drift']:.0f} %"
            unit = r.get("extra", {}).get("unit", "")
            lines.append(f"| {fname} | {i} | {_cell(r['name'])} | {_cell(r['ours'], unit)} | {_cell(r['peer'], unit)} | "
                         f"{_cell(r['ratio'])} | {_cell(r['target'])} | {st} | {drift} | {r['date']} |")
    return "\n".join(lines), counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS, help="folder of results files")
    ap.add_argument("--missed", action="store_true", help="only missed targets and busy rows")
    a = ap.parse_args(argv)
    docs, bad = [], []
    for path in result_files(a.results):
        try:
            docs.append((path.stem, load(path)))
        except ValueError as e:  # also json.JSONDecodeError
            bad.append(str(e))
    text, counts = table(docs, a.missed)
    print(text)
    print()
    print(f"{sum(counts.values())} rows in {len(docs)} files: "
          + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    for b in bad:
        print(f"not in the results schema: {b}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
