"""Shared fixtures: real servers on loopback ports (see ``tests/support/servers.py``)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from ferrum_client import Client  # noqa: E402

from ferrum_service.executors import ConfigurableModelExecutor, StubModelExecutor  # noqa: E402

from .support.servers import InProcessServer  # noqa: E402

VOCAB = 1000
SEQ = [10, 20, 30]


def contract_executors():
    """The contract executors most tests share: a scripted model, an EOS model, a stub."""
    return [
        ConfigurableModelExecutor.with_token_sequence(VOCAB, SEQ, model_id="mock"),
        ConfigurableModelExecutor.with_eos_after(VOCAB, 3, 2, model_id="eos"),
        ConfigurableModelExecutor.with_token_sequence(VOCAB, SEQ, model_id="perseq", counter="per_sequence"),
        StubModelExecutor("stub", 100),
    ]


@pytest.fixture
def fresh_server():
    """A new server per test (the configurable executor's step counter starts at 0); its admin
    RPCs are open (as with --open-admin-rpcs), the contract tests call them."""
    with InProcessServer(contract_executors(), open_admin_rpcs=True) as srv:
        yield srv


@pytest.fixture
def client(fresh_server):
    with Client(fresh_server.target) as c:
        yield c
