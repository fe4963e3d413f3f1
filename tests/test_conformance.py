"""The language-neutral conformance scenario (tests/conformance/scenario.json) through the Python
client, against a fresh ``ferrum-service serve`` subprocess on a loopback port: once with the
top-level models (``tiny`` on transformers) and once per profile (``llama-cpp``: ``tiny`` on llama.cpp)."""

from __future__ import annotations

import pytest

from tests.conformance.harness import peer_args, profiles, scenario_models, scenario_vars, server_args, start_server
from tests.conformance.run_python import run_scenario

from .support.packaged import smollm2_gguf


def _skip_without_llama_cpp(profile: str) -> None:
    if profile != "llama-cpp":
        return
    smollm2_gguf(llama_cpp=True)


@pytest.mark.parametrize("profile", profiles(), ids=lambda p: p or "default")
def test_conformance_scenario(profile):
    _skip_without_llama_cpp(profile)
    lines: list[str] = []
    models = scenario_models(profile_name=profile)
    # the peer: a second fresh server (decode role) for the KV handoff steps
    with start_server(models, extra_args=server_args(profile_name=profile)) as srv, \
            start_server(models, extra_args=peer_args(profile_name=profile)) as peer:
        passed, failed, records = run_scenario(srv.target, out=lines.append, profile=profile, peer_target=peer.target,
                                               env_vars=scenario_vars(profile_name=profile))
    print("\n".join(lines))
    bad = [f"{r['id']}: {r['error']}" for r in records if r["status"] == "FAIL"]
    assert not bad, f"{failed} conformance step(s) failed:\n" + "\n".join(bad)
    assert passed >= 100
    skipped = [r["id"] for r in records if r["status"] == "SKIP"]
    assert len(skipped) <= 15, skipped  # only the steps a profile's executor cannot do
