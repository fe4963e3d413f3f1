"""Benchmark results files: every one in the one schema (``benchmarks/schema.py``), written by the
one writer, and ``python -m benchmarks.targets`` tables every row. Nothing is measured here."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import schema
from benchmarks.report import markdown
from benchmarks.targets import status

REPO = Path(__file__).resolve().parents[1]
FILES = schema.result_files()


def test_there_are_results_files():
    assert len(FILES) >= 10, FILES


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_results_file_has_the_schema(path):
    doc = schema.load(path)  # raises naming every problem
    assert doc["name"] == path.stem and doc["rows"], path
    for r in doc["rows"]:
        if r["target"] is None:
            assert r["met"] is None, r
        if r["drift"] is not None:
            assert r["busy"] == (r["drift"] > schema.DRIFT_LIMIT), r
        tv = r.get("extra", {}).get("target_value")
        if tv is not None and isinstance(r["ratio"], float):
            # met agrees with the ratio and the numeric target (a row may add a condition: only "no")
            ok = schema.meets(r["ratio"], tv, r["extra"].get("lower_is_better", False))
            assert r["met"] in (ok, False), r


def test_report_prints_every_row_of_every_file():
    out = subprocess.run([sys.executable, "-m", "benchmarks.targets"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    table = [ln for ln in lines if ln.startswith("| ") and not ln.startswith("| file ")]
    want = [(p.stem, i, r) for p in FILES for i, r in enumerate(schema.load(p)["rows"], 1)]
    assert len(table) == len(want)
    for (stem, i, r), ln in zip(want, table):
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", ln)[1:-1]]
        assert cells[0] == stem and cells[1] == str(i), ln
        assert cells[2] == r["name"].replace("|", "\\|"), ln
        assert cells[6] == (r["target"] or "—").replace("|", "\\|"), ln
        assert cells[7] == status(r), ln
    assert f"{len(want)} rows in {len(FILES)} files" in out.stdout


def test_status_words():
    r = schema.row("x", 1.0, 2.0, 0.5, "≥ 0.9", target_value=0.9, drift=0.01)
    assert status(r) == "missed" and r["busy"] is False
    assert status(schema.row("x", 1.0, 1.0, 1.0, "≥ 0.9", target_value=0.9, drift=0.5)) == "met, busy"
    assert status(schema.row("x", 1.0, 1.0, 1.0)) == "reported"


def test_a_bad_file_is_named_and_fails_the_report(tmp_path):
    schema.write_rows("good", [schema.row("a", 1, 2, 0.5)], {"load_before": [0, 0, 0]}, folder=tmp_path)
    (tmp_path / "old.json").write_text(json.dumps({"rows": [["name", "1.0", "2.0"]], "raw": {}}))
    out = subprocess.run([sys.executable, "-m", "benchmarks.targets", "--results", str(tmp_path)], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "old.json" in out.stderr and "schema" in out.stderr
    assert "| good | 1 | a |" in out.stdout and "1 rows in 1 files" in out.stdout


@pytest.mark.parametrize("change, problem", [
    (lambda r: r.pop("peer"), "missing 'peer'"),
    (lambda r: r.update(met=True, target=None), "without a target"),
    (lambda r: r.update(ratio="0.5"), "ratio"),
    (lambda r: r.update(busy=None), "drift without busy"),
    (lambda r: r.update(met="yes"), "met"),
    (lambda r: r.update(base=1.0), "unknown field 'base'"),
    (lambda r: r.update(name=""), "name"),
])
def test_schema_refuses_bad_rows(tmp_path, change, problem):
    r = schema.row("a", 1.0, 2.0, 0.5, "≥ 0.4", target_value=0.4, drift=0.01)
    assert schema.problems(r) == []
    change(r)
    bad = schema.problems(r)
    assert any(problem in p for p in bad), bad
    with pytest.raises(ValueError, match="schema"):
        schema.write_rows("bad", [r], {}, folder=tmp_path)
    assert not (tmp_path / "bad.json").exists()  # refused before anything was written


def test_write_rows_round_trip(tmp_path):
    rows = [schema.row("a", 3.0, 2.0, 1.5, "≥ 1.2", target_value=1.2, drift=0.2, unit="tok/s"),
            schema.row("b", "1 / 2 ms", None, float("nan"))]
    path = schema.write_rows("x", rows, {"load_before": [1, 1, 1], "runs": [1.5, 2.5]}, folder=tmp_path)
    doc = schema.load(path)
    a, b = doc["rows"]
    assert a["met"] is True and a["busy"] is True and a["extra"] == {"target_value": 1.2, "lower_is_better": False,
                                                                     "unit": "tok/s"}
    assert b["ratio"] is None and b["target"] is None and b["met"] is None  # NaN is not JSON
    assert doc["raw"]["runs"] == [1.5, 2.5] and "load_after" in doc["raw"]


def test_every_script_writes_through_the_one_writer():
    """No benchmark script writes a results file of its own (only schema.write_rows, and the
    one-off migration, do)."""
    for p in sorted((REPO / "benchmarks").glob("*.py")):
        if p.name in ("schema.py", "migrate_results.py"):
            continue
        src = p.read_text()
        assert not re.search(r"write_text\(\s*json\.dumps|json\.dump\(", src), f"{p.name} writes JSON itself"


def test_latest_still_renders_as_markdown():
    doc = schema.load(schema.RESULTS / "latest.json")
    md = markdown({**doc["raw"], "rows": doc["rows"]})
    assert md.count("\n| ") >= len(doc["rows"]) and doc["rows"][0]["name"] in md
