"""``ferrum-service``: serve executors, or stream a reply from a running server.

Every setting (flag, environment variable, YAML key, default) is in ``core/settings.py``
(``docs/settings.md``): a ``serve`` flag such as ``--cache-ttl`` also comes from the environment
(``FERRUM_CACHE_TTL``; ``FERRUM_MODEL``: several specs separated by ``;``) or from a YAML config
file (``--config``) with the key ``cache_ttl`` and a ``models:`` list. Precedence: flag >
environment > config file > default.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
import time
from pathlib import Path

from . import __version__
from .core import settings
from .core.errors import FerrumError


def _add_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """``command``'s flags, from the settings table (the flag's value lands under the setting's name);
    ``serve``'s in the table's help groups."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for st in settings.for_command(command):
        if st.flag is None:
            continue
        target = parser
        if command == "serve":
            title = settings.help_group(st)
            target = groups.get(title) or groups.setdefault(title, parser.add_argument_group(title))
        kw = {"dest": st.name, "default": None, "help": settings.help_text(st)}
        if st.is_switch:
            target.add_argument(st.flag, action="store_const", const=not st.default, **kw)
        elif st.type is list:
            target.add_argument(st.flag, action="append", metavar=st.metavar, **kw)
        else:
            target.add_argument(st.flag, type=st.type if st.type in (int, float) else str, metavar=st.metavar, **kw)


SERVE_EXAMPLE = ("ferrum-service serve --model smollm2 --model llama-cpp,id=qwen,path=/models/qwen.gguf,n_ctx=8192 "
                 "--port 50051 --metrics-port 9090")


def _serve_epilog() -> str:
    """``serve --help``'s closing text: presets, executors and their options, an example, the
    environment-only settings."""
    from .hosting.model_specs import COMMON_OPTIONS, EXECUTOR_KINDS, OPTIONS, PRESET_HELP

    lines = ["models (--model EXECUTOR[,key=value...], repeatable; default: smollm2 + minilm):", "  presets:"]
    lines += [f"    {name:<15} {text}" for name, text in PRESET_HELP.items()]
    lines.append(f"  executors (all take {', '.join(COMMON_OPTIONS)}):")
    lines += [f"    {kind:<15} {', '.join(OPTIONS[kind])}" for kind in EXECUTOR_KINDS]
    lines += ["  a Hugging Face Hub id, org/name[@revision][,key=value...]: the executor follows from its files "
              "(HF_HUB_OFFLINE=1: from the cache only)"]
    lines += ["", "example:", f"  {SERVE_EXAMPLE}", "", "environment only:"]
    lines += [f"  {st.env}: {st.help}" for st in settings.SETTINGS if st.flag is None and st.command != "generate"]
    return "\n".join(lines).replace("%", "%%")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ferrum-service", description=__doc__.split("\n\n")[0])
    p.add_argument("--version", action="version", version=f"ferrum-service {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="host executors behind the gRPC contract", usage="%(prog)s [options]",
                       description="Host executors behind the gRPC contract (and vLLM's engine protocol).\n"
                       "Every flag also reads FERRUM_<FLAG> and its key in --config;\n"
                       "flag > environment > config > default (docs/settings.md).",
                       epilog=_serve_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_flags(s, "serve")

    g = sub.add_parser("generate", help="stream a reply from a running server")
    g.add_argument("prompt", help="the user message (sent through the model's chat template)")
    _add_flags(g, "generate")
    g.add_argument("--model-id", default="", help="model to use (default: the first causal LM hosted)")
    g.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (same seed, same reply)")
    g.add_argument("--raw", action="store_true", help="send the prompt as plain text, without the chat template")
    return p


def resolve_serve_settings(args: argparse.Namespace) -> dict:
    """Merge flags, environment and config file into one settings dict (``core/settings.py``),
    with the model specs (``specs``) and preloaded adapters (``adapters``) parsed. SettingError
    for a value that cannot be read."""
    out = settings.resolve("serve", vars(args))
    from .hosting.model_specs import parse_spec, spec_from_mapping

    where = settings.source_of("model", vars(args), None, str(out["config"]))
    specs = []
    for i, m in enumerate(out["model"]):
        try:
            specs.append(spec_from_mapping(m) if isinstance(m, dict) else parse_spec(str(m)))
        except ValueError as e:
            raise settings.SettingError(f"{where}[{i}]: {e}" if isinstance(m, dict) else f"{where} {m!r}: {e}") from e
    out["specs"] = specs
    out["adapters"] = _adapter_flags(out["adapter"], specs)
    return out


def _adapter_flags(flags: list[str], specs) -> dict[str, dict[str, str]]:
    """``--adapter [MODEL:]NAME=PATH`` flags and the specs' own adapters, per model id."""
    from .hosting.model_specs import spec_adapters

    out = {s.model_id: spec_adapters(s) for s in specs}
    for f in flags:
        head, sep, path = f.partition("=")
        if not sep or not head or not path:
            raise settings.SettingError(f"--adapter {f!r}: expected [MODEL:]NAME=PATH")
        model, _, name = head.rpartition(":")
        if not model:
            encoders = ("bert", "minilm", "llama-bert", "minilm-llama", "stub", "configurable")
            causal = [s.model_id for s in specs if s.executor not in encoders]
            if len(causal) != 1:
                raise settings.SettingError(f"--adapter {f!r}: name the model (MODEL:NAME=PATH); hosted: "
                                            f"{', '.join(causal)}")
            model = causal[0]
        if model not in out:
            raise settings.SettingError(f"--adapter {f!r}: no model {model!r} is hosted")
        out[model][name] = path
    return out


def _read_tokens(path: str | None) -> list[str]:
    if not path:
        return []
    return [ln.strip() for ln in Path(path).read_text().splitlines() if ln.strip() and not ln.startswith("#")]


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        st = resolve_serve_settings(args)
    except settings.SettingError as e:
        print(e, file=sys.stderr)
        return 2
    from .hosting.kv_peers import normalize_peer, normalize_target

    # --kv-peer: HOST:PORT, HOST:LO-HI or HOST:* (ports of one host); --drain-to names one server
    bad = [p for p in st["kv_peer"] or [] if normalize_peer(p) is None]
    bad += [p for p in [st["drain_to"]] if p and normalize_target(p) is None]
    if bad or bool(st["kv_peer_cert"]) != bool(st["kv_peer_key"]):
        print(f"--kv-peer takes HOST:PORT, HOST:LO-HI or HOST:*, --drain-to HOST:PORT (not {bad[0]!r})" if bad else "--kv-peer-cert and --kv-peer-key go together",
              file=sys.stderr)
        return 2
    from . import logs
    from .wire import preflight

    try:  # ports and files now, not after the models load (preflight.py)
        preflight.check(st)
    except settings.SettingError as e:
        print(e, file=sys.stderr)
        return 2
    logs.configure(st["log_format"], st["log_level"])
    import structlog

    from .hosting.host import new_worker
    from .hosting.model_specs import build_executor
    from .server import ServerConfig, serve

    log = structlog.get_logger("ferrum_service.cli")
    try:
        import torch
    except ImportError:  # a base install (stub, configurable, llama.cpp executors) runs without torch
        pass
    else:
        torch.set_num_threads(max(1, st["torch_threads"] or os.cpu_count() or 1))
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
                               prefix_cache=st["prefix_cache"], cuda_graphs=str(st["cuda_graphs"]),
                               hub_token=next(iter(_read_tokens(st["hub_token_file"])), None)).result()
            for name, path in st["adapters"].get(spec.model_id, {}).items():
                worker.submit(ex.load_adapter, name, path).result()
        except (ValueError, FileNotFoundError, ImportError, OSError, RuntimeError, FerrumError) as e:
            log.error("could not load model", executor=spec.executor, model_id=spec.model_id, error=str(e))
            worker.shutdown(wait=False)
            return 2
        if st["warmup"]:
            t1 = time.perf_counter()
            worker.submit(ex.warmup).result()
            log.info("model warmed up", model_id=spec.model_id, seconds=round(time.perf_counter() - t1, 3))
        info = ex.info()
        log.info("model ready", model_id=info.model_id, executor=info.executor, device=info.device,
                 dtype=info.dtype, layers=info.num_layers, vocab=info.vocab_size,
                 seconds=round(time.perf_counter() - t0, 2))
        executors.append(ex)
        workers.append(worker)
    given = {f.name: st[f.name] for f in dataclasses.fields(ServerConfig) if f.name in st}
    cfg = ServerConfig(
        **given,
        auth_tokens=_read_tokens(st["auth_token_file"]) or ([st["auth_token"]] if st["auth_token"] else []),
        admin_tokens=_read_tokens(st["admin_token_file"]) or ([st["admin_token"]] if st["admin_token"] else []),
        kv_peers=list(st["kv_peer"]), kv_peer_tokens=_read_tokens(st["kv_peer_token_file"]),
    )
    asyncio.run(serve(executors, cfg, workers))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from ferrum_client import Client, FerrumRpcError

    st = settings.resolve("generate", vars(args))
    with Client(st["target"], token=st["token"]) as c:
        try:
            model = args.model_id
            if not model:
                causal = [m for m in c.info().models if m.executor not in ("bert", "llama-bert")]
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
