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

from ferrum_client import Client  # noqa: E402
from ferrum_client._proto.ferrum.executor.v1 import types_pb2 as tpb  # noqa: E402
from ferrum_client.errors import FerrumRpcError  # noqa: E402

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


def _policy(sampling: dict | None) -> tpb.LogitsPolicy | None:
    if not sampling:
        return None
    sp = tpb.SamplingParams()
    for k, v in sampling.items():
        if k in ("temperature", "top_p", "min_p", "repetition_penalty"):
            setattr(sp, k, float(v))  # "NaN" / "Infinity" strings become floats
        else:
            setattr(sp, k, int(v))
    return tpb.LogitsPolicy(sampling=sp)


def _handle(h) -> dict:
    return {"cache": h.cache_id, "num_tokens": h.num_tokens, "model_id": h.model_id}


def _token(out) -> int | None:
    return out.token_id if out.HasField("token_id") else None


def execute(c: Client, step: dict) -> dict:
    """Run one (resolved) step; the result object its ``expect`` and ``save`` refer to."""
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
        out = c.prefill(model, step["tokens"], step.get("cache", ""), _policy(step.get("sampling"))).output
        return {**_handle(out.cache), "token": _token(out.output)}
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
        kw: dict[str, Any] = {"max_tokens": step.get("max_tokens", 16), "ignore_eos": step.get("ignore_eos", False),
                              "stop_token_ids": step.get("stop_token_ids", ())}
        if "tokens" in step:
            kw["token_ids"] = step["tokens"]
        if "text" in step:
            kw["text"] = step["text"]
        for k, v in (step.get("sampling") or {}).items():
            kw[k] = float(v) if k in ("temperature", "top_p", "min_p", "repetition_penalty") else int(v)
        stream = c.generate(model, timeout=60, **kw)
        res: dict[str, Any] = {"tokens": [], "cancelled": False, "finish_reason": None}
        cancel_after = step.get("cancel_after")
        for ev in stream:
            which = ev.WhichOneof("event")
            if which == "started":
                res["cache"] = ev.started.cache.cache_id
                res["prompt_tokens"] = ev.started.prompt_tokens
            elif which == "token":
                res["tokens"].append(ev.token.token_id)
                if cancel_after is not None and len(res["tokens"]) >= cancel_after:
                    stream.cancel()
                    res["cancelled"] = True
                    break
            elif which == "finished":
                f = ev.finished
                res["finish_reason"] = _finish_reason_name(f.finish_reason)
                res["prompt_tokens"] = f.prompt_tokens
                res["generated_tokens"] = f.generated_tokens
        return res
    raise StepFailure(f"unknown op {op!r}")


def _finish_reason_name(value: int) -> str:
    from ferrum_client._proto.ferrum.executor.v1 import executor_pb2 as pb

    return pb.FinishReason.Name(value).removeprefix("FINISH_REASON_")


def run_step(c: Client, raw: dict, env: dict[str, Any]) -> None:
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
                 client: Client | None = None, profile: str = "") -> tuple[int, int, list[dict]]:
    """Run every step (with the variables of ``profile`` seeded); returns (passed, failed,
    per-step records). XFAIL steps count as neither."""
    steps = json.loads(Path(scenario).read_text())["steps"]
    env: dict[str, Any] = scenario_vars(scenario, profile)
    passed = failed = xfailed = 0
    records = []
    own = client is None
    c = client or Client(target, timeout=60)
    try:
        for raw in steps:
            t0 = time.monotonic()
            deadline = t0 + raw.get("eventually_ms", 0) / 1000
            while True:
                try:
                    run_step(c, raw, env)
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
    if xfailed:
        out(f"{xfailed} known issue(s) (XFAIL)")
    out(f"{passed} passed, {failed} failed")
    return passed, failed, records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--target", help="host:port of a FRESH server hosting the scenario's models")
    g.add_argument("--start", action="store_true", help="start a fresh server (tests/conformance/harness.py)")
    ap.add_argument("--scenario", default=str(SCENARIO))
    ap.add_argument("--profile", default="", help="a profile of the scenario (its server models and variables)")
    args = ap.parse_args(argv)
    if args.start:
        from tests.conformance.harness import scenario_models, start_server

        with start_server(scenario_models(Path(args.scenario), args.profile)) as srv:
            _, failed, _ = run_scenario(srv.target, args.scenario, profile=args.profile)
    else:
        _, failed, _ = run_scenario(args.target, args.scenario, profile=args.profile)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
