"""Building contract messages from plain Python values (shared by the sync and async clients)."""

from __future__ import annotations

import json
from typing import Iterable, Sequence

import numpy as np

from ._proto.ferrum.executor.v1 import executor_pb2 as pb
from ._proto.ferrum.executor.v1 import types_pb2 as tpb

#: Logits dtype names -> the contract's ``DataType``.
DTYPES = {"fp32": tpb.DATA_TYPE_FP32, "fp16": tpb.DATA_TYPE_FP16, "bf16": tpb.DATA_TYPE_BF16}


def constraint(*, json_schema: str | dict | None = None, regex: str | None = None, ebnf_grammar: str | None = None,
               lark_grammar: str | None = None, choices: Sequence[str] | None = None) -> tpb.OutputConstraint:
    """``OutputConstraint`` (structured output): exactly one of a JSON schema (a dict or its JSON
    text), a regex, an EBNF or Lark grammar, or a list of choices."""
    given = {k: v for k, v in dict(json_schema=json_schema, regex=regex, ebnf_grammar=ebnf_grammar,
                                   lark_grammar=lark_grammar, choices=choices).items() if v is not None}
    if len(given) != 1:
        raise ValueError(f"give exactly one constraint, not {sorted(given) or 'none'}")
    (kind, value), = given.items()
    if kind == "choices":
        return tpb.OutputConstraint(choice=tpb.ChoiceList(choices=list(value)))
    if kind == "json_schema" and not isinstance(value, str):
        value = json.dumps(value)
    return tpb.OutputConstraint(**{kind: value})


def sampling(temperature: float = 0.0, *, top_k: int = 0, top_p: float | None = None, min_p: float = 0.0,
             repetition_penalty: float | None = None, penalty_token_ids: Sequence[int] = (),
             seed: int | None = None, token_mask: bytes = b"",
             constraint: tpb.OutputConstraint | None = None) -> tpb.SamplingParams:
    """``SamplingParams``; the defaults are greedy. ``constraint``: see :func:`constraint`."""
    sp = tpb.SamplingParams(temperature=temperature, top_k=top_k, min_p=min_p,
                            penalty_token_ids=list(penalty_token_ids), token_mask=token_mask)
    if constraint is not None:
        sp.constraint.CopyFrom(constraint)
    if top_p is not None:
        sp.top_p = top_p
    if repetition_penalty is not None:
        sp.repetition_penalty = repetition_penalty
    if seed is not None:
        sp.seed = seed
    return sp


def greedy(top_logprobs: int = 0) -> tpb.LogitsPolicy:
    """A greedy token (the default policy), optionally with top-k log-probabilities."""
    return tpb.LogitsPolicy(mode=tpb.OUTPUT_MODE_SAMPLED_TOKEN, top_logprobs=top_logprobs)


def sampled(params: tpb.SamplingParams, top_logprobs: int = 0) -> tpb.LogitsPolicy:
    """A token sampled on the server with ``params``."""
    return tpb.LogitsPolicy(mode=tpb.OUTPUT_MODE_SAMPLED_TOKEN, sampling=params, top_logprobs=top_logprobs)


def full_logits(dtype: str = "fp32") -> tpb.LogitsPolicy:
    """The whole logits row, in fp32 / fp16 / bf16."""
    return tpb.LogitsPolicy(mode=tpb.OUTPUT_MODE_FULL_LOGITS, logits_dtype=DTYPES[dtype])


def top_logprobs(k: int) -> tpb.LogitsPolicy:
    """The k most likely tokens with log-probabilities (nothing sampled)."""
    return tpb.LogitsPolicy(mode=tpb.OUTPUT_MODE_TOP_LOGPROBS, top_logprobs=k)


def no_output() -> tpb.LogitsPolicy:
    """Nothing back (fill the cache only)."""
    return tpb.LogitsPolicy(mode=tpb.OUTPUT_MODE_NONE)


def tensor_array(t: tpb.Tensor) -> np.ndarray:
    """A contract ``Tensor`` as a numpy array (float32 for BF16)."""
    if t.dtype == tpb.DATA_TYPE_FP32:
        a = np.frombuffer(t.data, dtype="<f4")
    elif t.dtype == tpb.DATA_TYPE_FP16:
        a = np.frombuffer(t.data, dtype="<f2")
    elif t.dtype == tpb.DATA_TYPE_BF16:
        a = (np.frombuffer(t.data, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    elif t.dtype == tpb.DATA_TYPE_INT32:
        a = np.frombuffer(t.data, dtype="<i4")
    elif t.dtype == tpb.DATA_TYPE_INT64:
        a = np.frombuffer(t.data, dtype="<i8")
    else:
        raise ValueError(f"unsupported tensor dtype {tpb.DataType.Name(t.dtype)}")
    return a.reshape(list(t.shape)) if t.shape else a


def logits_array(out: tpb.LogitsOutput) -> np.ndarray:
    """The full logits row of a ``LogitsOutput`` (policy ``full_logits``)."""
    return tensor_array(out.logits)


def ids_tensor(ids: np.ndarray) -> tpb.Tensor:
    a = np.ascontiguousarray(ids, dtype="<i8")
    return tpb.Tensor(dtype=tpb.DATA_TYPE_INT64, shape=list(a.shape), data=a.tobytes())


def prefill_input(token_ids: Iterable[int], cache_id: str = "", policy: tpb.LogitsPolicy | None = None,
                  reserve_tokens: int = 0, all_positions: bool = False, request_id: str = "", *,
                  cache_salt: str = "", bypass_prefix_cache: bool = False, adapter: str = "") -> pb.PrefillInput:
    """``PrefillInput``. Prefix caching (a new cache only): ``cache_salt`` keeps tenants with
    different salts from sharing KV blocks; ``bypass_prefix_cache`` computes every token.
    ``adapter``: the LoRA adapter (a name registered with ``load_adapter``) a new cache is computed
    with and bound to; "" = the base model, or, continuing ``cache_id``, the cache's own adapter."""
    return pb.PrefillInput(token_ids=list(token_ids), cache_id=cache_id, logits=policy, reserve_tokens=reserve_tokens,
                           all_positions=all_positions, request_id=request_id, cache_salt=cache_salt,
                           bypass_prefix_cache=bypass_prefix_cache, adapter=adapter)


def decode_input(cache_id: str, token_id: int, policy: tpb.LogitsPolicy | None = None,
                 position: int | None = None) -> pb.DecodeInput:
    m = pb.DecodeInput(cache_id=cache_id, token_id=token_id, logits=policy)
    if position is not None:
        m.position = position
    return m


def unified_item(q_tokens: Iterable[int], *, cache_id: str = "", pos_offset: int = 0, is_final_chunk: bool = True,
                 seq_id: str = "", policy: tpb.LogitsPolicy | None = None, cache_salt: str = "",
                 bypass_prefix_cache: bool = False, adapter: str = "") -> pb.UnifiedBatchItem:
    """``UnifiedBatchItem``; ``cache_salt`` / ``bypass_prefix_cache`` / ``adapter`` as in
    :func:`prefill_input`."""
    return pb.UnifiedBatchItem(seq_id=seq_id, q_tokens=list(q_tokens), cache_id=cache_id, pos_offset=pos_offset,
                               is_final_chunk=is_final_chunk, logits=policy, cache_salt=cache_salt,
                               bypass_prefix_cache=bypass_prefix_cache, adapter=adapter)


def generate_request(model_id: str, *, token_ids: Sequence[int] | None = None, text: str | None = None,
                     chat: Sequence[tuple[str, str]] | None = None, cache_id: str = "",
                     last_token_id: int | None = None, max_tokens: int = 16, temperature: float = 0.0,
                     top_k: int = 0, top_p: float | None = None, min_p: float = 0.0,
                     repetition_penalty: float | None = None, seed: int | None = None,
                     stop_token_ids: Sequence[int] = (), stop_sequences: Sequence[str] = (), ignore_eos: bool = False,
                     top_logprobs: int = 0, keep_cache: bool = False, stream_text: bool = False,
                     request_id: str = "", cache_salt: str = "", bypass_prefix_cache: bool = False,
                     n: int = 1, constraint: tpb.OutputConstraint | None = None,
                     adapter: str = "", resume_token: str = "",
                     speculation: "pb.SpeculationOptions | int | None" = None,
                     migration_mode: "pb.MigrationMode | str" = 0) -> pb.GenerateRequest:
    """``GenerateRequest``: the prompt as ``token_ids``, ``text`` or ``chat`` (or continue
    ``cache_id`` from ``last_token_id``). ``n`` samples of one prompt share its prefilled KV
    (events carry ``sample_index``; sample ``i`` uses seed ``seed + i * 0x9E3779B9``); ``cache_salt`` /
    ``bypass_prefix_cache`` control prefix caching as in :func:`prefill_input`; ``constraint``
    (:func:`constraint`) makes the output follow a JSON schema, regex, grammar or choice list;
    ``adapter`` names the LoRA adapter to generate with (as in :func:`prefill_input`; continuing
    ``cache_id``, "" = the cache's own); ``resume_token`` resumes a stream another server moved here
    (``GenerateMigrated``; the clients' ``generate`` follows those by itself); ``speculation``:
    server-side n-gram speculation, a ``SpeculationOptions`` or its ``max_draft_tokens`` (None = the
    server's default); ``migration_mode``: ``"relay"`` (``MIGRATION_MODE_RELAY``: a moved stream
    goes on on this stream, the server relaying it) or ``"follow"`` (the default: it ends with
    ``GenerateMigrated``, which the clients' ``generate`` follows)."""
    req = pb.GenerateRequest(
        model_id=model_id, cache_id=cache_id,
        sampling=sampling(temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                          repetition_penalty=repetition_penalty, seed=seed, constraint=constraint),
        stop=pb.StopConditions(max_tokens=max_tokens, stop_token_ids=list(stop_token_ids),
                               stop_sequences=list(stop_sequences), ignore_eos=ignore_eos),
        top_logprobs=top_logprobs, keep_cache=keep_cache, stream_text=stream_text, request_id=request_id,
        cache_salt=cache_salt, bypass_prefix_cache=bypass_prefix_cache, n=n, adapter=adapter,
        resume_token=resume_token,
        migration_mode=(pb.MigrationMode.Value(f"MIGRATION_MODE_{migration_mode.upper()}")
                        if isinstance(migration_mode, str) else migration_mode),
    )
    if token_ids is not None:
        req.token_ids.token_ids.extend(token_ids)
    elif text is not None:
        req.text = text
    elif chat is not None:
        for role, content in chat:
            req.chat.messages.add(role=role, content=content)
    if last_token_id is not None:
        req.last_token_id = last_token_id
    if isinstance(speculation, int):
        req.speculation.max_draft_tokens = speculation
    elif speculation is not None:
        req.speculation.CopyFrom(speculation)
    return req
