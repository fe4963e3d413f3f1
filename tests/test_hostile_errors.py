"""What error answers tell a caller (audit L6).

An unexpected exception was answered INTERNAL with ``type(exc): str(exc)`` (paths, shapes, library
text), and an ImportKv whose weights fingerprint differed echoed the server's own fingerprint. Now
INTERNAL carries only an error id, which the server's log records with the exception; the
fingerprint refusal names the field, not the value. Real server on a loopback port (tiny Llama),
the exception injected into its own ExportKv (its export wrapped, no mocks).
"""

from __future__ import annotations

import grpc
import pytest
import structlog.testing

from ferrum_client import Client, pb
from ferrum_service.executors.transformers import HfCausalLmExecutor

from .conftest_models import tiny_llama_dir  # noqa: F401 - fixture
from .support.servers import InProcessServer

SECRET_TEXT = "/srv/private/weights-7f3a/model.safetensors"


@pytest.fixture(scope="module")
def srv(tiny_llama_dir):  # noqa: F811
    ex = HfCausalLmExecutor.from_path(tiny_llama_dir, model_id="tiny", device="cpu", kv_budget_tokens=4096)
    with InProcessServer([ex]) as s:
        yield s


def test_internal_errors_answer_an_id_and_log_the_exception(srv):
    kv = srv.server.servicer.kv
    real = kv.export

    async def failing(req, metadata=None):
        async for msg in real(req, metadata):
            yield msg
            raise RuntimeError(f"cannot map {SECRET_TEXT}")

    kv.export = failing
    try:
        with Client(srv.target) as c, structlog.testing.capture_logs() as logs:
            cid = c.prefill("tiny", [5, 6, 7]).output.cache.cache_id
            with pytest.raises(grpc.RpcError) as e:
                list(c.stub.ExportKv(pb.ExportKvRequest(model_id="tiny", cache_id=cid)))
            c.release_cache("tiny", cid)
    finally:
        kv.export = real
    details = e.value.details()
    assert e.value.code() == grpc.StatusCode.INTERNAL
    assert SECRET_TEXT not in details and "RuntimeError" not in details, details
    logged = [x for x in logs if x.get("event") == "unexpected error"]
    assert logged and SECRET_TEXT in logged[0]["error"]
    assert logged[0]["error_id"] in details  # the id the caller quotes finds the log line


def test_a_fingerprint_mismatch_does_not_echo_the_servers_fingerprint(srv):
    with Client(srv.target) as c:
        cid = c.prefill("tiny", [5, 6, 7]).output.cache.cache_id
        msgs = list(c.stub.ExportKv(pb.ExportKvRequest(model_id="tiny", cache_id=cid)))
        c.release_cache("tiny", cid)
        header = msgs[0].header
        own = header.fingerprint
        header.fingerprint = "f" * len(own)
        with pytest.raises(grpc.RpcError) as e:
            c.stub.ImportKv(iter([pb.ImportKvRequest(model_id="tiny", header=header)] +
                                 [pb.ImportKvRequest(chunk=m.chunk) for m in msgs[1:]]))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "fingerprint" in e.value.details()
    assert own[:8] not in e.value.details(), e.value.details()
    assert srv.live_caches() == {"tiny": 0}
