"""Serving traffic for the metrics tests: ``Generate`` streams on both protocols, a refused
request and a cancelled stream, against a running server."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from ferrum_client import Client, FerrumRpcError


@dataclass
class Sent:
    """What the traffic did: finished streams' prompt and generated tokens, by finish reason."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    streams: int = 0  # streams that sent at least one token
    finishes: dict[str, int] = field(default_factory=dict)
    request_ids: list[str] = field(default_factory=list)

    def add(self, prompt: int, generated: int, finish: str, request_id: str = "") -> None:
        self.prompt_tokens += prompt
        self.generated_tokens += generated
        self.streams += generated > 0
        self.finishes[finish] = self.finishes.get(finish, 0) + 1
        if request_id:
            self.request_ids.append(request_id)


def serving_traffic(target: str, model: str, rounds: int = 3) -> Sent:
    """``rounds`` native streams (length), ``rounds`` vLLM-protocol streams, one refused request
    (INVALID_ARGUMENT) and one stream cancelled after its first token."""
    sent = Sent()
    with Client(target) as c:
        for i in range(rounds):
            rid = f"native-{i}"
            prompt = list(range(1, 4 + i))
            toks = c.generate(model, token_ids=prompt, max_tokens=5 + i, request_id=rid).tokens()
            sent.add(len(prompt), len(toks), "length", rid)
        try:
            c.generate(model, token_ids=[10 ** 6], max_tokens=2, request_id="refused").tokens()
        except FerrumRpcError:
            pass
        stream = c.generate(model, token_ids=[1, 2], max_tokens=4000, request_id="cancelled")
        events = iter(stream)
        while next(events).WhichOneof("event") != "token":
            pass
        stream.cancel()
    with grpc.insecure_channel(target) as ch:
        engine = vllm_engine_pb2_grpc.VllmEngineStub(ch)
        for i in range(rounds):
            rid = f"vllm-{i}"
            ids = list(range(2, 6 + i))
            req = vpb.GenerateRequest(request_id=rid, tokenized=vpb.TokenizedInput(input_ids=ids), stream=True,
                                      sampling_params=vpb.SamplingParams(max_tokens=4, ignore_eos=True))
            out = list(engine.Generate(req, timeout=60))
            sent.add(len(ids), sum(len(r.chunk.token_ids) for r in out if r.WhichOneof("response") == "chunk"),
                     "length", rid)
    return sent
