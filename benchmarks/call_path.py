"""Follow one ``Generate`` request through the package, module by module (issue 38's "stops").

Runs a real server in process (the scripted executor, so no model weights are needed), sends one
``Generate`` of ``--tokens`` tokens, and records, on every thread, each call into a function of the
``ferrum_service`` package. Consecutive calls in the same module collapse into one *stop*; a stop in a
module the path had already visited and left is a *return*. Printed for the path from the servicer's
``Generate`` to the executor's first step, and for the whole request; ``--vllm`` sends the same
request through the vLLM engine protocol instead.

    python -m benchmarks.call_path [--tokens 16] [--vllm]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections import Counter

PKG = "ferrum_service."
#: Where an executor's step starts (the plan's one entry; older trees called the trait methods).
STEP_ENTRIES = {"execute", "_step", "prefill", "batch_prefill", "decode", "batch_decode", "unified_decode"}


def _collapse(mods: list[str]) -> tuple[list[str], int]:
    stops: list[str] = []
    returns = 0
    for m in mods:
        if stops and stops[-1] == m:
            continue
        if m in stops:
            returns += 1
        stops.append(m)
    return stops, returns


def trace(tokens: int, vllm: bool) -> dict:
    import grpc

    from ferrum_service.executors.configurable import ConfigurableModelExecutor
    from tests.support.servers import InProcessServer

    ex = ConfigurableModelExecutor.with_token_sequence(1000, [10, 20, 30], model_id="mock", kv_budget_tokens=6000)
    calls: list[tuple[str, str]] = []  # (module, function) in call order, all threads
    recording = threading.Event()

    def prof(frame, event, arg):
        if event == "call" and recording.is_set():
            mod = frame.f_globals.get("__name__", "")
            if mod.startswith(PKG):
                calls.append((mod[len(PKG):], frame.f_code.co_name))
        return None

    with InProcessServer([ex], cache_ttl=0) as srv:
        with grpc.insecure_channel(srv.target) as ch:
            send = _vllm_sender(ch, tokens) if vllm else _native_sender(ch, tokens)
            send()  # warm: first-use imports and caches stay out of the path
            threading.setprofile(prof)
            sys.setprofile(prof)
            srv.loop.call_soon_threadsafe(sys.setprofile, prof)
            recording.set()
            send()
            recording.clear()
            sys.setprofile(None)
            threading.setprofile(None)
            srv.loop.call_soon_threadsafe(sys.setprofile, None)
    entry = "vllm_engine" if vllm else "servicer"
    start = next(i for i, (m, f) in enumerate(calls) if m.endswith(entry) and f == "Generate")
    path = calls[start:]
    step = next((i for i, (m, f) in enumerate(path) if m.startswith("executors.") and f in STEP_ENTRIES), len(path))
    to_step, ret_step = _collapse([m for m, _ in path[:step + 1]])
    named = [f"{m}:{f}" for k, (m, f) in enumerate(path[:step + 1]) if k == 0 or path[k - 1][0] != m]
    whole, ret_whole = _collapse([m for m, _ in path])
    lookups = sum(1 for m, f in path if m == "core.kv_registry" and f == "get")
    return {
        "protocol": "vllm" if vllm else "native",
        "tokens": tokens,
        "to_first_step": {"stops": len(to_step), "modules": len(set(to_step)), "returns": ret_step,
                          "path": named},
        "whole_request": {"stops": len(whole), "modules": len(set(whole)), "returns": ret_whole,
                          "calls": len(path), "registry_gets": lookups,
                          "busiest_modules": Counter(m for m, _ in path).most_common(8)},
    }


def _native_sender(ch, tokens: int):
    from ferrum_client._proto.ferrum.executor.v1 import executor_pb2 as pb
    from ferrum_client._proto.ferrum.executor.v1 import executor_pb2_grpc as pb_grpc

    stub = pb_grpc.ModelExecutorStub(ch)
    req = pb.GenerateRequest(model_id="mock", token_ids=pb.TokenIds(token_ids=[1, 2, 3, 4]),
                             stop=pb.StopConditions(max_tokens=tokens, ignore_eos=True))
    return lambda: list(stub.Generate(req, timeout=30))


def _vllm_sender(ch, tokens: int):
    from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
    from smg_grpc_proto.generated import vllm_engine_pb2_grpc

    stub = vllm_engine_pb2_grpc.VllmEngineStub(ch)
    n = iter(range(1_000_000))

    def send():
        req = vpb.GenerateRequest(request_id=f"trace-{next(n)}", tokenized=vpb.TokenizedInput(input_ids=[1, 2, 3, 4]),
                                  sampling_params=vpb.SamplingParams(max_tokens=tokens, ignore_eos=True))
        return list(stub.Generate(req, timeout=30))
    return send


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--vllm", action="store_true")
    ap.add_argument("--path", action="store_true", help="print the stops up to the first step")
    a = ap.parse_args()
    r = trace(a.tokens, a.vllm)
    if not a.path:
        r["to_first_step"].pop("path")
    print(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
