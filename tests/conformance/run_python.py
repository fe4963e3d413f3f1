"""Run ``tests/conformance/scenario.json`` against a server with the Python client.

    python tests/conformance/run_python.py --target 127.0.0.1:50051   # a fresh server you started
    python tests/conformance/run_python.py --start                    # starts a fresh one itself
    python tests/conformance/run_python.py --start --profile llama-cpp   # tiny on llama.cpp

Prints one line per step (``PASS``, ``FAIL``, ``XFAIL`` for a failing step marked
``known_issue``) and a final ``N passed, N failed`` line; exits 1 when a step failed. The format
is described in README.md next to this file.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for p in (str(REPO / "clients" / "python"), str(REPO)):
    if p not in sys.path:
        sys.path.insert(0, p)

from google.protobuf import json_format  # noqa: E402

from ferrum_client import Client  # noqa: E402
from ferrum_client import requests as rq  # noqa: E402
from ferrum_client._proto.ferrum.executor.v1 import executor_pb2 as pb  # noqa: E402
from ferrum_client._proto.ferrum.executor.v1 import types_pb2 as tpb  # noqa: E402
from ferrum_client.errors import FerrumRpcError  # noqa: E402
from ferrum_client.prefix_mirror import PrefixMirror  # noqa: E402

SCENARIO = HERE / "scenario.json"
_REF = re.compile(r"^\$([A-Za-z_][A-Za-z0-9_]*)(?:\[(-?\d+)\])?$")


class StepFailure(Exception):
    pass


def resolve(value: Any, env: dict[str, Any]) -> Any:
    """Replace ``"$name"`` / ``"$name[i]"`` references with saved values, recursively."""
    if isinstance(value, str):
        m = _REF.match(value)
        if not m:
            return value
        name, idx = m.group(1), m.group(2)
        if name not in env:
            raise StepFailure(f"undefined variable ${name} (the step that saves it failed?)")
        v = env[name]
        if idx is not None:
            try:
                v = v[int(idx)]
            except (IndexError, TypeError, KeyError):
                raise StepFailure(f"{value}: no such element in {v!r}") from None
        return v
    if isinstance(value, list):
        return [resolve(v, env) for v in value]
    if isinstance(value, dict):
        return {k: resolve(v, env) for k, v in value.items()}
    return value


def mismatches(expected: Any, actual: Any, path: str = "") -> list[str]:
    """Differences of ``actual`` from ``expected``: objects are subsets, lists exact (null = any)."""
    if expected is None:
        return []
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            return [f"{path or 'result'}: expected an object, got {actual!r}"]
        out = []
        for k, v in expected.items():
            if k not in actual:
                out.append(f"{path}{'.' if path else ''}{k}: missing (got {sorted(actual)})")
            else:
                out += mismatches(v, actual[k], f"{path}{'.' if path else ''}{k}")
        return out
    if isinstance(expected, list):
        if not isinstance(actual, list) or len(actual) != len(expected):
            return [f"{path}: expected {expected!r}, got {actual!r}"]
        out = []
        for i, (e, a) in enumerate(zip(expected, actual)):
            out += mismatches(e, a, f"{path}[{i}]")
        return out[:1] and [f"{path}: expected {expected!r}, got {actual!r}"]
    if isinstance(expected, bool) or isinstance(actual, bool):
        return [] if expected is actual else [f"{path}: expected {expected!r}, got {actual!r}"]
    return [] if expected == actual else [f"{path}: expected {expected!r}, got {actual!r}"]


def _sampling(sampling: dict) -> tpb.SamplingParams:
    sp = tpb.SamplingParams()
    for k, v in sampling.items():
        if k in ("temperature", "top_p", "min_p", "repetition_penalty"):
            setattr(sp, k, float(v))  # "NaN" / "Infinity" strings become floats
        elif k == "constraint":
            json_format.ParseDict(v, sp.constraint)
        else:
            setattr(sp, k, int(v))
    return sp


def _policy(sampling: dict | None) -> tpb.LogitsPolicy | None:
    if not sampling:
        return None
    return tpb.LogitsPolicy(sampling=_sampling(sampling))


def _handle(h) -> dict:
    return {"cache": h.cache_id, "num_tokens": h.num_tokens, "model_id": h.model_id}


def _token(out) -> int | None:
    return out.token_id if out.HasField("token_id") else None


class Servers:
    """The clients of the run: ``main`` (every step's default) and ``peer`` (the second server of
    the KV handoff steps; None when the run has none), with their targets."""

    def __init__(self, main: Client, main_target: str, peer: Client | None = None, peer_target: str = "") -> None:
        self.clients = {"main": main, "peer": peer}
        self.targets = {"main": main_target, "peer": peer_target}

    def get(self, name: str) -> Client:
        c = self.clients.get(name or "main")
        if c is None:
            raise StepFailure(f"no server {name!r} in this run (a peer needs --peer / a second server)")
        return c


def _kind_name(enum, value: int) -> str:
    return enum.Name(value).split("_KIND_")[-1]


def _collect_events(c: Client, after_seq: int, timeout: float = 15.0) -> tuple[list, bool]:
    """Every event message (block events included, all models) with seq > ``after_seq`` up to the
    server's current sequence number (read first, from ``ListCaches``), and whether the server
    answered ``resync_required``."""
    last = c.list_caches("").as_of_seq
    if last <= after_seq:
        return [], False
    msgs, resync = [], False
    stream = c.subscribe_kv_events("", from_seq=after_seq + 1, include_block_events=True, timeout=timeout)
    try:
        for msg in stream:
            which = msg.WhichOneof("message")
            if which == "resync_required":
                resync = True
                break
            msgs.append(msg)
            seq = msg.event.seq if which == "event" else msg.block_event.seq
            if seq >= last:
                break
    finally:
        stream.cancel()
    return msgs, resync


def _generate(servers: Servers, c: Client, model: str, step: dict) -> dict:
    kw: dict[str, Any] = {"max_tokens": step.get("max_tokens", 16), "ignore_eos": step.get("ignore_eos", False),
                          "stop_token_ids": step.get("stop_token_ids", ()), "n": step.get("n", 1),
                          "cache_salt": step.get("cache_salt", ""),
                          "bypass_prefix_cache": step.get("bypass_prefix_cache", False),
                          "adapter": step.get("adapter", ""), "request_id": step.get("request_id", "")}
    if "tokens" in step:
        kw["token_ids"] = step["tokens"]
    if "text" in step:
        kw["text"] = step["text"]
    sampling = dict(step.get("sampling") or {})
    if "constraint" in sampling:
        kw["constraint"] = _sampling({"constraint": sampling.pop("constraint")}).constraint
    for k, v in sampling.items():
        kw[k] = float(v) if k in ("temperature", "top_p", "min_p", "repetition_penalty") else int(v)
    stream = c.generate(model, timeout=60, **kw)
    n = max(1, kw["n"])
    samples: list[list[int]] = [[] for _ in range(n)]
    reasons: list[str | None] = [None] * n
    res: dict[str, Any] = {"cancelled": False, "finish_reason": None}
    cancel_after, abort_after = step.get("cancel_after"), step.get("abort_after")
    try:
        for ev in stream:
            which = ev.WhichOneof("event")
            if which == "started":
                res["cache"] = ev.started.cache.cache_id
                res["prompt_tokens"] = ev.started.prompt_tokens
                res["cached_tokens"] = ev.started.cached_tokens
            elif which == "token":
                samples[ev.token.sample_index].append(ev.token.token_id)
                count = sum(len(t) for t in samples)
                if cancel_after is not None and count >= cancel_after:
                    stream.cancel()
                    res["cancelled"] = True
                    break
                if abort_after is not None and count == abort_after:
                    r = c.abort(model, request_id=step["request_id"])
                    res["aborted_streams"] = r.aborted_streams
            elif which == "finished":
                f = ev.finished
                reasons[f.sample_index] = _finish_reason_name(f.finish_reason)
                if f.sample_index == 0:
                    res["finish_reason"] = reasons[0]
                    res["prompt_tokens"] = f.prompt_tokens
                    res["generated_tokens"] = f.generated_tokens
                    res["text"] = f.text
        res["end_code"] = "OK"
    except FerrumRpcError as e:
        if abort_after is None:
            raise
        res["end_code"] = e.code.name
    res["tokens"], res["samples"], res["finish_reasons"] = samples[0], samples, reasons
    return res


def _handoff(servers: Servers, step: dict) -> dict:
    """KV handoff of ``cache`` from the step's server to ``to``: ``push`` (this client relays
    ExportKv into ImportKv) or ``pull`` (the destination fetches it from the source itself)."""
    model, src_name = step.get("model", ""), step.get("server") or "main"
    src, dst = servers.get(src_name), servers.get(step["to"])
    reserve = step.get("reserve_tokens", 0)
    if step.get("mode", "push") == "push":
        r = dst.import_kv(model, src.export_kv(model, step["cache"], timeout=60), reserve_tokens=reserve, timeout=60)
    else:
        r = dst.pull_kv(model, servers.targets[src_name], step["cache"], reserve_tokens=reserve, timeout=60)
    return {**_handle(r.cache), "imported_tokens": r.imported_tokens, "chunks": r.chunks, "bytes": r.bytes,
            "cached_blocks": r.cached_blocks}


def execute(servers: Servers | Client, step: dict) -> dict:
    """Run one (resolved) step; the result object its ``expect`` and ``save`` refer to."""
    if isinstance(servers, Client):
        servers = Servers(servers, "")
    c = servers.get(step.get("server", "main"))
    op, model = step["op"], step.get("model", "")
    if op == "info":
        r = c.info(model)
        return {"contract_version": r.contract_version, "server_version": r.server_version,
                "models": {mi.model_id: {"vocab_size": mi.vocab_size, "executor": mi.executor,
                                         "has_tokenizer": mi.has_tokenizer,
                                         "max_sequence_length": mi.max_sequence_length,
                                         "eos_token_ids": list(mi.eos_token_ids)} for mi in r.models}}
    if op == "tokenize":
        return {"tokens": c.tokenize(model, step["text"], step.get("add_special_tokens", False))}
    if op == "detokenize":
        return {"text": c.detokenize(model, step["tokens"], step.get("skip_special_tokens", False))}
    if op == "prefill":
        out = c.prefill(model, step["tokens"], step.get("cache", ""), _policy(step.get("sampling")),
                        cache_salt=step.get("cache_salt", ""), bypass_prefix_cache=step.get("bypass_prefix_cache", False),
                        adapter=step.get("adapter", "")).output
        return {**_handle(out.cache), "token": _token(out.output), "cached_tokens": out.cached_tokens}
    if op == "decode":
        out = c.decode(model, step["cache"], step["token"], _policy(step.get("sampling")), step.get("position")).output
        return {**_handle(out.cache), "token": _token(out.output)}
    if op == "batch_decode":
        r = c.batch_decode(model, [(i["cache"], i["token"], _policy(i.get("sampling")), i.get("position"))
                                   for i in step["inputs"]])
        return {"tokens": [_token(o.output) for o in r.outputs], "num_tokens": [o.cache.num_tokens for o in r.outputs],
                "caches": [o.cache.cache_id for o in r.outputs]}
    if op == "forward_verify":
        r = c.forward_verify(model, step["cache"], step["tokens"], step.get("accept_greedy_prefix", False),
                             _policy(step.get("sampling")))
        return {"tokens": [_token(o) for o in r.outputs], "base_len": r.base_len, "num_tokens": r.cache.num_tokens,
                "accepted_drafts": r.accepted_drafts, "accepted_tokens": list(r.accepted_tokens)}
    if op == "truncate":
        r = c.truncate_kv(model, step["cache"], step["new_len"])
        return {"num_tokens": r.cache.num_tokens, "removed_tokens": r.removed_tokens}
    if op == "release":
        r = c.release_cache(model, step["cache"])
        return {"released": r.released, "freed_tokens": r.freed_tokens}
    if op == "generate":
        return _generate(servers, c, model, step)
    if op == "fork":
        r = c.fork_cache(model, step["cache"], step.get("keep_tokens"), step.get("reserve_tokens", 0))
        return {**_handle(r.cache), "shared_blocks": r.shared_blocks}
    if op == "loads":
        r = c.loads(model)
        ml = next((x for x in r.loads if x.model_id == model), None)
        if ml is None:
            raise StepFailure(f"Loads has no entry for model {model!r}")
        return {"kv_event_seq": r.kv_event_seq, "active_caches": ml.active_caches, "cached_blocks": ml.cached_blocks,
                "block_size": ml.block_size, "prefix_hit_tokens": ml.prefix_hit_tokens,
                "prefix_queried_tokens": ml.prefix_queried_tokens, "resident_tokens": ml.resident_tokens}
    if op == "list_caches":
        r = c.list_caches(model)
        return {"caches": sorted(h.cache_id for h in r.caches), "as_of_seq": r.as_of_seq}
    if op == "kv_events":
        msgs, resync = _collect_events(c, int(step.get("after_seq", 0)))
        evs = [m.event for m in msgs if m.WhichOneof("message") == "event" and m.event.model_id == model]
        stored = sum(len(m.block_event.stored.block_hashes) for m in msgs
                     if m.WhichOneof("message") == "block_event" and m.block_event.model_id == model
                     and m.block_event.WhichOneof("data") == "stored")
        return {"kinds": [_kind_name(pb.KvEventKind, e.kind) for e in evs], "caches": [e.cache_id for e in evs],
                "num_tokens": [e.num_tokens for e in evs], "blocks_stored": stored, "resync_required": resync}
    if op == "mirror":
        mirror = PrefixMirror()
        mirror.set_recipes(c.info(""))
        msgs, resync = _collect_events(c, 0)
        if resync:
            raise StepFailure("the server's replay buffer no longer starts at seq 1 (resync_required)")
        mirror.apply_all(msgs)
        return {"blocks": len(mirror.keys(model)),
                "cached_tokens": mirror.cached_tokens(model, step.get("tokens", []), step.get("cache_salt", ""),
                                                      step.get("adapter", ""))}
    if op == "abort":
        r = c.abort(model, request_id=step.get("request_id"), cache_id=step.get("cache"))
        return {"aborted_streams": r.aborted_streams, "released_cache": r.released_cache}
    if op == "handoff":
        return _handoff(servers, step)
    if op == "load_adapter":
        r = c.load_adapter(step["name"], step["path"], model)
        return {"name": r.adapter.name, "loaded": r.loaded, "rank": r.adapter.rank}
    if op == "unload_adapter":
        r = c.unload_adapter(step["name"], model)
        return {"unloaded": r.unloaded, "dropped_blocks": r.dropped_blocks}
    raise StepFailure(f"unknown op {op!r}")


def _finish_reason_name(value: int) -> str:
    from ferrum_client._proto.ferrum.executor.v1 import executor_pb2 as pb

    return pb.FinishReason.Name(value).removeprefix("FINISH_REASON_")


def run_step(c: Servers | Client, raw: dict, env: dict[str, Any]) -> None:
    """Run a step and check it; raises StepFailure. Saves variables into ``env``."""
    step = {k: (resolve(v, env) if k not in ("expect", "save", "id", "note", "known_issue") else v)
            for k, v in raw.items()}
    code = raw.get("expect_code")
    try:
        result = execute(c, step)
    except FerrumRpcError as e:
        if code is None:
            raise StepFailure(f"unexpected error {e.code.name} ({e.kind}): {e.message}") from None
        if e.code.name != code:
            raise StepFailure(f"expected {code}, got {e.code.name} ({e.kind}): {e.message}") from None
        if raw.get("expect_reason") and e.kind != raw["expect_reason"]:
            raise StepFailure(f"expected ErrorInfo reason {raw['expect_reason']}, got {e.kind!r}: {e.message}") from None
        return
    if code is not None:
        raise StepFailure(f"expected {code}, got success: {result!r}")
    diffs = mismatches(resolve(raw.get("expect", {}), env), result)
    if diffs:
        raise StepFailure("; ".join(diffs))
    for field, var in (raw.get("save") or {}).items():
        if field not in result:
            raise StepFailure(f"save: no field {field!r} in result {sorted(result)}")
        env[var] = result[field]


def scenario_vars(scenario: Path | str = SCENARIO, profile: str = "") -> dict[str, Any]:
    """The variables seeded before the first step: the top-level ``vars``, then the profile's."""
    sc = json.loads(Path(scenario).read_text())
    env = dict(sc.get("vars", {}))
    if profile:
        env.update(sc["profiles"][profile].get("vars", {}))
    return env


def run_scenario(target: str, scenario: Path | str = SCENARIO, out: Callable[[str], None] = print,
                 client: Client | None = None, profile: str = "", peer_target: str = "",
                 env_vars: dict[str, Any] | None = None) -> tuple[int, int, list[dict]]:
    """Run every step (with the variables of ``profile`` seeded, or ``env_vars`` when given:
    ``harness.scenario_vars`` fills their placeholders); ``peer_target`` is the second server of
    the handoff steps. Returns (passed, failed, per-step records). XFAIL and SKIP steps count as
    neither."""
    steps = json.loads(Path(scenario).read_text())["steps"]
    env: dict[str, Any] = dict(env_vars) if env_vars is not None else scenario_vars(scenario, profile)
    env.update(main_target=target, peer_target=peer_target)
    passed = failed = xfailed = skipped = 0
    records = []
    own = client is None
    c = client or Client(target, timeout=60)
    peer = Client(peer_target, timeout=60) if peer_target else None
    servers = Servers(c, target, peer, peer_target)
    try:
        for raw in steps:
            if raw.get("requires") and not env.get(raw["requires"]):
                skipped += 1
                out(f"SKIP {raw['id']} ({raw['op']}): requires {raw['requires']}")
                records.append({"id": raw["id"], "status": "SKIP", "error": None})
                continue
            t0 = time.monotonic()
            deadline = t0 + raw.get("eventually_ms", 0) / 1000
            while True:
                try:
                    run_step(servers, raw, env)
                    err = None
                except StepFailure as e:
                    err = str(e)
                if err is None or time.monotonic() >= deadline:
                    break
                time.sleep(0.1)
            ms = (time.monotonic() - t0) * 1000
            if err is None:
                status = "PASS"
                passed += 1
            elif raw.get("known_issue"):
                status = "XFAIL"
                xfailed += 1
            else:
                status = "FAIL"
                failed += 1
            line = f"{status} {raw['id']} ({raw['op']}, {ms:.0f} ms)"
            if err:
                line += f": {err}"
            if raw.get("known_issue") and status != "PASS":
                line += f" [known issue: {raw['known_issue']}]"
            out(line)
            records.append({"id": raw["id"], "status": status, "error": err})
    finally:
        if own:
            c.close()
        if peer is not None:
            peer.close()
    if xfailed:
        out(f"{xfailed} known issue(s) (XFAIL)")
    if skipped:
        out(f"{skipped} skipped (SKIP: not supported by this profile)")
    out(f"{passed} passed, {failed} failed")
    return passed, failed, records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--target", help="host:port of a FRESH server hosting the scenario's models")
    g.add_argument("--start", action="store_true", help="start a fresh server (tests/conformance/harness.py)")
    ap.add_argument("--scenario", default=str(SCENARIO))
    ap.add_argument("--peer", help="with --target: host:port of the second fresh server (harness.py serve --peer)")
    ap.add_argument("--profile", default="", help="a profile of the scenario (its server models and variables)")
    args = ap.parse_args(argv)
    if args.start:
        from tests.conformance.harness import peer_args, scenario_models, scenario_vars as vars_, server_args, start_server

        models = scenario_models(Path(args.scenario), args.profile)
        with start_server(models, extra_args=server_args(Path(args.scenario), args.profile)) as srv, \
                start_server(models, extra_args=peer_args(Path(args.scenario), args.profile)) as peer:
            _, failed, _ = run_scenario(srv.target, args.scenario, profile=args.profile, peer_target=peer.target,
                                        env_vars=vars_(Path(args.scenario), args.profile))
    else:
        _, failed, _ = run_scenario(args.target, args.scenario, profile=args.profile, peer_target=args.peer or "")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
