"""KV handoff between servers: ``ExportKv`` (server-streaming) and ``ImportKv`` (client-streaming,
or a server-side pull from another server).

Wire format (``KvTransferHeader`` then ``KvChunk``s): per layer, the range's K then V as
``[tokens, kv_heads, head_dim]`` row-major bytes of the executor's KV dtype; a layer is split into
token ranges so that a chunk's K+V stay under ``max_chunk_bytes``; each chunk carries the zlib
CRC-32 of ``key || value``. Chunks come layer by layer, token ranges in order.

Import, all or nothing:

1. The header is checked against this server's model (model id, weights fingerprint, KV dtype and
   shape: FAILED_PRECONDITION), then admitted: the executor takes the blocks for the tokens (or the
   reservation) at once, privately — RESOURCE_EXHAUSTED before any chunk is read.
2. Each chunk is checked (order, layer, token range, byte lengths: INVALID_ARGUMENT; checksum:
   DATA_LOSS) and written into the staged blocks on the server's one KV-transfer thread (not the
   model's worker: the staged blocks are private to the import until it lands, so no step reads
   or writes them meanwhile).
3. When every layer's range is covered, the staged blocks become a cache in the registry (a
   ``created`` KV event) and its full blocks are keyed into the prefix cache (block events).
   A stream that ends early is DATA_LOSS; whatever way it fails (or the caller goes away), the
   staged blocks go back to the pool and no cache exists.

Staged pulls (a migration's pre-copy, ``migration.py``): ``stage_pull`` runs steps 1-2 of a
server pull of tokens [0, k) and stops before 3 (the staged blocks stay private: no cache, no
prefix key); ``extend_pull`` later pulls [k, n) of the same cache and appends it (the executor's
``import_extend``, inside the reservation taken at step 1); ``commit_staged`` is step 3;
``abort_staged`` gives the blocks back. The source paces a pre-copy's export (``kv_export_pacing.py``).

Server pull: with ``source`` set, this server calls ``ExportKv`` on ``source.target`` itself and
feeds the stream through the same steps. Only peers the operator configured are dialled, with this
server's own credentials, on the caller's behalf (``kv_peers.py``).

Trust: K/V a caller streams in are its own word (a valid checksum says nothing about who computed
them), so their blocks are keyed only into the importing caller's own prefix key space, never a
shared one (``cache_salt`` opting into a shared space is kept private for them). K/V pulled from a
configured peer are keyed as a prefill's would be.

Bounds: a staged import counts against the registry (active caches, reserved KV in ``Loads``) and
against its caller's cache cap (``--max-caches-per-caller``, as the cache it becomes would: a push,
a pull, a migration's import or pre-copy, the vLLM protocol's PD pull), and is dropped
(DEADLINE_EXCEEDED) when no chunk arrives for ``import_idle_s`` or the whole transfer takes over
``import_total_s`` (``--kv-import-timeout``); an executor's own
state bytes are refused as soon as they exceed the header's ``total_bytes`` or what the header's
tokens can need.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import time
import zlib
from typing import Any, AsyncIterator, Callable

import grpc
import structlog
from ferrum_client._proto.ferrum.executor.v1 import executor_pb2_grpc

from ..core import errors
from ..core.callers import current_caller
from ..core.modes import CacheEvent
from ..core.settings import default
from ..executors.base import KvLayout
from ..hosting.kv_peers import KvPeers
from .convert import handle_pb, pb, tpb
from .kv_export_pacing import ExportPacing, layer_reads

log = structlog.get_logger("ferrum_service.wire.kv_transfer")

#: K+V bytes per chunk when the request does not say.
DEFAULT_CHUNK_BYTES = 4 << 20
#: Chunk writes an import keeps queued on the KV-transfer thread while it reads the next chunks.
_WRITES_IN_FLIGHT = 4
CHECKSUM = "crc32"
_DTYPE_PB = {"fp32": tpb.DATA_TYPE_FP32, "fp16": tpb.DATA_TYPE_FP16, "bf16": tpb.DATA_TYPE_BF16}
_PB_NAMES = {v: k for k, v in _DTYPE_PB.items()}

# Export reads a whole layer's range at once; bound that read (bytes of K+V of one layer).
_MAX_LAYER_READ_BYTES = 256 << 20
#: Seconds a staged import may wait for its next chunk before it is dropped (default).
DEFAULT_IMPORT_IDLE_S = default("kv_import_idle_timeout")
#: Seconds a staged import may take in all, from its first chunk read to its last (default).
DEFAULT_IMPORT_TOTAL_S = default("kv_import_timeout")
# An executor's state bytes beyond its K/V (positions, sequence ids, headers): per token, and once.
_STATE_BYTES_PER_TOKEN = 64
_STATE_OVERHEAD_BYTES = 1 << 20


def checksum(key: bytes, value: bytes) -> int:
    return zlib.crc32(value, zlib.crc32(key))


def _chunk_ranges(start: int, end: int, per_token: int, max_bytes: int) -> list[tuple[int, int]]:
    step = max(1, max_bytes // max(1, per_token))
    return [(s, min(end, s + step)) for s in range(start, end, step)]


class KvTransfer:
    """The two RPCs' server side (the servicer hands them the request and the call context)."""

    def __init__(self, models, checks, *, max_message_bytes: int, metrics=None, peers: KvPeers | None = None,
                 import_idle_s: float = DEFAULT_IMPORT_IDLE_S, import_total_s: float = DEFAULT_IMPORT_TOTAL_S,
                 pacing: ExportPacing | None = None) -> None:
        """``pacing``: the caches whose exports are paced (``Migrations``' pre-copies); default none."""
        self.models = models
        self.pacing = pacing if pacing is not None else ExportPacing()
        self.metrics = metrics
        self.checks = checks
        self.max_message_bytes = max_message_bytes
        self.peers = peers if peers is not None else KvPeers(max_message_bytes=max_message_bytes)
        self.import_idle_s = import_idle_s
        self.import_total_s = import_total_s
        # Chunk reads (export) and checks + writes (import) run on this one thread, not on the
        # models' workers: a prefill server's worker is busy with prompts, and a handoff must not
        # queue behind them. Safe because they only touch blocks nothing else writes: an exported
        # cache is held (no step runs on it; its shared blocks are copy-on-write for others), an
        # import's staged blocks are in no table. One thread, so work submitted after an import's
        # writes (its abort) runs after them.
        self._io = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-transfer")
        self._aborts: set[asyncio.Task] = set()
        self._on_exported: list[Callable[[str, str], None]] = []  # subscribe_exports

    def subscribe_exports(self, callback: Callable[[str, str], None]) -> None:
        """``callback(model id, cache id)`` after an export's last chunk (``vllm_pd.py``: a PD prefill's cache)."""
        self._on_exported.append(callback)

    @staticmethod
    def _require(host) -> None:
        if not host.capabilities.supports_kv_transfer:
            raise errors.unsupported(
                f"model {host.model_id!r} ({host.info.executor}) cannot export or import KV caches "
                "(Capabilities.supports_kv_transfer is false)", field="model_id")

    def _max_chunk(self, asked: int) -> int:
        cap = max(4096, self.max_message_bytes - 64 * 1024)  # room for the message's other fields
        return min(asked or DEFAULT_CHUNK_BYTES, cap)

    @staticmethod
    def header_of(layout: KvLayout, tokens: list[int], start: int, end: int, num_chunks: int,
                  total_bytes: int) -> pb.KvTransferHeader:
        return pb.KvTransferHeader(
            model_id=layout.model_id, fingerprint=layout.fingerprint, kv_dtype=_DTYPE_PB.get(layout.dtype, 0),
            num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
            v_head_dim=layout.v_head_dim, token_ids=tokens, positions=range(start, end), from_token=start,
            to_token=end, num_chunks=num_chunks, total_bytes=total_bytes, executor=layout.executor,
            checksum_algorithm=CHECKSUM)

    # ---- export ---------------------------------------------------------------------------------
    async def _layout(self, host) -> KvLayout:
        """The model's KV layout: on the worker the first time (the fingerprint reads every
        weight), from the executor's memo afterwards (never behind queued steps)."""
        memo = host.executor.known_kv_layout()
        return memo if memo is not None else (await host.call(host.executor.kv_layout)).value

    async def export(self, req: pb.ExportKvRequest, metadata=None) -> AsyncIterator[pb.ExportKvResponse]:
        on_behalf = self.peers.on_behalf(metadata)
        if on_behalf is not None:  # a configured peer pulls for one of its callers: their ownership applies
            current_caller.set(on_behalf)
        host = self.models.get(req.model_id)
        self._require(host)
        entry = self.checks.live_entry(host, req.cache_id, "cache_id")
        n = entry.num_tokens
        start = int(req.from_token)
        end = int(req.to_token) or n
        if not 0 <= start < end <= n:
            raise errors.out_of_range(
                f"token range [{start}, {end}) must be non-empty and inside the cache's {n} tokens",
                field="to_token" if end > n else "from_token", num_tokens=n)
        ex = host.executor
        layout = await self._layout(host)
        if layout.state_format:
            async for msg in self._export_state(host, req, layout, start, end, n):
                yield msg
            return
        k_tok = layout.num_kv_heads * layout.head_dim * layout.element_size
        v_tok = layout.num_kv_heads * layout.v_head_dim * layout.element_size
        if (end - start) * (k_tok + v_tok) > _MAX_LAYER_READ_BYTES:
            raise errors.invalid(
                f"{end - start} tokens are {(end - start) * (k_tok + v_tok)} bytes per layer; export at most "
                f"{_MAX_LAYER_READ_BYTES // (k_tok + v_tok)} tokens per call (from_token / to_token)",
                field="to_token")
        ranges = _chunk_ranges(start, end, k_tok + v_tok, self._max_chunk(req.max_chunk_bytes))

        def layer_chunks(layer: int) -> list[pb.ExportKvResponse]:
            """One layer's chunks, read, cut and checksummed (on the transfer thread)."""
            k, v = ex.export_kv_layer(req.cache_id, start, end, layer)
            out = []
            for j, (s, e) in enumerate(ranges):
                kb = k[(s - start) * k_tok:(e - start) * k_tok]
                vb = v[(s - start) * v_tok:(e - start) * v_tok]
                out.append(pb.ExportKvResponse(chunk=pb.KvChunk(
                    index=layer * len(ranges) + j, layer=layer, token_start=s, token_end=e, key=kb, value=vb,
                    checksum=checksum(kb, vb))))
            return out

        loop = asyncio.get_running_loop()

        async def read(layer: int):
            return await asyncio.wrap_future(self._io.submit(layer_chunks, layer), loop=loop)

        with host.hold([req.cache_id], "cache_id"):
            entry = self.checks.live_entry(host, req.cache_id, "cache_id")  # still live once held
            if entry.num_tokens < end:
                raise errors.out_of_range(f"the cache holds {entry.num_tokens} tokens now", field="to_token")
            tokens = list(entry.tokens[start:end])
            header = self.header_of(layout, tokens, start, end, len(ranges) * layout.num_layers,
                                    (end - start) * (k_tok + v_tok) * layout.num_layers)
            header.adapter = entry.adapter
            header.caller_supplied = entry.caller_supplied
            if entry.adapter:
                header.adapter_digest = ex.adapter_digest(entry.adapter)
            yield pb.ExportKvResponse(header=header)
            # The next layer is read while this one is sent; the pre-copy of a stream decoding here
            # goes a batch of layers per model step (kv_export_pacing.py).
            pacer = self.pacing.pacer(host.model_id, req.cache_id, host.steps, (end - start) * (k_tok + v_tok))
            async with contextlib.aclosing(layer_reads(read, layout.num_layers, pacer)) as layers:
                async for msgs in layers:
                    for msg in msgs:
                        yield msg
                    if self.metrics is not None:
                        self.metrics.kv_transfer_bytes.labels(host.model_id, "export").inc(
                            sum(len(x.chunk.key) + len(x.chunk.value) for x in msgs))
            for callback in self._on_exported:
                callback(host.model_id, req.cache_id)

    async def _export_state(self, host, req, layout: KvLayout, start: int, end: int, n: int):
        """An executor's own serialisation of a whole sequence (e.g. llama.cpp's), cut into chunks.
        Read on the model's worker (such a backend is not safe to call from another thread)."""
        if start != 0 or end != n:
            raise errors.invalid(f"the {layout.executor} executor exports whole caches only ({layout.state_format}): "
                                 f"leave from_token / to_token at 0", field="from_token")
        with host.hold([req.cache_id], "cache_id"):
            entry = self.checks.live_entry(host, req.cache_id, "cache_id")
            tokens = list(entry.tokens)
            end = len(tokens)
            blob = (await host.call(host.executor.export_kv_state, req.cache_id, admit=False)).value
            step = self._max_chunk(req.max_chunk_bytes)
            pieces = [blob[i:i + step] for i in range(0, len(blob), step)]
            header = self.header_of(layout, tokens, 0, end, len(pieces), len(blob))
            header.state_format = layout.state_format
            header.caller_supplied = entry.caller_supplied
            yield pb.ExportKvResponse(header=header)
            for i, piece in enumerate(pieces):
                yield pb.ExportKvResponse(chunk=pb.KvChunk(index=i, layer=0, token_start=0, token_end=end, key=piece,
                                                           checksum=checksum(piece, b"")))
            if self.metrics is not None:
                self.metrics.kv_transfer_bytes.labels(host.model_id, "export").inc(len(blob))
            for callback in self._on_exported:
                callback(host.model_id, req.cache_id)

    # ---- import ---------------------------------------------------------------------------------
    async def import_(self, requests: AsyncIterator[pb.ImportKvRequest], metadata) -> pb.ImportKvResponse:
        t0 = time.perf_counter_ns()
        first = None
        async for first in requests:
            break
        if first is None:
            raise errors.invalid("the import stream is empty: the first message names the model and carries the "
                                 "header or a source", field="header")
        host = self.models.get(first.model_id)
        self._require(host)
        self.checks.salt(first.cache_salt, "cache_salt")  # refused before anything is dialled
        # The cache it creates counts against the caller's cap from now (staged included) until it
        # is adopted, as a Prefill's does: refused before anything is dialled or admitted.
        with self.checks.quota.claim(host, 1, "source" if first.HasField("source") else "header"):
            return await self._import_first(host, first, requests, t0)

    async def _import_first(self, host, first: pb.ImportKvRequest, requests, t0: int) -> pb.ImportKvResponse:
        pull = None
        if first.HasField("source"):
            if first.WhichOneof("data") is not None:
                raise errors.invalid("give either source or header (and chunks), not both", field="source")
            pull = await self._pull(host, first.source)
            header, chunks, _ = pull
        else:
            if first.WhichOneof("data") != "header":
                raise errors.invalid("the first message must carry the header (or a source)", field="header")
            header = first.header
            chunks = self._pushed_chunks(requests)
        chunks = self._idle_bounded(chunks)
        # Pushed K/V (or a peer's that a caller once pushed there) stay in the caller's own key
        # space; K/V a configured peer computed may go to a shared one.
        trusted = pull is not None and not header.caller_supplied
        salt = self.checks.salt(first.cache_salt, "cache_salt", shared=trusted)
        try:
            return await self._import(host, header, chunks, int(first.reserve_tokens), salt, t0, trusted)
        finally:
            if pull is not None:
                pull[2].cancel()

    async def _idle_bounded(self, chunks) -> AsyncIterator[pb.KvChunk]:
        """``chunks``, dropped (DEADLINE_EXCEEDED) when the next one takes over ``import_idle_s``,
        or all of them over ``import_total_s`` (from the first read on): a staged import holds
        its KV, so neither a stalled sender nor one that trickles a chunk just inside the idle
        limit may hold it for long."""
        it = chunks.__aiter__()
        loop = asyncio.get_running_loop()
        end = loop.time() + self.import_total_s if self.import_total_s else None
        while True:
            left = None if end is None else end - loop.time()
            wait = min((x for x in (self.import_idle_s or None, left) if x is not None), default=None)
            try:
                if wait is not None:
                    c = await asyncio.wait_for(it.__anext__(), max(0.0, wait))
                else:
                    c = await it.__anext__()
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                if end is not None and loop.time() >= end:
                    why = f"the import took over {self.import_total_s:g} s in all (--kv-import-timeout)"
                else:
                    why = f"no chunk arrived for {self.import_idle_s:g} s"
                raise errors.FerrumError(
                    errors.ErrorKind.NETWORK, f"{why}; the import was dropped and its KV given back",
                    code=grpc.StatusCode.DEADLINE_EXCEEDED, field="chunk") from None
            yield c

    @staticmethod
    async def _pushed_chunks(requests) -> AsyncIterator[pb.KvChunk]:
        async for m in requests:
            if m.WhichOneof("data") != "chunk":
                raise errors.invalid("every message after the first must carry a chunk", field="chunk")
            yield m.chunk

    def _check_header(self, host, layout: KvLayout, h: pb.KvTransferHeader, start: int = 0) -> list[int]:
        if h.model_id != host.model_id:
            raise errors.failed_precondition(
                f"the K/V are of model {h.model_id!r}; this import is into {host.model_id!r}", field="header.model_id")
        if h.executor and h.executor != layout.executor:
            raise errors.failed_precondition(
                f"the K/V come from a {h.executor!r} executor; this model runs on {layout.executor!r}",
                field="header.executor")
        if _PB_NAMES.get(h.kv_dtype) != layout.dtype:
            raise errors.failed_precondition(
                f"KV dtype {tpb.DataType.Name(h.kv_dtype)} differs from this model's {layout.dtype}",
                field="header.kv_dtype")
        shape = (h.num_layers, h.num_kv_heads, h.head_dim, h.v_head_dim or h.head_dim)
        want = (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.v_head_dim)
        if shape != want:
            raise errors.failed_precondition(f"KV shape (layers, kv heads, head dim, v head dim) {shape} differs "
                                             f"from this model's {want}", field="header")
        if h.state_format != layout.state_format:
            raise errors.failed_precondition(
                f"the K/V are in format {h.state_format or 'per-layer tensors'!r}; this model imports "
                f"{layout.state_format or 'per-layer tensors'!r}", field="header.state_format")
        if h.fingerprint != layout.fingerprint:
            raise errors.failed_precondition(
                "header.fingerprint differs from this server's weights fingerprint (other weights or config)",
                field="header.fingerprint")
        if h.checksum_algorithm not in ("", CHECKSUM):
            raise errors.failed_precondition(f"checksum {h.checksum_algorithm!r} is not supported (crc32 is)",
                                             field="header.checksum_algorithm")
        if h.from_token != start:
            raise errors.invalid("a new cache starts at token 0: from_token must be 0" if not start else
                                 f"the staged import holds {start} tokens: from_token must be {start}",
                                 field="header.from_token")
        n = int(h.to_token)
        if n <= start or len(h.token_ids) != n - start or (h.positions and list(h.positions) != list(range(start, n))):
            raise errors.invalid(f"the header must list {n - start} token ids (and positions {start}..{n - 1})",
                                 field="header.token_ids")
        if h.num_layers and h.num_chunks < h.num_layers and not layout.state_format:
            raise errors.invalid("num_chunks is below one chunk per layer", field="header.num_chunks")
        tokens = self.checks.tokens(host, h.token_ids, "header.token_ids")
        self.checks.check_length(host, n, "header.token_ids")
        return tokens

    async def _import(self, host, h: pb.KvTransferHeader, chunks, reserve: int, salt: str, t0: int, trusted: bool):
        ex = host.executor
        layout = await self._layout(host)
        tokens = self._check_header(host, layout, h)
        if reserve:
            self.checks.check_length(host, reserve, "reserve_tokens")
        n = len(tokens)
        staged = (await host.call(ex.import_begin, tokens, reserve, salt, h.adapter,
                                  h.adapter_digest)).value  # admission
        if layout.state_format:
            return await self._import_state(host, h, chunks, staged, n, t0, trusted)
        try:
            count, nbytes = await self._write_chunks(host, layout, staged, h, chunks, 0)
            orphan = (lambda v: host.release_soon(v[0].cache_id, CacheEvent.RECLAIMED))
            entry, cached = (await host.call(ex.import_commit, staged, admit=False, on_orphan=orphan)).value
        except BaseException as exc:
            await self._abort_on(exc, host, staged)
            raise
        self._imported(host, entry, t0, trusted, tokens=n, chunks=count, bytes=nbytes, cached_blocks=cached)
        return pb.ImportKvResponse(cache=handle_pb(ex.handle(entry)), imported_tokens=n, bytes=nbytes, chunks=count,
                                   cached_blocks=cached, transfer_ns=time.perf_counter_ns() - t0)

    async def _write_chunks(self, host, layout: KvLayout, staged, h: pb.KvTransferHeader, chunks,
                            start: int) -> tuple[int, int]:
        """Check the chunks of tokens [start, h.to_token) and write them into ``staged`` (on the
        transfer thread, a few behind the reading); (chunks, bytes) once every layer is covered.
        Whatever is raised, no write of this call is still running after it (the caller aborts)."""
        ex = host.executor
        n = int(h.to_token)
        k_tok = layout.num_kv_heads * layout.head_dim * layout.element_size
        v_tok = layout.num_kv_heads * layout.v_head_dim * layout.element_size
        loop = asyncio.get_running_loop()
        writes: collections.deque[asyncio.Future] = collections.deque()
        try:
            written = [start] * layout.num_layers
            count = 0
            nbytes = 0
            async for c in chunks:
                where = f"chunk {count}"
                if c.index != count:
                    raise errors.invalid(f"{where}: index {c.index}, expected {count}", field="chunk.index")
                if c.layer >= layout.num_layers:
                    raise errors.invalid(f"{where}: layer {c.layer} of {layout.num_layers}", field="chunk.layer")
                s, e = int(c.token_start), int(c.token_end)
                if s != written[c.layer] or not s < e <= n:
                    raise errors.invalid(f"{where}: tokens [{s}, {e}) of layer {c.layer}; expected a range starting "
                                         f"at {written[c.layer]} inside [{start}, {n})", field="chunk.token_start")
                if len(c.key) != (e - s) * k_tok or len(c.value) != (e - s) * v_tok:
                    raise errors.invalid(f"{where}: {len(c.key)} + {len(c.value)} bytes; {e - s} tokens need "
                                         f"{(e - s) * k_tok} + {(e - s) * v_tok}", field="chunk.key")
                # Checked and written on the transfer thread, up to a few chunks behind the reading.
                writes.append(asyncio.wrap_future(self._io.submit(_verify_and_write, ex, staged, c, where), loop=loop))
                while len(writes) > _WRITES_IN_FLIGHT or (writes and writes[0].done()):
                    await writes.popleft()
                written[c.layer] = e
                count += 1
                nbytes += len(c.key) + len(c.value)
            while writes:
                await writes.popleft()
            missing = [i for i, w in enumerate(written) if w != n]
            if missing or (h.num_chunks and count != h.num_chunks):
                raise errors.FerrumError(
                    errors.ErrorKind.SERIALIZATION,
                    f"the stream ended after {count} of {h.num_chunks or '?'} chunks ({len(missing)} layers "
                    "incomplete); nothing was imported", code=grpc.StatusCode.DATA_LOSS, field="chunk")
            return count, nbytes
        except BaseException:
            for f in writes:
                f.add_done_callback(lambda f: f.cancelled() or f.exception())
            raise

    async def _abort_on(self, exc: BaseException, host, staged) -> None:
        aborted = self._abort_after_writes(host, staged)
        if not isinstance(exc, asyncio.CancelledError):
            # A refusal answers once the blocks are back; a cancelled call cannot wait for that.
            await asyncio.shield(aborted)

    # ---- staged pulls (a migration's pre-copy, then its tail: ``migration.py``) -------------------
    async def stage_pull(self, host, src: pb.KvSource, reserve: int, salt: str) -> "StagedKv":
        """Pull tokens [0, src.to_token) of a peer's cache into a staged import that is NOT
        committed: admitted (``reserve`` tokens) and written as an import's, held privately (no
        cache, no prefix key) until :meth:`extend_pull` / :meth:`commit_staged` or
        :meth:`abort_staged`. Per-layer tensor layouts only."""
        t0 = time.perf_counter_ns()
        self._require(host)
        layout = await self._layout(host)
        if layout.state_format:
            raise errors.unsupported(f"model {host.model_id!r} ({layout.executor}) moves whole caches only: "
                                     "no pre-copy", field="precopy")
        if src.from_token:
            raise errors.invalid("a pre-copy starts at token 0: source.from_token must be 0", field="source.from_token")
        self.checks.salt(salt, "cache_salt")  # refused before anything is dialled
        # counted against the caller's cap until it is committed (then live) or aborted
        release = self.checks.quota.take(host, 1, "precopy")
        try:
            header, chunks, call = await self._pull(host, src)
        except BaseException:
            release()
            raise
        try:
            tokens = self._check_header(host, layout, header)
            if reserve:
                self.checks.check_length(host, reserve, "reserve_tokens")
            trusted = not header.caller_supplied
            salt = self.checks.salt(salt, "cache_salt", shared=trusted)
            staged = (await host.call(host.executor.import_begin, tokens, reserve, salt, header.adapter,
                                      header.adapter_digest)).value
            try:
                count, nbytes = await self._write_chunks(host, layout, staged, header, self._idle_bounded(chunks), 0)
            except BaseException as exc:
                await self._abort_on(exc, host, staged)
                raise
        except BaseException:
            release()
            raise
        finally:
            call.cancel()
        st = StagedKv(host, staged, list(tokens), header.adapter, trusted, nbytes, t0)
        st.release_claim = release
        log.info("kv staged", model_id=host.model_id, tokens=len(tokens), bytes=nbytes, chunks=count,
                 ms=round((time.perf_counter_ns() - t0) / 1e6, 1))
        return st

    async def extend_pull(self, st: "StagedKv", src: pb.KvSource) -> tuple[int, int]:
        """Pull tokens [src.from_token, src.to_token or the end) of the same peer cache and append
        them to the staged import ``st`` (from_token must be where it ends); (tokens, bytes).
        On failure the caller aborts ``st``."""
        host = st.host
        layout = await self._layout(host)
        start = len(st.tokens)
        if src.from_token != start:
            raise errors.invalid(f"the staged import holds {start} tokens: source.from_token must be {start}",
                                 field="source.from_token")
        header, chunks, call = await self._pull(host, src)
        try:
            tokens = self._check_header(host, layout, header, start)
            if header.adapter != st.adapter or header.caller_supplied == st.trusted:
                raise errors.failed_precondition("the tail's K/V were computed with another adapter (or by "
                                                 "another party) than the staged tokens'", field="header.adapter")
            host.executor.import_extend(st.staged, tokens)  # the import's own state: nothing else reads it
            count, nbytes = await self._write_chunks(host, layout, st.staged, header, self._idle_bounded(chunks),
                                                     start)
        finally:
            call.cancel()
        st.tokens.extend(tokens)
        st.nbytes += nbytes
        return len(tokens), nbytes

    async def commit_staged(self, st: "StagedKv"):
        """The staged import as a live cache of the current caller (its entry); aborted if that fails."""
        host = st.host
        orphan = (lambda v: host.release_soon(v[0].cache_id, CacheEvent.RECLAIMED))
        try:
            entry, cached = (await host.call(host.executor.import_commit, st.staged, admit=False,
                                             on_orphan=orphan)).value
        except BaseException as exc:
            st.release_claim()
            await self._abort_on(exc, host, st.staged)
            raise
        st.committed = True
        self._imported(host, entry, st.t0, st.trusted, tokens=len(st.tokens), bytes=st.nbytes, cached_blocks=cached,
                       staged=True)
        st.release_claim()  # a live cache of the caller's now
        return entry

    def abort_staged(self, st: "StagedKv") -> asyncio.Task | None:
        """Give a staged import's KV back (after any write of it still queued): the task doing it,
        None once committed or aborted."""
        if st.committed or st.aborted:
            return None
        st.aborted = True
        st.release_claim()
        return self._abort_after_writes(st.host, st.staged)

    async def _import_state(self, host, h: pb.KvTransferHeader, chunks, staged, n: int, t0: int, trusted: bool):
        """An executor's own serialisation (``header.state_format``): checked chunk by chunk,
        loaded at the end on the model's worker; all or nothing as the tensor path."""
        ex = host.executor
        parts: list[bytes] = []
        count = nbytes = 0
        try:
            layout = await self._layout(host)
            # llama.cpp's state of n tokens is their K/V plus a little per cell and a header.
            k_tok = layout.num_kv_heads * layout.head_dim * layout.element_size
            v_tok = layout.num_kv_heads * layout.v_head_dim * layout.element_size
            bound = n * ((k_tok + v_tok) * layout.num_layers + _STATE_BYTES_PER_TOKEN) + _STATE_OVERHEAD_BYTES
            if h.total_bytes > bound:
                raise errors.invalid(f"header.total_bytes = {h.total_bytes}: the state of {n} tokens is at most "
                                     f"{bound} bytes", field="header.total_bytes", limit=bound)
            limit = int(h.total_bytes) or bound
            async for c in chunks:
                if c.index != count:
                    raise errors.invalid(f"chunk {count}: index {c.index}, expected {count}", field="chunk.index")
                if nbytes + len(c.key) + len(c.value) > limit:
                    what = "the header's total_bytes" if h.total_bytes else "the state of its tokens can hold"
                    raise errors.invalid(f"chunk {count}: the stream carries more than {what} ({limit} bytes); "
                                         "nothing was imported", field="chunk.key", limit=limit)
                if checksum(c.key, c.value) != c.checksum:
                    raise errors.FerrumError(errors.ErrorKind.SERIALIZATION, f"chunk {count}: checksum mismatch; the "
                                             "state was corrupted in transit", code=grpc.StatusCode.DATA_LOSS,
                                             field="chunk.checksum")
                parts.append(c.key)
                parts.append(c.value)
                count += 1
                nbytes += len(c.key) + len(c.value)
            if (h.num_chunks and count != h.num_chunks) or (h.total_bytes and nbytes != h.total_bytes) or not nbytes:
                raise errors.FerrumError(
                    errors.ErrorKind.SERIALIZATION, f"the stream ended after {count} of {h.num_chunks or '?'} chunks "
                    f"({nbytes} of {h.total_bytes} bytes); nothing was imported", code=grpc.StatusCode.DATA_LOSS,
                    field="chunk")

            def load():
                ex.import_write_state(staged, b"".join(parts))
                return ex.import_commit(staged)

            orphan = (lambda v: host.release_soon(v[0].cache_id, CacheEvent.RECLAIMED))
            entry, cached = (await host.call(load, admit=False, on_orphan=orphan)).value
        except BaseException as exc:
            await self._abort_on(exc, host, staged)
            raise
        self._imported(host, entry, t0, trusted, tokens=n, chunks=count, bytes=nbytes, format=h.state_format)
        return pb.ImportKvResponse(cache=handle_pb(ex.handle(entry)), imported_tokens=n, bytes=nbytes, chunks=count,
                                   cached_blocks=cached, transfer_ns=time.perf_counter_ns() - t0)

    def _imported(self, host, entry, t0: int, trusted: bool, **fields) -> None:
        """An import landed: the cache belongs to the caller (and says whether a server computed
        its K/V); count its bytes; log it."""
        self.checks.adopt(entry)
        entry.caller_supplied = not trusted
        if self.metrics is not None:
            self.metrics.kv_transfer_bytes.labels(host.model_id, "import").inc(fields["bytes"])
        log.info("kv imported", model_id=host.model_id, cache_id=entry.cache_id,
                 ms=round((time.perf_counter_ns() - t0) / 1e6, 1), **fields)

    def _abort_after_writes(self, host, staged) -> asyncio.Task:
        """Give a failed import's blocks back once every write already handed to the transfer
        thread has run (that thread is FIFO: a no-op submitted now finishes after them), on the
        model's worker (which owns the block pool's bookkeeping). Its own task: a cancelled caller
        cannot interrupt it."""
        ex = host.executor
        loop = asyncio.get_running_loop()
        barrier = asyncio.wrap_future(self._io.submit(lambda: None), loop=loop)

        async def run() -> None:
            try:
                await barrier
                if ex.inline:
                    ex.import_abort(staged)
                else:
                    await asyncio.wrap_future(host.submit(ex.import_abort, staged), loop=loop)
            except RuntimeError:  # the worker is gone (shutdown): the pool goes with it
                pass

        task = loop.create_task(run())
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)
        return task

    # ---- server pull ----------------------------------------------------------------------------
    async def _pull(self, host, src: pb.KvSource) -> tuple[pb.KvTransferHeader, Any, Any]:
        if not src.target or not src.cache_id:
            raise errors.invalid("source needs a target and a cache_id", field="source")
        target = await self.peers.check(src.target)
        stub = executor_pb2_grpc.ModelExecutorStub(self.peers.channel(target, src.tls))
        call = stub.ExportKv(pb.ExportKvRequest(
            model_id=src.model_id or host.model_id, cache_id=src.cache_id, from_token=src.from_token,
            to_token=src.to_token, max_chunk_bytes=src.max_chunk_bytes),
            metadata=self.peers.metadata(current_caller.get()))
        try:
            # a peer that accepts and never answers must not hold the import: the header gets the
            # same idle limit as each chunk after it
            async with asyncio.timeout(self.import_idle_s or None):
                first = await call.read()
        except grpc.aio.AioRpcError as e:
            raise self.peers.refused(target, src.cache_id, e) from None
        except TimeoutError:
            call.cancel()
            raise errors.FerrumError(errors.ErrorKind.TIMEOUT, f"source {target}: ExportKv sent no header within "
                                     f"{self.import_idle_s:g} s", code=grpc.StatusCode.DEADLINE_EXCEEDED,
                                     field="source") from None
        if first is grpc.aio.EOF or first.WhichOneof("message") != "header":
            call.cancel()
            raise errors.FerrumError(errors.ErrorKind.NETWORK, f"source {target}: ExportKv sent no header",
                                     code=grpc.StatusCode.DATA_LOSS, field="source")

        async def chunks():
            try:
                while True:
                    m = await call.read()
                    if m is grpc.aio.EOF:
                        return
                    yield m.chunk
            except grpc.aio.AioRpcError as e:
                raise self.peers.refused(target, src.cache_id, e) from None

        return first.header, chunks(), call

    async def close(self) -> None:
        await self.peers.close()
        self._io.shutdown(wait=False)


class StagedKv:
    """A pulled import staged but not committed (``KvTransfer.stage_pull``)."""

    def __init__(self, host, staged, tokens: list[int], adapter: str, trusted: bool, nbytes: int, t0: int) -> None:
        self.host = host
        self.staged = staged  # the executor's staged import
        self.tokens = tokens
        self.adapter = adapter
        self.trusted = trusted  # a peer computed the K/V (its tail must say the same)
        self.nbytes = nbytes
        self.t0 = t0
        self.committed = self.aborted = False
        #: gives back the room this staged import holds under the caller's cache cap
        self.release_claim: Callable[[], None] = lambda: None


def _verify_and_write(ex, staged, c: pb.KvChunk, where: str) -> None:
    """On the KV-transfer thread: the chunk's checksum (DATA_LOSS), then its write into the
    import's staged (private) blocks."""
    if checksum(c.key, c.value) != c.checksum:
        raise errors.FerrumError(
            errors.ErrorKind.SERIALIZATION, f"{where} (layer {c.layer}, tokens [{c.token_start}, {c.token_end})): "
            "checksum mismatch; the K/V were corrupted in transit", code=grpc.StatusCode.DATA_LOSS,
            field="chunk.checksum")
    ex.import_write(staged, c.layer, int(c.token_start), int(c.token_end), c.key, c.value)


__all__ = ["KvTransfer", "StagedKv", "checksum", "DEFAULT_CHUNK_BYTES"]
