"""Server pulls (``ImportKv`` with a ``source``) against stand-in peers (audit L1, L10).

* L1: with ``--kv-peer 127.0.0.1:*`` and a peer token, a caller could aim the pull at any local
  port, and whatever listened there received ``authorization: Bearer <peer token>`` in plaintext.
  A pull that only ``HOST:*`` admits is now refused (PERMISSION_DENIED, nothing dialled) unless
  pulls use TLS; ``HOST:LO-HI`` names a port range instead.
* L10: a peer that accepts the call and never answers held the import until the caller gave up;
  the header now gets ``--kv-import-idle-timeout`` as each chunk does.

The stand-in peer is a real gRPC server on a loopback port that records each call's metadata and
never answers.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest

from ferrum_client import Client, pb
from ferrum_service.executors.transformers import HfCausalLmExecutor
from ferrum_service.hosting.kv_peers import KvPeers

from .conftest_models import tiny_llama_dir  # noqa: F401 - fixture
from .support.servers import InProcessServer

PEER_TOKEN = "peer-secret-token"


class SilentPeer(grpc.GenericRpcHandler):
    """Accepts every call, records its metadata, answers nothing until closed."""

    def __init__(self) -> None:
        self.seen: list[dict[str, str]] = []
        self.release = threading.Event()
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        self.server.add_generic_rpc_handlers((self,))
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    def service(self, details):
        self.seen.append(dict(details.invocation_metadata))

        def never(request, context):
            self.release.wait(60)
            return iter(())

        return grpc.unary_stream_rpc_method_handler(never, request_deserializer=lambda b: b,
                                                    response_serializer=lambda b: b)

    def __enter__(self) -> "SilentPeer":
        self.server.start()
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self.server.stop(0)


def _pull(c: Client, port: int):
    req = pb.ImportKvRequest(model_id="tiny", source=pb.KvSource(target=f"127.0.0.1:{port}", cache_id="c1"))
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        c.stub.ImportKv(iter([req]), timeout=15)
    return e.value, time.monotonic() - t0


def test_a_wildcard_peer_never_receives_the_peer_token_in_plaintext(tiny_llama_dir):  # noqa: F811
    ex = HfCausalLmExecutor.from_path(tiny_llama_dir, model_id="tiny", device="cpu", kv_budget_tokens=4096)
    with SilentPeer() as listener, InProcessServer([ex], kv_peers=["127.0.0.1:*"], kv_peer_tokens=[PEER_TOKEN],
                                                   kv_import_idle_timeout=1.0) as srv, Client(srv.target) as c:
        err, _ = _pull(c, listener.port)
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "HOST:*" in err.details(), err
        assert not any(PEER_TOKEN in v for md in listener.seen for v in md.values()), listener.seen


def test_a_peer_that_never_sends_the_header_is_given_up_within_the_idle_timeout(tiny_llama_dir):  # noqa: F811
    ex = HfCausalLmExecutor.from_path(tiny_llama_dir, model_id="tiny", device="cpu", kv_budget_tokens=4096)
    with SilentPeer() as peer:
        with InProcessServer([ex], kv_peers=[f"127.0.0.1:{peer.port - 1}-{peer.port}"],
                             kv_import_idle_timeout=1.0) as srv, Client(srv.target) as c:
            err, took = _pull(c, peer.port)
            print(f"silent peer: ImportKv answered {err.code().name} after {took:.1f} s")
            assert peer.seen, "the pull never reached the peer (the port range admits it)"
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "source" in err.details(), err
            assert took < 8.0, f"the import waited {took:.1f} s for a header"


def test_peer_list_syntax():
    peers = KvPeers(["10.0.0.1:50051-50053", "10.0.0.2:*", "10.0.0.3:7000"])
    assert peers._in_range("10.0.0.1:50052") and not peers._in_range("10.0.0.1:50054")
    for bad in ("10.0.0.1:9-1", "10.0.0.1:0-5", "10.0.0.1:1-70000", "10.0.0.1:a-b"):
        with pytest.raises(ValueError):
            KvPeers([bad])
