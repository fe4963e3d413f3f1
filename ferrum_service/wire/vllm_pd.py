"""Prefill/decode disaggregation on the vLLM engine protocol: SMG's PD mode with our KV handoff.

SMG's vLLM PD path (``execute_sequential_pd`` in SMG's ``request_execution.rs``) sends the request
to a prefill worker first, with ``max_tokens`` 1, ``n`` 1, ``stream`` off and stop criteria
cleared, waits for its ``GenerateComplete``, then sends the original request to a decode worker.
For a worker that names no vLLM KV connector in ``GetServerInfo`` (ours name none) it runs
"passthrough": whatever the prefill returns in ``complete.kv_transfer_params_json`` is copied into
the decode request's ``kv_transfer_params_json`` (when ``n`` <= 1). That relay carries our handoff:

1. A ``--role prefill`` server answering such a prefill leg (``max_tokens`` 1, ``n`` 1) keeps the
   prompt's cache, cut to all but the prompt's last token, and returns ``{"ferrum_kv": {"source":
   HOST:PORT, "model_id", "cache_id", "num_tokens"}}`` (``source``: its ``--advertise-address``).
   The cache is freed once it has been exported, or after :data:`HANDOFF_TTL_S` if no decode
   worker pulls it (a decode leg that never comes).
2. A decode worker given those parameters pulls that cache (the prompt's first ``num_tokens - 1``
   tokens of K/V) from the source with ``ImportKv`` (the server-side pull: the source must be one
   of its ``--kv-peer``s, dialled with its own peer credentials on the caller's behalf), checks
   that the imported tokens are the request's prompt, and decodes on that cache: it computes only
   the last prompt token (whose logits give the first output token), as vLLM's connectors do.

When the pull cannot be done (the source is not a configured peer, is unreachable, the cache is
gone or another caller's, the tokens differ, the K/V are of other weights) the decode worker logs
why and computes the prompt itself, as vLLM does after a failed KV load; a KV budget that cannot
take the cache is RESOURCE_EXHAUSTED as for any prompt. Parameters that are not an object, ours
with wrong types, or another connector's (NIXL, Mooncake) are INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import structlog

from ..core import errors
from .convert import pb

if TYPE_CHECKING:
    from ..core.modes import Role
    from ..hosting.host import ModelHost
    from .kv_transfer import KvTransfer

log = structlog.get_logger("ferrum_service.wire.vllm_pd")

KEY = "ferrum_kv"
#: Seconds a prefill keeps a handed-off cache that nobody pulls (vLLM's NIXL lease is 30 s too).
HANDOFF_TTL_S = 30.0
_MAX_PARAMS_BYTES = 4096


@dataclass(frozen=True)
class Handoff:
    """Where a prompt's KV waits: the prefill server, its model and cache, the prompt's length."""

    source: str
    model_id: str
    cache_id: str
    num_tokens: int

    def to_json(self) -> str:
        return json.dumps({KEY: {"source": self.source, "model_id": self.model_id, "cache_id": self.cache_id,
                                 "num_tokens": self.num_tokens}})


def parse(v) -> Handoff | None:
    """The handoff a decode request carries (None when it carries no KV-transfer parameters);
    INVALID_ARGUMENT for parameters that are malformed or not ours."""
    field = "kv_transfer_params_json"
    if v.HasField("kv_transfer_params"):
        raise errors.invalid("kv_transfer_params: vLLM's Mooncake bootstrap address is not a ferrum-service "
                             "handoff (ferrum-service hands KV over with ExportKv/ImportKv)",
                             field="kv_transfer_params")
    if not v.HasField(field):
        return None
    raw = v.kv_transfer_params_json
    if len(raw) > _MAX_PARAMS_BYTES:
        raise errors.invalid(f"{field}: {len(raw)} bytes; at most {_MAX_PARAMS_BYTES}", field=field)
    try:
        params = json.loads(raw)
    except ValueError as e:
        raise errors.invalid(f"{field} is not JSON: {e}", field=field) from None
    if not isinstance(params, dict):
        raise errors.invalid(f"{field} must be a JSON object", field=field)
    mine = params.get(KEY)
    if mine is None:
        keys = ", ".join(sorted(params)[:8]) or "none"
        raise errors.invalid(f"{field}: vLLM KV-connector parameters (keys: {keys}) are not supported by "
                             f"ferrum-service; its handoff is the {KEY!r} object a ferrum-service prefill worker "
                             "returns", field=field)
    types = {"source": str, "model_id": str, "cache_id": str, "num_tokens": int}
    if not isinstance(mine, dict) or any(not isinstance(mine.get(k), t) or isinstance(mine.get(k), bool)
                                         for k, t in types.items()):
        raise errors.invalid(f"{field}: {KEY} needs source, model_id, cache_id (strings) and num_tokens (an integer)",
                             field=field)
    if not mine["source"] or not mine["cache_id"] or mine["num_tokens"] < 1:
        raise errors.invalid(f"{field}: {KEY} needs a source, a cache_id and num_tokens >= 1", field=field)
    if v.sampling_params.n > 1:
        raise errors.invalid(f"{field}: a KV handoff feeds one sample; n = {v.sampling_params.n}", field=field)
    return Handoff(mine["source"], mine["model_id"], mine["cache_id"], mine["num_tokens"])


class PdHandoffs:
    """Both sides of the handoff for one server: the caches a prefill offers, the pulls a decode
    makes. ``kv``: the server's KV transfer (pulls; it reports the exports); ``role``: the
    server's role; ``advertise``: the address peers pull this server's KV from."""

    def __init__(self, kv: "KvTransfer", role: Role, advertise: str) -> None:
        self.kv = kv
        self.role = role
        self.advertise = advertise
        self.ttl_s = HANDOFF_TTL_S
        self._offered: dict[str, tuple["ModelHost", asyncio.TimerHandle]] = {}
        kv.subscribe_exports(self._exported)

    # ---- prefill side ---------------------------------------------------------------------------
    def offers(self, host: "ModelHost", v) -> bool:
        """Whether this request is a PD prefill leg whose cache this server keeps for a decode
        worker: a ``--role prefill`` server with an address peers reach and a model that exports
        KV, one token, one sample."""
        sp = v.sampling_params
        return (self.role == "prefill" and bool(self.advertise)
                and host.capabilities.supports_kv_transfer and sp.HasField("max_tokens") and sp.max_tokens == 1
                and sp.n <= 1)

    async def offer(self, host: "ModelHost", cache_id: str, num_tokens: int) -> Handoff | None:
        """Keep ``cache_id`` (the prompt's ``num_tokens``) for one pull, at most ``ttl_s``, and
        name it. It is cut to the prompt's first ``num_tokens - 1`` tokens, what the decode worker
        takes: an executor that exports only whole caches (llama.cpp) can then hand it over too.
        None (the cache is not kept: the caller frees it) when it cannot be cut."""
        try:
            with host.hold([cache_id], "cache_id"):
                await host.call(host.executor.truncate_kv, cache_id, num_tokens - 1, admit=False)
        except errors.FerrumError as e:
            log.warning("handoff cache not offered", cache_id=cache_id, code=e.code.name, message=e.message)
            return None
        timer = asyncio.get_running_loop().call_later(self.ttl_s, self._drop, cache_id, "expired")
        self._offered[cache_id] = (host, timer)
        return Handoff(self.advertise, host.model_id, cache_id, num_tokens)

    @property
    def offered(self) -> int:
        """Caches kept for a pull now."""
        return len(self._offered)

    def is_offered(self, cache_id: str) -> bool:
        return cache_id in self._offered

    def _exported(self, model_id: str, cache_id: str) -> None:
        self._drop(cache_id, "pulled")

    def _drop(self, cache_id: str, why: str) -> None:
        got = self._offered.pop(cache_id, None)
        if got is None:
            return
        host, timer = got
        timer.cancel()
        if why != "pulled":
            log.info("handoff cache not pulled; freed", cache_id=cache_id, after_s=self.ttl_s)
        host.release_soon(cache_id, "released" if why == "pulled" else "reclaimed")

    def close(self) -> None:
        for cache_id in list(self._offered):
            self._drop(cache_id, "closed")

    # ---- decode side ----------------------------------------------------------------------------
    async def pull(self, host: "ModelHost", h: Handoff, ids: list[int], reserve: int, metadata, salt: str = "") -> str:
        """The cache holding ``ids[:-1]`` pulled from the handoff's source (reserved for
        ``reserve`` tokens, its blocks keyed under the request's ``salt``), or "" when it cannot be
        had (logged; the caller computes the prompt)."""
        why = ""
        if h.model_id != host.model_id:
            why = f"the handoff is of model {h.model_id!r}"
        elif h.num_tokens != len(ids):
            why = f"the handoff holds a {h.num_tokens}-token prompt; this one has {len(ids)}"
        elif len(ids) < 2:
            why = "a one-token prompt has nothing to import"
        if why:
            log.warning("kv handoff not used; computing the prompt", reason=why, source=h.source)
            return ""
        req = pb.ImportKvRequest(model_id=host.model_id, reserve_tokens=reserve, cache_salt=salt, source=pb.KvSource(
            target=h.source, cache_id=h.cache_id, model_id=h.model_id))

        async def one():
            yield req

        try:
            resp = await self.kv.import_(one(), metadata)
        except errors.FerrumError as e:
            if e.code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED):
                raise  # this server's own state: computing the prompt would not fare better
            log.warning("kv handoff failed; computing the prompt", source=h.source, code=e.code.name,
                        message=e.message)
            return ""
        cache_id = resp.cache.cache_id
        entry = host.executor.registry.get(cache_id)
        if list(entry.tokens) != list(ids[:-1]):
            host.release_soon(cache_id, "reclaimed")
            log.warning("kv handoff of other tokens than the prompt; computing the prompt", source=h.source)
            return ""
        return cache_id


__all__ = ["HANDOFF_TTL_S", "Handoff", "KEY", "PdHandoffs", "parse"]
