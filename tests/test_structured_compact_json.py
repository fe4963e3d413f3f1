"""``OutputConstraint.json_schema`` output has no insignificant whitespace, as the contract says
(xgrammar's own default separators are ", " and ": "; the conformance scenario's
``constraint.json_schema`` step found it). On the tiny transformers llama, whose random weights
make the schema the only thing that decides the text."""

from __future__ import annotations

import json

import pytest

from ferrum_client import Client, pb, tpb

from .conftest_models import tiny_llama  # noqa: F401 - fixture
from .conftest_models import tiny_llama_dir  # noqa: F401 - fixture
from .support.servers import InProcessServer

pytest.importorskip("xgrammar")

# Every value is a const: exactly one JSON text is valid, so only the separators can vary.
SCHEMA = {"type": "object", "properties": {"a": {"const": 1}, "b": {"const": [True, "x"]}},
          "required": ["a", "b"], "additionalProperties": False}


def test_json_schema_output_is_compact(tiny_llama):
    with InProcessServer([tiny_llama]) as srv, Client(srv.target) as c:
        events = list(c.generate("tiny", token_ids=[1, 100, 200], max_tokens=60,
                                 constraint=tpb.OutputConstraint(json_schema=json.dumps(SCHEMA))))
    fin = events[-1].finished
    assert fin.finish_reason == pb.FINISH_REASON_EOS, fin
    assert fin.text == '{"a":1,"b":[true,"x"]}'
