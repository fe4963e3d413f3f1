"""The size limits of vLLM's engine protocol (``vllm.grpc.engine.VllmEngine``, from the
``smg-grpc-proto`` package: not ours, so not annotated): one table, checked like the contract's
``buf.validate`` annotations (:mod:`.limits`) before any work. Where a field means what a contract
field means, its limit is read from the contract's annotation, so each number is written once.
Fields our engine refuses anyway (multimodal inputs) get small bounds: a flood of them is refused
before it is looked at; a profile's ``output_dir`` is one subdirectory name (``hosting/profiler.py``).
"""

from __future__ import annotations

from ferrum_client._proto.ferrum.executor.v1 import executor_pb2 as pb
from ferrum_client._proto.ferrum.executor.v1 import types_pb2 as tpb

from ..core.request_limits import Bound, declared, limit_of
from ..hosting.profiler import MAX_SUBDIR_CHARS

#: Ids and names (request ids, hosts, keys, dtypes): the contract's ``model_id`` bound.
ID_CHARS = limit_of(pb.InfoRequest, "model_id")
#: Paths and URLs: the contract's ``LoadAdapterRequest.path`` bound.
PATH_CHARS = limit_of(pb.LoadAdapterRequest, "path")
#: Text to tokenize: the contract's ``TokenizeRequest.text`` bound.
TEXT_CHARS = limit_of(pb.TokenizeRequest, "text")
#: A prompt's token ids: the contract's ``TokenIds.token_ids`` bound.
PROMPT_IDS = limit_of(pb.TokenIds, "token_ids")
#: One constraint (schema, regex, grammar, each choice), in bytes: ``OutputConstraint.json_schema``.
CONSTRAINT_BYTES = limit_of(tpb.OutputConstraint, "json_schema")
#: Request ids one ``Abort`` may name: as many sequences as one contract batch holds.
ABORT_IDS = limit_of(pb.BatchDecodeRequest, "inputs")
#: One tensor's bytes, dimensions: the contract's ``Tensor`` bounds.
TENSOR_BYTES = limit_of(tpb.Tensor, "data")
TENSOR_DIMS = limit_of(tpb.Tensor, "shape")
#: Entries of the refused multimodal lists and maps, and of a profile's activities.
FEW = 64



def _contract(message, field: str) -> Bound:
    """A contract field's whole declared bound (count and item length)."""
    return declared(message.DESCRIPTOR.fields_by_name[field])


_ids = Bound(chars=ID_CHARS)
_constraint = Bound(bytes=CONSTRAINT_BYTES)
_names = Bound(count=FEW, chars=ID_CHARS)

#: {message full name: {field name: Bound}} for every request message of ``VllmEngine``.
VLLM_LIMITS: dict[str, dict[str, Bound]] = {
    "vllm.grpc.engine.GenerateRequest": {
        "request_id": _ids, "text": Bound(chars=TEXT_CHARS), "extra_mm_inputs": Bound(count=FEW),
        "kv_transfer_params_json": Bound(chars=PATH_CHARS)},
    "vllm.grpc.engine.TokenizedInput": {"original_text": Bound(chars=TEXT_CHARS),
                                        "input_ids": Bound(count=PROMPT_IDS)},
    "vllm.grpc.engine.SamplingParams": {
        "stop": _contract(pb.StopConditions, "stop_sequences"),
        "stop_token_ids": Bound(count=limit_of(pb.StopConditions, "stop_token_ids")),
        "logit_bias": Bound(count=FEW),
        "json_schema": _constraint, "regex": _constraint, "grammar": _constraint, "structural_tag": _constraint},
    "vllm.grpc.engine.ChoiceConstraint": {"choices": _contract(tpb.ChoiceList, "choices")},
    "vllm.grpc.engine.KvTransferParams": {"remote_host": _ids},
    "vllm.grpc.engine.MultimodalInputs": {
        "model_specific_tensors": Bound(count=FEW, key_chars=ID_CHARS), "mm_placeholders": Bound(count=FEW),
        "mm_hashes": _names, "batched_keys": _names, "keep_on_cpu_keys": _names,
        "flat_keys": Bound(count=FEW, chars=ID_CHARS, key_chars=ID_CHARS), "encoder_input_key": _ids},
    "vllm.grpc.engine.TensorData": {"shape": Bound(count=TENSOR_DIMS), "dtype": _ids,
                                    "inline": Bound(bytes=TENSOR_BYTES)},
    "smg.grpc.common.ShmHandle": {"name": _ids, "owner_id": _ids},
    "smg.grpc.common.RemoteTensorHandle": {"transport": _ids, "descriptor": Bound(bytes=PATH_CHARS)},
    "vllm.grpc.engine.MediaRefs": {"items": Bound(count=FEW)},
    "vllm.grpc.engine.MediaRef": {"url": Bound(chars=PATH_CHARS)},
    "vllm.grpc.engine.EmbedRequest": {"request_id": _ids},
    "vllm.grpc.engine.AbortRequest": {"request_ids": Bound(count=ABORT_IDS, chars=ID_CHARS)},
    "vllm.grpc.engine.GetLoadsRequest": {"include": _names},
    "smg.grpc.common.StartProfileRequest": {"output_dir": Bound(chars=MAX_SUBDIR_CHARS),
                                           "activities": _names},
}
