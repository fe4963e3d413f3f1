"""``ferrum-service``: serve executors, or stream a reply from a running server.

Every ``serve`` flag can also come from an environment variable ``FERRUM_<FLAG>`` (e.g.
``FERRUM_PORT``, ``FERRUM_MODEL`` — several specs separated by ``;``) or from a YAML config file
(``--config``) with the flags' long names as keys and a ``models:`` list. Precedence: flag >
environment > config file > default.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import yaml

from . import __version__
from .errors import FerrumError

SERVE_FLAGS = {
    # name: (type, default, help)
    "host": (str, "0.0.0.0", "bind address"),
    "port": (int, 50051, "gRPC port (0 = pick a free one; the chosen port is logged)"),
    "metrics_port": (int, 9090, "Prometheus /metrics HTTP port (0 = off)"),
    "device": (str, "auto", "auto | cpu | cuda | cuda:N (default for models that do not set one)"),
    "dtype": (str, "auto", "auto | fp32 | fp16 | bf16 | int8 (int8: weight-only, bf16 activations; causal LMs) "
                           "(default for models that do not set one)"),
    "kv_budget_tokens": (int, 0, "KV budget per model in tokens (0 = the executor's default)"),
    "kv_budget_bytes": (int, 0, "KV budget per model in bytes of K and V (0 = the executor's default: 1 GiB on "
                        "transformers; on llama.cpp 10% of the available memory, at most n_seq training contexts)"),
    "max_message_bytes": (int, 64 * 1024 * 1024, "largest gRPC message accepted or sent"),
    "max_batch": (int, 64, "most Generate streams batched into one decode step"),
    "speculation_draft_tokens": (int, 0, "server-side n-gram speculation for Generate requests that set no "
                                 "`speculation` option: draft tokens per step (0 = off; at most 16)"),
    "grace_period": (float, 20.0, "seconds in-flight streams get on SIGTERM"),
    "cache_ttl": (float, 600.0, "seconds an ownerless cache (made by unary RPCs) may sit idle before it is "
                  "reclaimed (0 = never)"),
    "origin_idle_ttl": (float, 60.0, "seconds after which the ownerless caches of an origin (caller@host) that "
                        "has made no call for that long are reclaimed, before --cache-ttl (0 = off)"),
    "max_queue": (int, 256, "steps that may wait for one model's worker before new ones get "
                  "RESOURCE_EXHAUSTED (0 = unbounded)"),
    "max_step_bytes": (int, 2 * 1024**3, "transient memory one forward may need (masks, activations, logits); "
                       "a request over it is INVALID_ARGUMENT (0 = no limit)"),
    "max_text_bytes": (int, 1024 * 1024, "UTF-8 bytes of text one request may ask to tokenize"),
    "max_caches": (int, 2048, "live caches per model (forks and empty reservations included); more are "
                   "RESOURCE_EXHAUSTED (0 = only the executor's own limit, e.g. llama.cpp's n_seq)"),
    "max_caches_per_caller": (int, 512, "live caches one caller (token / client certificate; unauthenticated "
                              "callers are one) may hold per model; more are RESOURCE_EXHAUSTED (0 = no cap)"),
    "max_compile_seconds": (float, 10.0, "longest a structured-output constraint may take to compile (also "
                            "bounded by the request's deadline); slower ones are INVALID_ARGUMENT (0 = deadline only)"),
    "stall_timeout": (float, 120.0, "seconds a model may have work queued with no step completing before its "
                      "gRPC health (and the server's \"\") turns NOT_SERVING (0 = never)"),
    "otlp_endpoint": (str, None, "OTLP/gRPC endpoint for OpenTelemetry traces (off when unset, unless the "
                      "standard OTEL_* variables name one)"),
    "role": (str, "both", "both | prefill | decode: what this server is deployed for, advertised in Info "
             "(prefill: refuses decode steps; decode: refuses new prompts, decodes imported caches)"),
    "kv_event_replay_bytes": (int, 64 * 1024 * 1024, "bytes (estimated) of KV events kept for SubscribeKvEvents "
                              "replay, besides the 65,536-event bound (0 = events only)"),
    "max_kv_event_subscribers": (int, 128, "open SubscribeKvEvents streams past which new ones get "
                                 "RESOURCE_EXHAUSTED (0 = no cap)"),
    "max_kv_event_subscribers_per_caller": (int, 16, "open SubscribeKvEvents streams per caller identity (per "
                                            "client host without auth) (0 = no cap)"),
    "log_format": (str, "auto", "json | console | auto"),
    "log_level": (str, "info", "debug | info | warning | error"),
    "tls_cert": (str, None, "PEM certificate chain (enables TLS)"),
    "tls_key": (str, None, "PEM private key"),
    "tls_client_ca": (str, None, "PEM CA bundle: require and verify client certificates (mutual TLS)"),
    "auth_token_file": (str, None, "file with bearer tokens (one per line) callers must send"),
    "admin_token_file": (str, None, "file with tokens allowed to call Warmup/Shutdown"),
    "kv_peer": (list, None, "HOST:PORT of a server ImportKv may pull KV from (repeatable; env and config: a "
                "comma-separated list); no peer = every pull is refused"),
    "kv_peer_token_file": (str, None, "file with KV peer tokens: the first is sent when pulling from a peer, "
                           "every one lets a peer call ExportKv on its caller's behalf (and nothing else)"),
    "kv_peer_ca": (str, None, "PEM CA bundle that peers' certificates must chain to (TLS for pulls)"),
    "kv_peer_cert": (str, None, "PEM client certificate this server presents to peers (mutual TLS for pulls)"),
    "kv_peer_key": (str, None, "PEM private key of --kv-peer-cert"),
    "kv_import_idle_timeout": (float, 30.0, "seconds a staged ImportKv may wait for its next chunk before it is "
                               "dropped and its KV given back (0 = no limit)"),
    "drain_to": (str, None, "HOST:PORT of a KV peer that a drain (SIGTERM) moves every running Generate stream "
                 "to, instead of waiting for it (live migration; the peer must count this server as its KV peer)"),
    "advertise_address": (str, None, "HOST:PORT peers reach this server at (default: --host:--port when "
                          "--host is a concrete address); needed to move streams to peers"),
    "migration_resume_s": (float, 30.0, "seconds a stream moved here waits for its caller's resume before it is "
                           "dropped"),
    "migration_precopy_tokens": (int, 256, "a stream whose cache holds this many tokens has its KV pre-copied to "
                                 "the target while it decodes on, so that its pause moves only the tail (0 = never)"),
}


def _env_name(flag: str) -> str:
    return "FERRUM_" + flag.upper()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ferrum-service", description=__doc__.split("\n\n")[0])
    p.add_argument("--version", action="version", version=f"ferrum-service {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="host executors behind the gRPC contract")
    s.add_argument("--config", default=os.environ.get("FERRUM_CONFIG"), help="YAML config file")
    s.add_argument("--adapter", action="append", default=None, metavar="[MODEL:]NAME=PATH",
                   help="preload a LoRA adapter (a PEFT directory) on a model (MODEL may be left out when one "
                        "causal LM is hosted); repeatable")
    s.add_argument("--model", action="append", default=None, metavar="SPEC",
                   help="executor to host, EXECUTOR[,key=value...] (repeatable); default: smollm2 (llama.cpp on CPU-only machines, transformers on CUDA) + minilm")
    for name, (typ, _default, help_) in SERVE_FLAGS.items():
        if typ is list:  # repeatable
            s.add_argument("--" + name.replace("_", "-"), action="append", default=None,
                           help=f"{help_} [{_env_name(name)}]")
            continue
        s.add_argument("--" + name.replace("_", "-"), type=typ, default=None, help=f"{help_} [{_env_name(name)}]")
    s.add_argument("--no-reflection", action="store_true", default=None, help="turn server reflection off")
    s.add_argument("--trust-remote-code", action="store_true", default=None,
                   help="allow models that ship code (off: such models are refused)")
    s.add_argument("--open-admin-rpcs", action="store_true", default=None,
                   help="let any caller call Warmup/Shutdown when no admin token is configured "
                        "(default: PERMISSION_DENIED)")
    s.add_argument("--no-prefix-cache", action="store_true", default=None,
                   help="turn automatic prefix caching off (every prompt is computed in full) [FERRUM_NO_PREFIX_CACHE=1]")
    s.add_argument("--allow-pickle", action="store_true", default=None,
                   help="allow pickled weights (*.bin; unpickling can run code) where a model has no safetensors")

    g = sub.add_parser("generate", help="stream a reply from a running server")
    g.add_argument("prompt", help="the user message (sent through the model's chat template)")
    g.add_argument("--target", default=os.environ.get("FERRUM_TARGET", "localhost:50051"),
                   help="the server, HOST:PORT (env FERRUM_TARGET; default localhost:50051)")
    g.add_argument("--model-id", default="", help="model to use (default: the first causal LM hosted)")
    g.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (same seed, same reply)")
    g.add_argument("--raw", action="store_true", help="send the prompt as plain text, without the chat template")
    g.add_argument("--token", default=os.environ.get("FERRUM_TOKEN"), help="bearer token")
    return p


def resolve_serve_settings(args: argparse.Namespace) -> dict:
    """Merge flags, environment and config file into one settings dict."""
    cfg: dict = {}
    if args.config:
        cfg = yaml.safe_load(Path(args.config).read_text()) or {}
        if not isinstance(cfg, dict):
            raise SystemExit(f"{args.config}: the config file must be a mapping")
    out: dict = {}
    for name, (typ, default, _h) in SERVE_FLAGS.items():
        v = getattr(args, name)
        if v is None and _env_name(name) in os.environ:
            v = _split(os.environ[_env_name(name)]) if typ is list else typ(os.environ[_env_name(name)])
        if v is None:
            v = cfg.get(name, cfg.get(name.replace("_", "-"), default))
            if typ is list and isinstance(v, str):
                v = _split(v)
        out[name] = v
    out["reflection"] = not (args.no_reflection or os.environ.get("FERRUM_NO_REFLECTION") == "1"
                             or cfg.get("reflection") is False)
    out["trust_remote_code"] = bool(args.trust_remote_code or os.environ.get("FERRUM_TRUST_REMOTE_CODE") == "1"
                                    or cfg.get("trust_remote_code"))
    out["open_admin_rpcs"] = bool(args.open_admin_rpcs or os.environ.get("FERRUM_OPEN_ADMIN_RPCS") == "1"
                                  or cfg.get("open_admin_rpcs"))
    out["prefix_cache"] = not (args.no_prefix_cache or os.environ.get("FERRUM_NO_PREFIX_CACHE") == "1"
                               or cfg.get("prefix_cache") is False)
    out["allow_pickle"] = bool(args.allow_pickle or os.environ.get("FERRUM_ALLOW_PICKLE") == "1"
                               or cfg.get("allow_pickle"))
    from .model_specs import DEFAULT_MODELS, parse_spec, spec_from_mapping

    if args.model:
        specs = [parse_spec(m) for m in args.model]
    elif os.environ.get("FERRUM_MODEL"):
        specs = [parse_spec(m) for m in os.environ["FERRUM_MODEL"].split(";") if m.strip()]
    elif cfg.get("models"):
        specs = [spec_from_mapping(m) if isinstance(m, dict) else parse_spec(str(m)) for m in cfg["models"]]
    else:
        specs = [parse_spec(m) for m in DEFAULT_MODELS]
    out["specs"] = specs
    out["adapters"] = _adapter_flags(getattr(args, "adapter", None) or [], specs)
    return out


def _adapter_flags(flags: list[str], specs) -> dict[str, dict[str, str]]:
    """``--adapter [MODEL:]NAME=PATH`` flags and the specs' own adapters, per model id."""
    from .model_specs import spec_adapters

    out = {s.model_id: spec_adapters(s) for s in specs}
    for f in flags:
        head, sep, path = f.partition("=")
        if not sep or not head or not path:
            raise SystemExit(f"--adapter {f!r}: expected [MODEL:]NAME=PATH")
        model, _, name = head.rpartition(":")
        if not model:
            causal = [s.model_id for s in specs if s.executor not in ("bert", "minilm", "stub", "configurable")]
            if len(causal) != 1:
                raise SystemExit(f"--adapter {f!r}: name the model (MODEL:NAME=PATH); hosted: {', '.join(causal)}")
            model = causal[0]
        if model not in out:
            raise SystemExit(f"--adapter {f!r}: no model {model!r} is hosted")
        out[model][name] = path
    return out


def _split(v: str) -> list[str]:
    return [x.strip() for x in v.split(",") if x.strip()]


def _read_tokens(path: str | None) -> list[str]:
    if not path:
        return []
    return [ln.strip() for ln in Path(path).read_text().splitlines() if ln.strip() and not ln.startswith("#")]


def cmd_serve(args: argparse.Namespace) -> int:
    st = resolve_serve_settings(args)
    if st["role"] not in ("both", "prefill", "decode"):
        print(f"--role must be both, prefill or decode, not {st['role']!r}", file=sys.stderr)
        return 2
    from .kv_peers import normalize_peer, normalize_target

    # --kv-peer: HOST:PORT or HOST:* (every port of one host); --drain-to names one server
    bad = [p for p in st["kv_peer"] or [] if normalize_peer(p) is None]
    bad += [p for p in [st["drain_to"]] if p and normalize_target(p) is None]
    if bad or bool(st["kv_peer_cert"]) != bool(st["kv_peer_key"]):
        print(f"--kv-peer takes HOST:PORT or HOST:*, --drain-to HOST:PORT (not {bad[0]!r})" if bad else "--kv-peer-cert and --kv-peer-key go together",
              file=sys.stderr)
        return 2
    from . import logs

    logs.configure(st["log_format"], st["log_level"])
    import structlog
    import torch

    from .host import new_worker
    from .model_specs import build_executor
    from .server import ServerConfig, serve

    log = structlog.get_logger("ferrum_service.cli")
    torch.set_num_threads(max(1, int(os.environ.get("FERRUM_TORCH_THREADS", os.cpu_count() or 1))))
    executors, workers = [], []
    for spec in st["specs"]:
        t0 = time.perf_counter()
        log.info("loading model", executor=spec.executor, model_id=spec.model_id)
        # Loaded on the thread that will serve it: one OpenMP team per model (see host.new_worker).
        worker = new_worker(spec.model_id)
        try:
            ex = worker.submit(build_executor, spec, device=st["device"], dtype=st["dtype"],
                               kv_budget_tokens=st["kv_budget_tokens"] or None,
                               kv_budget_bytes=st["kv_budget_bytes"] or None,
                               trust_remote_code=st["trust_remote_code"], allow_pickle=st["allow_pickle"],
                               prefix_cache=st["prefix_cache"]).result()
            for name, path in st["adapters"].get(spec.model_id, {}).items():
                worker.submit(ex.load_adapter, name, path).result()
        except (ValueError, FileNotFoundError, ImportError, OSError, RuntimeError, FerrumError) as e:
            log.error("could not load model", executor=spec.executor, model_id=spec.model_id, error=str(e))
            worker.shutdown(wait=False)
            return 2
        info = ex.info()
        log.info("model ready", model_id=info.model_id, executor=info.executor, device=info.device,
                 dtype=info.dtype, layers=info.num_layers, vocab=info.vocab_size,
                 seconds=round(time.perf_counter() - t0, 2))
        executors.append(ex)
        workers.append(worker)
    cfg = ServerConfig(
        host=st["host"], port=st["port"], metrics_port=st["metrics_port"],
        max_message_bytes=st["max_message_bytes"], grace_period=st["grace_period"], reflection=st["reflection"],
        tls_cert=st["tls_cert"], tls_key=st["tls_key"], tls_client_ca=st["tls_client_ca"],
        auth_tokens=_read_tokens(st["auth_token_file"]) or
        ([os.environ["FERRUM_AUTH_TOKEN"]] if os.environ.get("FERRUM_AUTH_TOKEN") else []),
        admin_tokens=_read_tokens(st["admin_token_file"]) or
        ([os.environ["FERRUM_ADMIN_TOKEN"]] if os.environ.get("FERRUM_ADMIN_TOKEN") else []),
        max_batch=st["max_batch"], cache_ttl=st["cache_ttl"], origin_idle_ttl=st["origin_idle_ttl"],
        max_queue=st["max_queue"], speculation_draft_tokens=st["speculation_draft_tokens"],
        open_admin_rpcs=st["open_admin_rpcs"], max_step_bytes=st["max_step_bytes"],
        max_text_bytes=st["max_text_bytes"], otlp_endpoint=st["otlp_endpoint"], role=st["role"],
        kv_event_replay_bytes=st["kv_event_replay_bytes"], max_kv_event_subscribers=st["max_kv_event_subscribers"],
        max_kv_event_subscribers_per_caller=st["max_kv_event_subscribers_per_caller"],
        kv_peers=list(st["kv_peer"] or []), kv_peer_tokens=_read_tokens(st["kv_peer_token_file"]),
        kv_peer_ca=st["kv_peer_ca"], kv_peer_cert=st["kv_peer_cert"], kv_peer_key=st["kv_peer_key"],
        kv_import_idle_timeout=st["kv_import_idle_timeout"],
        drain_to=st["drain_to"] or "", advertise_address=st["advertise_address"] or "",
        migration_resume_s=st["migration_resume_s"], migration_precopy_tokens=st["migration_precopy_tokens"],
        max_caches=st["max_caches"], max_caches_per_caller=st["max_caches_per_caller"],
        max_compile_seconds=st["max_compile_seconds"], stall_timeout=st["stall_timeout"],
    )
    asyncio.run(serve(executors, cfg, workers))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from ferrum_client import Client, FerrumRpcError

    with Client(args.target, token=args.token) as c:
        try:
            model = args.model_id
            if not model:
                causal = [m for m in c.info().models if m.executor not in ("bert",)]
                if not causal:
                    print("the server hosts no causal LM", file=sys.stderr)
                    return 1
                model = causal[0].model_id
            kw = {"text": args.prompt} if args.raw else {"chat": [("user", args.prompt)]}
            finished = None
            for ev in c.generate(model, max_tokens=args.max_tokens, temperature=args.temperature,
                                 seed=args.seed, stream_text=True, **kw):
                kind = ev.WhichOneof("event")
                if kind == "token":
                    sys.stdout.write(ev.token.text)
                    sys.stdout.flush()
                elif kind == "finished":
                    finished = ev.finished
            print()
            if finished is not None:
                secs = finished.total_ns / 1e9
                print(f"[{finished.generated_tokens} tokens in {secs:.2f}s, "
                      f"{finished.generated_tokens / secs if secs else 0:.1f} tok/s, "
                      f"finish: {type(finished).DESCRIPTOR.fields_by_name['finish_reason'].enum_type.values_by_number[finished.finish_reason].name}]",
                      file=sys.stderr)
        except FerrumRpcError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return cmd_serve(args)
    return cmd_generate(args)


if __name__ == "__main__":
    sys.exit(main())
