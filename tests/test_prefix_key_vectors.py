"""The shared prefix-key vectors (tests/conformance/prefix_key_vectors.json) against the recipe.

Every client (Go, TypeScript, Rust) checks its own implementation against that file; this test
keeps the file itself honest: it must equal what the Python recipe (the one the server keys its
blocks with) computes, and what the formula in ``PrefixCacheRecipe`` (types.proto) computes when
written out again here from the text."""

from __future__ import annotations

import hashlib
import json
import struct

from ferrum_client import prefix_keys
from tests.conformance import gen_prefix_key_vectors as gen

VECTORS = json.loads(gen.OUT.read_text(encoding="utf-8"))


def _from_the_proto_text(model_id: str, salt: str, adapter: str, bs: int, tokens: list[int]) -> tuple[str, list[str]]:
    root_input = b"ferrum-prefix-v1" + b"\x00" + model_id.encode() + b"\x00" + salt.encode()
    if adapter:
        root_input += b"\x00" + adapter.encode()
    key = hashlib.sha256(root_input).digest()
    root, keys = key.hex(), []
    for i in range(len(tokens) // bs):
        block = b"".join(struct.pack("<I", t) for t in tokens[i * bs:(i + 1) * bs])
        key = hashlib.sha256(key + block).digest()
        keys.append(key.hex())
    return root, keys


def test_file_is_what_the_generator_writes():
    assert gen.OUT.read_text(encoding="utf-8") == gen.render(), "stale: run tests/conformance/gen_prefix_key_vectors.py"


def test_header_is_the_advertised_recipe():
    assert VECTORS["algorithm"] == prefix_keys.ALGORITHM == "sha256-chain-v1"
    assert VECTORS["seed"] == prefix_keys.SEED
    assert VECTORS["extra_keys"] == list(prefix_keys.EXTRA_KEYS)


def test_every_case_matches_the_client_recipe_and_the_formula():
    assert len(VECTORS["cases"]) >= 10
    for c in VECTORS["cases"]:
        keys = prefix_keys.block_keys(c["token_ids"], c["block_size"], model_id=c["model_id"],
                                      cache_salt=c["cache_salt"], adapter=c["adapter"])
        assert [k.hex() for k in keys] == c["block_keys"], c["name"]
        assert prefix_keys.chain_root(c["model_id"], c["cache_salt"], adapter=c["adapter"]).hex() == c["root"], c["name"]
        assert _from_the_proto_text(c["model_id"], c["cache_salt"], c["adapter"], c["block_size"],
                                    c["token_ids"]) == (c["root"], c["block_keys"]), c["name"]
        assert len(c["block_keys"]) == len(c["token_ids"]) // c["block_size"], c["name"]


def test_cases_cover_what_changes_a_key():
    by_name = {c["name"]: c for c in VECTORS["cases"]}
    base = by_name["trailing partial block is not keyed"]
    salted = by_name["salt changes every key"]
    assert base["token_ids"] == salted["token_ids"] and set(base["block_keys"]).isdisjoint(salted["block_keys"])
    adapter = by_name["adapter changes every key"]
    assert adapter["block_keys"][0] not in base["block_keys"]
    # a chain continues: the first block's key is the prefix of the longer prompt's
    assert by_name["one full block"]["block_keys"] == base["block_keys"][:1]
    assert any(c["adapter"] and c["cache_salt"] for c in VECTORS["cases"])
    assert any(any(ord(ch) > 127 for ch in c["model_id"]) for c in VECTORS["cases"])
    assert any(max(c["token_ids"], default=0) >= 2**31 - 1 for c in VECTORS["cases"])
