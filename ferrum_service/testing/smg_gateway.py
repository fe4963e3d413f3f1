"""The SMG gateway (Shepherd Model Gateway) in front of ferrum-service workers, for the tests and
the gateway benchmark: its own venv (``scripts/gateway_venv.sh``), ``smg launch --backend vllm``
on free loopback ports, and a small stdlib HTTP client for its OpenAI API."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

from ferrum_service.testing.server_process import free_port
from ferrum_service.testing.sse import sse_payloads

REPO = Path(__file__).resolve().parents[2]


def gateway_venv() -> Path:
    """The gateway's venv: ``$FERRUM_SMG_VENV`` (scripts/test.sh builds it), else built now."""
    env = os.environ.get("FERRUM_SMG_VENV")
    if env:
        return Path(env)
    out = subprocess.run(["bash", str(REPO / "scripts" / "gateway_venv.sh")], capture_output=True, text=True,
                         timeout=1200)
    if out.returncode != 0:
        raise RuntimeError(f"scripts/gateway_venv.sh failed: {out.stderr[-2000:]}")
    return Path(out.stdout.strip().splitlines()[-1])


class Gateway:
    """``smg launch --backend vllm --worker-urls grpc://...`` on free ports until ``stop()``; with
    ``decode`` workers, SMG's prefill/decode mode (``workers`` are then the prefill workers)."""

    def __init__(self, venv: Path, workers: list[str], policy: str = "cache_aware", extra: list[str] = (),
                 decode: list[str] = (), api_key: str = "") -> None:
        """``api_key``: sent as ``Authorization: Bearer`` on every request of this client (pass
        ``--api-key`` in ``extra`` for SMG to require it)."""
        self.api_key = api_key
        self.port = free_port()
        self.metrics_port = free_port()
        self.log_path = Path(tempfile.gettempdir()) / f"ferrum-test-smg-{self.port}.log"
        if decode:
            urls = ["--pd-disaggregation"]
            for w in workers:
                urls += ["--prefill", f"grpc://{w}"]
            for w in decode:
                urls += ["--decode", f"grpc://{w}"]
        else:
            urls = ["--worker-urls", *[f"grpc://{w}" for w in workers]]
        self.cmd = [str(venv / "bin" / "smg"), "launch", "--backend", "vllm", *urls,
                    "--host", "127.0.0.1", "--port", str(self.port),
                    "--prometheus-port", str(self.metrics_port), "--policy", policy, "--log-level", "info", *extra]
        self.proc: subprocess.Popen | None = None

    def start(self, model: str, timeout: float = 180.0, embeddings: bool = False) -> "Gateway":
        """Start it and wait until a one-token chat completion (``embeddings``: an embedding) for
        ``model`` succeeds."""
        self.launch()
        deadline = time.time() + timeout
        last = ""
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"smg exited with {self.proc.returncode}; log: {self.log_tail()}")
            try:
                if embeddings:
                    st, body = self.post("/v1/embeddings", {"model": model, "input": "hi"})
                else:
                    st, body = self.post("/v1/chat/completions", {"model": model, "max_tokens": 1,
                                                                  "messages": [{"role": "user", "content": "hi"}]})
                if st == 200:
                    return self
                last = f"{st} {body}"
            except OSError as e:
                last = repr(e)
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"smg did not serve {model!r} within {timeout} s (last: {last[:300]}); log: {self.log_tail()}")

    def launch(self) -> "Gateway":
        """Start it without waiting for anything."""
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)

    # ---- HTTP --------------------------------------------------------------------------------------
    def _conn(self, timeout: float) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def _headers(self, key: str | None) -> dict[str, str]:
        key = self.api_key if key is None else key
        return {"authorization": f"Bearer {key}"} if key else {}

    def get(self, path: str, timeout: float = 30.0, key: str | None = None) -> tuple[int, dict | str]:
        """GET ``path`` (``key``: the bearer key to send instead of this client's own; "" = none)."""
        c = self._conn(timeout)
        try:
            c.request("GET", path, headers=self._headers(key))
            r = c.getresponse()
            return r.status, _body(r.read())
        finally:
            c.close()

    def post(self, path: str, body: dict, timeout: float = 120.0, key: str | None = None) -> tuple[int, dict | str]:
        """POST JSON ``body`` to ``path`` (``key`` as for :meth:`get`)."""
        c = self._conn(timeout)
        try:
            c.request("POST", path, json.dumps(body), {"content-type": "application/json", **self._headers(key)})
            r = c.getresponse()
            return r.status, _body(r.read())
        finally:
            c.close()

    def stream(self, path: str, body: dict, timeout: float = 120.0) -> Iterator[str]:
        """The ``data:`` payloads of an SSE response, as they come; closing the generator closes
        the connection (a client that goes away)."""
        yield from sse_payloads(self.port, path, body, timeout)


def _body(raw: bytes) -> dict | str:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")
