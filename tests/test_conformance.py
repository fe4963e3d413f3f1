"""The language-neutral conformance scenario (tests/conformance/scenario.json) through the Python
client, against a fresh ``ferrum-service serve`` subprocess on a loopback port."""

from __future__ import annotations

from tests.conformance.harness import scenario_models, start_server
from tests.conformance.run_python import run_scenario


def test_conformance_scenario():
    lines: list[str] = []
    with start_server(scenario_models()) as srv:
        passed, failed, records = run_scenario(srv.target, out=lines.append)
    print("\n".join(lines))
    bad = [f"{r['id']}: {r['error']}" for r in records if r["status"] == "FAIL"]
    assert not bad, f"{failed} conformance step(s) failed:\n" + "\n".join(bad)
    assert passed >= 40
