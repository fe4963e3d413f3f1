"""Run the built CPU image the way the Helm chart runs it, and check it serves.

    python deploy/image_check.py IMAGE        (deploy/image-check.sh builds the image and calls this)

The container spec comes from the rendered chart itself (``helm template`` with default values):
its args, config file (the ConfigMap's ``config.yaml``, mounted read-only at the same path), ports,
user, read-only root filesystem, dropped capabilities and no-new-privileges, and an in-memory
``/tmp`` for the ``tmp`` emptyDir. So what passes here is what Kubernetes would run. Checks:

* the chart's container is what this check assumes (serve, gRPC port with native gRPC probes on
  it, non-root, read-only root) and the image agrees (its USER is the chart's runAsUser, it
  exposes the gRPC port);
* the server comes up as that non-root user; the root filesystem refuses writes;
* ``grpc-health-probe`` (the probe's own tool) reports SERVING overall and for each model;
* the image is under 1 GiB and has neither torch nor transformers (GetTokenizer still answers: the
  GGUF tokenizer is converted torch-free), llama.cpp's CPU backend comes as
  per-CPU variants (the AMX one left out), and the server logs the variant it loaded for this CPU;
* ``ferrum-service generate`` through the published port streams a reply;
* ``serve --model minilm`` (BERT embeddings on llama.cpp) answers unit vectors that place a
  paraphrase nearer than an unrelated sentence, equal to the host's transformers MiniLM if it has one;
* SIGTERM drains and the container exits 0 within the chart's grace period.

Prints the figures (image size, start-to-SERVING, generate time, stop time). Exits non-zero on any
failure.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("FERRUM_CACHE_DIR", Path.home() / ".cache/ferrum-service"))
NAME = "ferrum-image-check"
#: The CPU image's size limit (issue 42: torch-free, under 1 GiB).
MAX_IMAGE_BYTES = 1 << 30
#: Run inside the image: are torch / transformers importable, which CPU variants of llama.cpp it has.
CONTENTS_PROBE = ("import importlib.util as u, json, pathlib, llama_cpp; "
                  "lib = pathlib.Path(llama_cpp.__file__).parent / 'lib'; "
                  "print(json.dumps({'heavy': [m for m in ('torch', 'transformers') if u.find_spec(m)], "
                  "'variants': sorted(p.name[len('libggml-cpu-'):-3] for p in lib.glob('libggml-cpu-*.so'))}))")


def sh(*cmd: str, check: bool = True, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and r.returncode != 0:
        raise SystemExit(f"FAILED: {' '.join(cmd)} (rc={r.returncode})\n{r.stdout}\n{r.stderr}")
    return r


def rendered_chart() -> tuple[dict, dict, dict]:
    """(container, pod spec, config.yaml text) of the chart rendered with default values."""
    helm = shutil.which("helm") or str(CACHE / "bin/helm")
    out = sh(helm, "template", "ferrum-service", str(ROOT / "deploy/helm/ferrum-service"),
             "--kube-version", "1.31.0").stdout
    docs = [d for d in yaml.safe_load_all(out) if isinstance(d, dict)]
    dep = next(d for d in docs if d["kind"] == "Deployment")
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and "config.yaml" in d.get("data", {}))
    pod = dep["spec"]["template"]["spec"]
    return pod["containers"][0], pod, cm["data"]["config.yaml"]


def get_tokenizer(target: str) -> tuple[str, list[str], float]:
    """The vLLM protocol's GetTokenizer on the image's server: (status code name or the error's
    details, the bundle's file names, seconds to the last chunk)."""
    import hashlib
    import io
    import zipfile

    import grpc
    from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2_grpc

    t0 = time.perf_counter()
    with grpc.insecure_channel(target) as ch:
        try:
            chunks = list(vllm_engine_pb2_grpc.VllmEngineStub(ch).GetTokenizer(common_pb2.GetTokenizerRequest(),
                                                                               timeout=60))
        except grpc.RpcError as e:
            return f"{e.code().name}: {e.details()}", [], time.perf_counter() - t0
    took = time.perf_counter() - t0
    data = b"".join(c.data for c in chunks)
    if not chunks or hashlib.sha256(data).hexdigest() != chunks[-1].sha256:
        return "OK but the bundle's sha256 does not match", [], took
    return "OK", zipfile.ZipFile(io.BytesIO(data)).namelist(), took


#: Sentences for the embeddings check: the first two mean the same, the third does not.
EMBED_SENTENCES = ("A man is eating food.", "A man is eating a piece of bread.", "The stock market fell sharply today.")


def embeddings(target: str, model: str) -> list:
    """``model``'s embeddings of :data:`EMBED_SENTENCES` through the contract (Tokenize, Prefill)."""
    from ferrum_client import Client
    from ferrum_client import messages as m

    out = []
    with Client(target) as c:
        for s in EMBED_SENTENCES:
            r = c.prefill(model, c.tokenize(model, s, True)).output
            out.append(m.tensor_array(r.embedding))
            c.release_cache(model, r.cache.cache_id)
    return out


def reference_embeddings() -> list | None:
    """The same sentences through the transformers MiniLM on this host, if it has one."""
    try:
        from ferrum_service.executors.bert import BertModelExecutor
        from ferrum_service.hosting.packaged_models import minilm_dir

        ref = BertModelExecutor.from_path(minilm_dir(), model_id="minilm", device="cpu")
    except Exception:  # noqa: BLE001 - no torch / transformers / model package here: sanity checks only
        return None
    return [ref.get_embeddings(ref.tokenizer.encode(s)).numpy() for s in EMBED_SENTENCES]


def check_embeddings(image: str, port: int, user: str) -> None:
    """``serve --model minilm`` in the image (BERT on llama.cpp): unit vectors of 384, the paraphrase
    nearer than the unrelated sentence, and (where this host has transformers) cosine >= 0.999 with
    the transformers MiniLM."""
    import numpy as np

    probe = shutil.which("grpc-health-probe") or str(CACHE / "bin/grpc-health-probe")
    name = NAME + "-minilm"
    sh("podman", "rm", "-f", name, check=False)
    sh("podman", "run", "-d", "--name", name, "--user", user, "--read-only", "--tmpfs", "/tmp:rw,size=512m,mode=1777",
       "--cap-drop", "ALL", "--security-opt", "no-new-privileges", "-p", f"127.0.0.1:{port}:50051",
       "-e", "OMP_NUM_THREADS=2", image, "serve", "--model", "minilm", "--port", "50051")
    try:
        target, t0 = f"127.0.0.1:{port}", time.monotonic()
        while sh(probe, "-addr", target, "-service", "minilm", "-connect-timeout", "2s", check=False).returncode:
            state = sh("podman", "inspect", name, "--format", "{{.State.Status}}").stdout.strip()
            if state != "running" or time.monotonic() - t0 > 120:
                logs = sh("podman", "logs", name, check=False)
                print((logs.stdout + logs.stderr)[-3000:])
                raise SystemExit(f"FAILED: minilm did not become SERVING (container {state})")
            time.sleep(1)
        ready_s = time.monotonic() - t0
        from ferrum_client import Client

        with Client(target) as c:
            kind = {x.model_id: x.executor for x in c.info().models}.get("minilm")
        check(kind == "llama-bert", f"minilm SERVING on llama.cpp ({kind}) {ready_s:.1f} s after start")
        e = embeddings(target, "minilm")
        norms = [float(np.linalg.norm(x)) for x in e]
        check(all(x.shape == (384,) for x in e) and all(abs(n - 1) < 1e-3 for n in norms),
              f"embeddings: 384 values, unit length ({', '.join(f'{n:.4f}' for n in norms)})")
        near, far = float(e[0] @ e[1]), float(e[0] @ e[2])
        check(near > far + 0.2, f"the paraphrase is nearer than the unrelated sentence: {near:.3f} vs {far:.3f}")
        ref = reference_embeddings()
        if ref is not None:
            cos = [float(a @ b) / float(np.linalg.norm(b)) for a, b in zip(e, ref)]
            check(min(cos) >= 0.999, f"the image's embeddings equal this host's transformers MiniLM: cosine {min(cos):.6f}")
    finally:
        sh("podman", "rm", "-f", name, check=False)


def check(cond: bool, what: str) -> None:
    if not cond:
        raise SystemExit(f"FAILED: {what}")
    print(f"ok: {what}")


def main(image: str) -> None:
    probe = shutil.which("grpc-health-probe") or str(CACHE / "bin/grpc-health-probe")
    client = shutil.which("ferrum-service") or str(ROOT / ".venv/bin/ferrum-service")
    container, pod, config_text = rendered_chart()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    sec, podsec = container["securityContext"], pod["securityContext"]
    grace = float(yaml.safe_load(config_text).get("grace_period", 20))
    check(container["args"][0] == "serve", "the chart's container runs `serve`")
    check(all(container[p]["grpc"]["port"] == ports["grpc"] for p in ("startupProbe", "readinessProbe",
                                                                       "livenessProbe")),
          f"the chart probes gRPC health on the gRPC port {ports['grpc']}")
    check(sec["readOnlyRootFilesystem"] and not sec["allowPrivilegeEscalation"] and podsec["runAsNonRoot"],
          "the chart asks for a read-only root, no privilege escalation, non-root")
    cfg = yaml.safe_load(sh("podman", "image", "inspect", image, "--format", "{{json .Config}}").stdout)
    check(str(cfg.get("User", "")).split(":")[0] == str(podsec["runAsUser"]),
          f"the image's USER is the chart's runAsUser {podsec['runAsUser']}")
    check(f"{ports['grpc']}/tcp" in (cfg.get("ExposedPorts") or {}), "the image exposes the gRPC port")
    size = int(sh("podman", "image", "inspect", image, "--format", "{{.Size}}").stdout.strip())
    check(size < MAX_IMAGE_BYTES, f"image size {size / 2**20:.0f} MiB ({size / 2**30:.2f} GiB) < 1 GiB")
    contents = json.loads(sh("podman", "run", "--rm", "--entrypoint", "python", image, "-c",
                             CONTENTS_PROBE).stdout.strip().splitlines()[-1])
    check(not contents["heavy"], f"neither torch nor transformers in the image: {contents['heavy']}")
    variants = contents["variants"]
    check("x64" in variants and "haswell" in variants and "sapphirerapids" not in variants,
          f"llama.cpp's CPU backend as {len(variants)} variants, baseline x86-64 up, no AMX: {' '.join(variants)}")

    workdir = Path(tempfile.mkdtemp(prefix="ferrum-image-check-"))
    (workdir / "config.yaml").write_text(config_text)
    os.chmod(workdir, 0o755)
    config_dir = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "config")
    port = int(os.environ.get("FERRUM_IMAGE_CHECK_PORT", "55051"))
    sh("podman", "rm", "-f", NAME, check=False)
    run = ["podman", "run", "-d", "--name", NAME,
           "--user", f"{podsec['runAsUser']}:{podsec['runAsGroup']}",
           "--read-only", "--tmpfs", "/tmp:rw,size=512m,mode=1777",
           "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
           "-v", f"{workdir}:{config_dir}:ro",
           "-p", f"127.0.0.1:{port}:{ports['grpc']}",
           "-e", "OMP_NUM_THREADS=2", "-e", "FERRUM_TORCH_THREADS=2",
           image, *container["args"]]
    t0 = time.monotonic()
    sh(*run)
    try:
        target = f"127.0.0.1:{port}"
        deadline = t0 + 300
        while True:
            r = sh(probe, "-addr", target, "-connect-timeout", "2s", "-rpc-timeout", "2s", check=False)
            if r.returncode == 0:
                break
            state = sh("podman", "inspect", NAME, "--format", "{{.State.Status}}").stdout.strip()
            if state != "running" or time.monotonic() > deadline:
                logs = sh("podman", "logs", NAME, check=False)
                print((logs.stdout + logs.stderr)[-4000:])
                raise SystemExit(f"FAILED: the server did not become SERVING (container {state})")
            time.sleep(1)
        ready_s = time.monotonic() - t0
        check(True, f"SERVING {ready_s:.1f} s after start")
        for model in (m["executor"] if "id" not in m else m["id"] for m in yaml.safe_load(config_text)["models"]):
            r = sh(probe, "-addr", target, "-service", model)
            check("SERVING" in r.stdout + r.stderr, f"model {model} SERVING")
        uid = sh("podman", "exec", NAME, "id", "-u").stdout.strip()
        check(uid == str(podsec["runAsUser"]), f"the server runs as uid {uid}")
        r = sh("podman", "exec", NAME, "touch", "/opt/ferrum/written", check=False)
        check(r.returncode != 0, "the root filesystem refuses writes")
        t1 = time.monotonic()
        r = sh(client, "generate", "What is the capital of France?", "--target", target, "--max-tokens", "24",
               timeout=300)
        gen_s = time.monotonic() - t1
        print(r.stdout.strip())
        check(len(r.stdout.strip()) >= 8, f"generate through the published port answered in {gen_s:.1f} s")
        code, names, tok_s = get_tokenizer(target)
        check(code == "OK" and {"tokenizer.json", "tokenizer_config.json"} <= set(names),
              f"GetTokenizer answers without torch or transformers in {tok_s:.2f} s: {code} {sorted(names)}")
        logs = sh("podman", "logs", NAME)
        loaded = [json.loads(line) for line in (logs.stdout + logs.stderr).splitlines()
                  if "CPU backend variant loaded" in line and line.startswith("{")]
        check(len(loaded) == 1 and loaded[0].get("variant") in variants,
              f"the server loaded llama.cpp's CPU variant for this CPU: {loaded[0].get('variant') if loaded else None}")
        t2 = time.monotonic()
        sh("podman", "kill", "--signal", "TERM", NAME)
        sh("podman", "wait", NAME, timeout=grace + 30)
        stop_s = time.monotonic() - t2
        code = sh("podman", "inspect", NAME, "--format", "{{.State.ExitCode}}").stdout.strip()
        check(code == "0" and stop_s <= grace + 5, f"SIGTERM: exit {code} after {stop_s:.1f} s (grace {grace:.0f} s)")
        logs = sh("podman", "logs", NAME).stdout + sh("podman", "logs", NAME).stderr
        check('"draining"' in logs or "draining" in logs, "the server logged its drain")
        print(f"figures: start-to-SERVING {ready_s:.1f} s, generate {gen_s:.1f} s, SIGTERM-to-exit {stop_s:.1f} s")
    finally:
        sh("podman", "rm", "-f", NAME, check=False)
        shutil.rmtree(workdir, ignore_errors=True)
    check_embeddings(image, port + 1, f"{podsec['runAsUser']}:{podsec['runAsGroup']}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "localhost/ferrum-service:cpu")
