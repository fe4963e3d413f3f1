"""Every RPC of the contract has a helper in every client (Python, Go, TypeScript, Rust).

The RPCs come from the service descriptor (``ModelExecutor`` in executor.proto, as compiled for the
Python client). Each client's public API is read from its source: the Python ``Client`` and
``AsyncClient`` attributes, Go's exported ``func (c *Client) Name(`` methods, TypeScript's class
methods in ``clients/typescript/src``, Rust's ``pub fn`` / ``pub async fn`` in ``clients/rust/src``.
An RPC is covered when one of its names in the client's convention is there (``ReleaseCache`` ->
``release_cache`` / ``ReleaseCache`` / ``releaseCache``), or one of its listed alternatives (Abort
by request or by cache, ImportKv as a pull or a push). A gap fails the test unless
``tests/client_api_allowlist.json`` lists it as deliberate, with a reason; an allow-list entry for
an RPC the client covers fails it too (the list must not go stale).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ferrum_client import AsyncClient, Client
from ferrum_client._proto.ferrum.executor.v1 import executor_pb2

REPO = Path(__file__).resolve().parents[1]
ALLOW = json.loads((REPO / "tests" / "client_api_allowlist.json").read_text())

# Other names (CamelCase) a client may give an RPC's helper.
ALTERNATIVES: dict[str, tuple[str, ...]] = {
    "Abort": ("AbortRequest", "AbortCache"),
    "ImportKv": ("PullKv", "PushKv"),
    "Generate": ("GenerateAll", "GenerateStream"),
    "SubscribeKvEvents": ("KvEvents", "SubscribeEvents"),
    "Session": ("OpenSession",),
}


def rpc_names() -> list[str]:
    return [m.name for m in executor_pb2.DESCRIPTOR.services_by_name["ModelExecutor"].methods]


def snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def lower_camel(name: str) -> str:
    return name[0].lower() + name[1:]


CONVENTION = {"python": snake, "go": lambda n: n, "typescript": lower_camel, "rust": snake}


def python_api() -> set[str]:
    return {n for cls in (Client, AsyncClient) for n in dir(cls) if not n.startswith("_")}


def go_api() -> set[str]:
    names = set()
    for f in (REPO / "clients" / "go" / "ferrum").glob("*.go"):
        if f.name.endswith("_test.go"):
            continue
        names |= set(re.findall(r"^func \(\w+ \*Client\) ([A-Z]\w*)\(", f.read_text(), re.M))
        # package-level helpers that take clients (PushKv(ctx, src, dst, ...))
        names |= set(re.findall(r"^func ([A-Z]\w*)\(ctx context\.Context, \w+, \w+ \*Client", f.read_text(), re.M))
    return names


def typescript_api() -> set[str]:
    names = set()
    for f in (REPO / "clients" / "typescript" / "src").rglob("*.ts"):
        if "gen" in f.relative_to(REPO / "clients" / "typescript" / "src").parts:
            continue  # generated stubs are not the helper API
        text = f.read_text()
        # class methods: `  name(`, `  async name(`, `  async *name(`, `  public name<T>(`
        names |= set(re.findall(r"^\s+(?:public\s+)?(?:static\s+)?(?:async\s+)?\*?\s*([a-z]\w*)\s*(?:<[^>\n]*>)?\(",
                                text, re.M))
        names |= set(re.findall(r"^export (?:async )?function\*? ([a-z]\w*)", text, re.M))
    return names - {"if", "for", "while", "switch", "catch", "return", "function", "constructor"}


def rust_api() -> set[str]:
    names = set()
    for f in (REPO / "clients" / "rust" / "src").rglob("*.rs"):
        names |= set(re.findall(r"\bpub (?:async )?fn ([a-z]\w*)", f.read_text()))
    return names


API = {"python": python_api, "go": go_api, "typescript": typescript_api, "rust": rust_api}


def gaps(client: str) -> list[str]:
    api, conv = API[client](), CONVENTION[client]
    return [rpc for rpc in rpc_names() if not {conv(n) for n in (rpc, *ALTERNATIVES.get(rpc, ()))} & api]


def test_the_service_is_what_the_check_expects():
    rpcs = rpc_names()
    assert len(rpcs) >= 35 and {"Prefill", "ForkCache", "ImportKv", "SubscribeKvEvents", "Abort"} <= set(rpcs)
    assert set(ALLOW) - {"description"} == set(API)


@pytest.mark.parametrize("client", sorted(API))
def test_every_rpc_has_a_helper(client):
    allowed = ALLOW.get(client, {})
    missing = gaps(client)
    undocumented = [rpc for rpc in missing if rpc not in allowed]
    assert not undocumented, (f"{client} client has no helper for {undocumented} (add one, or list the RPC with a "
                              f"reason in tests/client_api_allowlist.json)")
    stale = [rpc for rpc in allowed if rpc not in missing]
    assert not stale, f"tests/client_api_allowlist.json lists {stale} for {client}, which it covers now"


def test_the_parsers_see_known_helpers():
    """The source parsers are not vacuous: helpers known to exist are found."""
    assert {"prefill", "fork_cache", "pull_kv", "subscribe_kv_events"} <= python_api()
    assert {"Prefill", "ForkCache", "PullKv", "SubscribeKvEvents", "PushKv"} <= go_api()
    if (REPO / "clients" / "typescript" / "src" / "client.ts").exists():
        assert {"prefill", "decode", "releaseCache"} <= typescript_api()
    if (REPO / "clients" / "rust" / "src").exists():
        assert {"prefill", "decode", "release_cache"} <= rust_api()
