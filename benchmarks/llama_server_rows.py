"""Ferrum's llama.cpp executor against llama-server, llama.cpp's own server (issue 30).

    .venv/bin/python -m benchmarks.llama_server_rows [--threads 2] [--rounds 2] [--quick]
        [--b1-tokens 128] [--streams 16] [--gap-ms 100] [--prompt 200] [--tokens 64]
        [--ours-flags "--prefill-tail-factor 2"] [--ours-spec kv=streams] [--only b1|arrival]

Both servers run the **same GGUF file** (the default preset's F16 copy of the packaged SmolLM2,
``weight_cache.converted_gguf``) with the same threads: ours is ``ferrum-service serve --model
llama-cpp,path=FILE,threads=N`` (plus ``--ours-flags``), the peer is ``llama-server -m FILE -t N
-tb N -np STREAMS -c CTX --cont-batching`` built from the llama.cpp that the installed
llama-cpp-python vendors (``benchmarks/peers/build_llama_server.sh``: built once, cached under
``~/.cache/ferrum-service/llama-server-VERSION/``). Ours is driven with ``Generate`` over gRPC
(``ferrum_client``), the peer with its HTTP ``/completion`` (token-id prompts, ``n_predict``,
``ignore_eos``, ``stream`` for per-token stamps, ``cache_prompt`` off); greedy on both sides.

Rows:

* **B=1**: one stream, ``--b1-tokens`` tokens after a fixed 37-token chat prompt; decode tok/s from
  the token stamps (first token excluded). Target: ours ÷ llama-server ≥ 1.0.
* **arriving prompts**: ``--streams`` streams whose fresh random ``--prompt``-token prompts arrive
  ``--gap-ms`` apart, ``--tokens`` tokens each: aggregate tok/s (all tokens ÷ first send to last
  token; target ≥ 1.0), TTFT p50 (target: ours ≤ llama-server's) and the inter-token latency tail
  ITL p99 ÷ p50 over every stream (target ≤ 3; the peer's is reported beside it).

The sides alternate round by round (the side that goes first swaps every round; fresh prompts each
run); medians over the rounds. The reference workload (``llama_cpp_rows.reference_workload``) is
timed before the first round, between rounds and after both servers stopped; drift = (slowest −
fastest) ÷ fastest probe, and drift > ``DRIFT_LIMIT`` flags every row ``busy`` (re-run it, do not
publish). Each row's ``extra.runs`` keeps every run: on a shared 2-core machine one run in four can
be 5-20x off while the probes stay flat, so compare the runs before trusting a median.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ferrum_service.testing.sse import sse_payloads

from .common import REPO, Server, free_port, median, pct
from .llama_cpp_rows import settled_reference_workload
from .schema import DRIFT_LIMIT, row, write_rows

BUILD_SCRIPT = REPO / "benchmarks" / "peers" / "build_llama_server.sh"
#: Our side's `serve` flags unless ``--ours-flags`` says otherwise: prompt chunks sized to keep a
#: step within 2x a decode step (the ITL tail row's setting; the server's default is a fixed
#: 512-token chunk, ``--prefill-tail-factor 0``).
OURS_FLAGS = "--prefill-tail-factor 2"
#: The fixed B=1 prompt (SmolLM2's chat template around "What is the capital of France?").
B1_PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712,
             8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]


def llama_server_binary(python: str = sys.executable) -> Path:
    """The cached llama-server binary of the installed llama-cpp-python's llama.cpp, built first
    when it is missing (about 7 minutes on 2 cores, under ``nice``)."""
    out = subprocess.run(["bash", str(BUILD_SCRIPT), python], check=True, stdout=subprocess.PIPE, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


class LlamaServer:
    """``llama-server`` as a subprocess on a free loopback port (log in ``results/NAME.log``)."""

    def __init__(self, binary: Path, gguf: str, *, threads: int, slots: int, ctx: int, name: str = "llama-server",
                 extra: tuple[str, ...] = (), env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.args = [str(binary), "-m", gguf, "--host", "127.0.0.1", "--port", str(self.port), "-t", str(threads),
                     "-tb", str(threads), "-np", str(slots), "-c", str(ctx), "--cont-batching", *extra]
        self.log_path = REPO / "benchmarks" / "results" / f"{name}.log"
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "LlamaServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout: float = 180.0) -> "LlamaServer":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT,
                                     cwd=tempfile.gettempdir(), env=self.env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"llama-server not healthy within {timeout:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def stream(self, prompt: list[int], tokens: int, delay_s: float = 0.0) -> dict:
        """One streamed ``/completion`` (greedy, ``ignore_eos``): send time and one stamp per token."""
        time.sleep(delay_s)
        body = {"prompt": prompt, "n_predict": tokens, "ignore_eos": True, "stream": True,
                "temperature": 0.0, "top_k": 1, "cache_prompt": False, "return_tokens": True}
        sent, stamps, ids = time.perf_counter(), [], []
        events = sse_payloads(self.port, "/completion", body, timeout=600)
        for payload in events:
            now = time.perf_counter()
            ev = json.loads(payload)
            for t in ev.get("tokens") or []:
                stamps.append(now)
                ids.append(int(t))
            if ev.get("stop"):
                # tokens held back (an incomplete UTF-8 character) and not listed: they came now
                n = int(ev.get("tokens_predicted") or (ev.get("timings") or {}).get("predicted_n") or 0)
                stamps += [now] * max(0, n - len(stamps))
                break
        events.close()
        return {"sent": sent, "stamps": stamps, "tokens": ids}


def _summary(recs: list[dict], tokens: int) -> dict:
    """Aggregate tok/s, TTFT p50, ITL p50 / p99 of one run of streams."""
    itl = [y - x for r in recs for x, y in zip(r["stamps"], r["stamps"][1:])]
    t0 = min(r["sent"] for r in recs)
    t1 = max(r["stamps"][-1] for r in recs if r["stamps"])
    return {"tok_s": sum(len(r["stamps"]) for r in recs) / (t1 - t0),
            "ttft_p50_ms": 1e3 * median([r["stamps"][0] - r["sent"] for r in recs if r["stamps"]]),
            "itl_p50_ms": 1e3 * pct(itl, 50), "itl_p99_ms": 1e3 * pct(itl, 99),
            "complete": all(len(r["stamps"]) == tokens for r in recs),
            "counts": sorted({len(r["stamps"]) for r in recs})}


def _decode_rate(rec: dict) -> float:
    s = rec["stamps"]
    return (len(s) - 1) / (s[-1] - s[0]) if len(s) > 2 else float("nan")


# ---- ours: Generate over gRPC ---------------------------------------------------------------------
async def _ours_streams(target: str, model: str, prompts: list[list[int]], tokens: int, gap_s: float) -> list[dict]:
    from ferrum_client import AsyncClient

    async with AsyncClient(target, timeout=600) as c:
        async def one(i: int) -> dict:
            await asyncio.sleep(i * gap_s)
            sent, stamps, ids = time.perf_counter(), [], []
            async for ev in c.generate(model, token_ids=prompts[i], max_tokens=tokens, ignore_eos=True,
                                       bypass_prefix_cache=True):
                if ev.WhichOneof("event") == "token":
                    stamps.append(time.perf_counter())
                    ids.append(ev.token.token_id)
            return {"sent": sent, "stamps": stamps, "tokens": ids}

        return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))


def ours_run(target: str, model: str, prompts: list[list[int]], tokens: int, gap_s: float) -> list[dict]:
    return asyncio.run(_ours_streams(target, model, prompts, tokens, gap_s))


def peer_run(peer: LlamaServer, prompts: list[list[int]], tokens: int, gap_s: float) -> list[dict]:
    out: list[dict | None] = [None] * len(prompts)
    errs: list[BaseException] = []

    def one(i: int) -> None:
        try:
            out[i] = peer.stream(prompts[i], tokens, i * gap_s)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errs.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errs:
        raise errs[0]
    return out  # type: ignore[return-value]


def fresh_prompts(rng: random.Random, n: int, length: int, vocab: int = 40000) -> list[list[int]]:
    """``n`` prompts of ``length`` random ordinary token ids (BOS first), new every call."""
    return [[1] + [rng.randrange(100, vocab) for _ in range(length - 1)] for _ in range(n)]


def _env(spec: str) -> dict[str, str]:
    """``NAME=VALUE,...`` as a mapping."""
    return dict(kv.split("=", 1) for kv in spec.split(",") if kv.strip())


def default_gguf() -> str:
    """The default preset's file: the F16 copy of the packaged SmolLM2 GGUF (made if missing)."""
    from ferrum_service.hosting.packaged_models import smollm2_gguf
    from ferrum_service.hosting.weight_cache import converted_gguf

    d, f = smollm2_gguf()
    return str(converted_gguf(d / f, "f16"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="runs per side (alternated)")
    ap.add_argument("--b1-tokens", type=int, default=128)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--gap-ms", type=float, default=100.0)
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--gguf", default=None, help="GGUF file for both sides (default: the default preset's F16 copy)")
    ap.add_argument("--ours-flags", default=OURS_FLAGS,
                    help="extra `serve` flags for our side (its best settings)")
    ap.add_argument("--ours-spec", default="", help="extra key=value,... for our model spec (e.g. kv=streams)")
    ap.add_argument("--peer-flags", default="", help="extra llama-server flags")
    ap.add_argument("--ours-env", default="",
                    help="environment of our server, NAME=VALUE,... (e.g. GOMP_SPINCOUNT=1000: OpenMP workers "
                         "sleep sooner; 4-7x faster B=1 on a 2-core machine under load 4-5, slower when quiet)")
    ap.add_argument("--peer-env", default="", help="environment of llama-server, NAME=VALUE,...")
    ap.add_argument("--only", choices=["b1", "arrival"], default=None)
    ap.add_argument("--quick", action="store_true", help="1 round, 48 B=1 tokens, 8 streams (a check, not a row)")
    ap.add_argument("--seed", type=int, default=None, help="prompt seed (default: the clock: fresh prompts every run)")
    a = ap.parse_args(argv)
    if a.quick:
        a.rounds, a.b1_tokens, a.streams = 1, 48, 8
    gguf = a.gguf or default_gguf()
    binary = llama_server_binary()
    th = a.threads
    per_slot = max(a.prompt + a.tokens, len(B1_PROMPT) + a.b1_tokens) + 64
    ctx = -(-a.streams * per_slot // 256) * 256
    rng = random.Random(time.time_ns() if a.seed is None else a.seed)
    raw: dict = {"args": vars(a), "gguf": gguf, "llama_server": str(binary), "load_before": os.getloadavg()}
    ours_spec = f"llama-cpp,id=llc,path={gguf},threads={th},n_ctx={max(ctx, 8192)}" + (
        f",{a.ours_spec}" if a.ours_spec else "")
    ours = Server(ours_spec, threads=th, extra=("--max-batch", str(max(64, a.streams)), *shlex.split(a.ours_flags)),
                  name="llama-server-rows-ours")
    ours.env.update(_env(a.ours_env))
    peer = LlamaServer(binary, gguf, threads=th, slots=a.streams, ctx=ctx, extra=tuple(shlex.split(a.peer_flags)),
                       env=_env(a.peer_env))
    raw["ours_server"], raw["peer_server"] = ours_spec + " " + a.ours_flags, " ".join(peer.args[1:])
    raw["ours_env"], raw["peer_env"] = a.ours_env, a.peer_env
    b1: dict[str, list[dict]] = {"ours": [], "peer": []}
    arr: dict[str, list[dict]] = {"ours": [], "peer": []}
    try:
        ours.start()
        peer.start()
        # warm-up: first-call allocations and graphs on both sides
        ours_run(ours.target, "llc", fresh_prompts(rng, 2, 32), 8, 0.0)
        peer_run(peer, fresh_prompts(rng, 2, 32), 8, 0.0)
        probes = [settled_reference_workload()]
        for r in range(a.rounds):
            if r:
                probes.append(settled_reference_workload())  # between rounds too: a burst mid-run shows
            for side in (("ours", "peer") if r % 2 == 0 else ("peer", "ours")):
                if a.only != "arrival":
                    rec = (ours_run(ours.target, "llc", [B1_PROMPT], a.b1_tokens, 0.0) if side == "ours"
                           else peer_run(peer, [B1_PROMPT], a.b1_tokens, 0.0))[0]
                    b1[side].append({"tok_s": _decode_rate(rec), "tokens": rec["tokens"]})
                if a.only != "b1":
                    prompts = fresh_prompts(rng, a.streams, a.prompt)
                    recs = (ours_run(ours.target, "llc", prompts, a.tokens, a.gap_ms / 1e3) if side == "ours"
                            else peer_run(peer, prompts, a.tokens, a.gap_ms / 1e3))
                    arr[side].append(_summary(recs, a.tokens))
    finally:
        ours.stop()
        peer.stop()
    probes.append(settled_reference_workload())
    drift = (max(probes) - min(probes)) / min(probes)
    raw.update(b1=b1, arrival=arr, drift=drift, reference_s=probes)
    rows = []
    spec_note = a.ours_spec.replace(",", ", ") + " in the model spec; " if a.ours_spec else ""
    note = (f"same GGUF ({Path(gguf).name}) on both sides, {th} threads, greedy; ours: Generate over gRPC "
            f"({spec_note}{a.ours_flags or 'defaults'}; env {a.ours_env or 'as is'}), peer: llama-server /completion (stream; "
            f"env {a.peer_env or 'as is'}); sides alternated, "
            f"{a.rounds} round(s), medians")
    print(f"| row | ours | llama-server | ratio | target | drift {drift:.0%}{' BUSY' if drift > DRIFT_LIMIT else ''} |")
    print("|---|---|---|---|---|---|")
    if b1["ours"]:
        o, p = median([x["tok_s"] for x in b1["ours"]]), median([x["tok_s"] for x in b1["peer"]])
        # llama-server's ignore_eos bans the end-of-generation tokens; ours only does not stop at
        # them: the outputs agree up to the first one ours samples.
        ot, pt = b1["ours"][0]["tokens"], b1["peer"][0]["tokens"]
        same = next((i for i, (x, y) in enumerate(zip(ot, pt)) if x != y), min(len(ot), len(pt)))
        rows.append(row(f"Generate B=1 ÷ llama-server, same F16 file, {th} threads: decode tok/s", round(o, 1),
                        round(p, 1), round(o / p, 3), "≥ 1.0", target_value=1.0, drift=round(drift, 3), unit="tok/s",
                        runs={k: [round(x["tok_s"], 1) for x in v] for k, v in b1.items()}, same_prefix_tokens=same,
                        note=note + f"; {a.b1_tokens} tokens after a {len(B1_PROMPT)}-token prompt"))
        print(f"| B=1 decode tok/s | {o:.1f} | {p:.1f} | {o / p:.2f} | ≥ 1.0 | same first {same} tokens |")
    if arr["ours"]:
        agg = {k: {m: median([x[m] for x in v]) for m in ("tok_s", "ttft_p50_ms", "itl_p50_ms", "itl_p99_ms")}
               for k, v in arr.items()}
        tail = {k: v["itl_p99_ms"] / v["itl_p50_ms"] for k, v in agg.items()}
        complete = all(x["complete"] for v in arr.values() for x in v)
        what = f"{a.streams} streams, {a.prompt}-token prompts {a.gap_ms:.0f} ms apart, {a.tokens} tokens each"
        ms = {k: {m: round(x, 1) for m, x in v.items()} for k, v in agg.items()}
        o, p = agg["ours"], agg["peer"]
        rows.append(row(f"{what}: aggregate tok/s ÷ llama-server", round(o["tok_s"], 1), round(p["tok_s"], 1),
                        round(o["tok_s"] / p["tok_s"], 3), "≥ 1.0", target_value=1.0, drift=round(drift, 3),
                        unit="tok/s", ms=ms, all_complete=complete, note=note,
                        runs={k: [round(x["tok_s"], 1) for x in v] for k, v in arr.items()}))
        rows.append(row(f"{what}: TTFT p50 ÷ llama-server's", round(o["ttft_p50_ms"]), round(p["ttft_p50_ms"]),
                        round(o["ttft_p50_ms"] / p["ttft_p50_ms"], 3), "≤ 1.0", target_value=1.0,
                        lower_is_better=True, drift=round(drift, 3), unit="ms", note=note))
        rows.append(row(f"{what}: ITL p99 ÷ p50 (ours; llama-server's as peer)", round(tail["ours"], 2),
                        round(tail["peer"], 2), round(tail["ours"], 2), "≤ 3", target_value=3.0, lower_is_better=True,
                        drift=round(drift, 3), unit="p99/p50", note=note + "; ratio = ours"))
        print(f"| {what}: tok/s | {o['tok_s']:.1f} | {p['tok_s']:.1f} | {o['tok_s'] / p['tok_s']:.2f} | ≥ 1.0 | "
              f"complete: {complete} |")
        print(f"| TTFT p50 ms | {o['ttft_p50_ms']:.0f} | {p['ttft_p50_ms']:.0f} | "
              f"{o['ttft_p50_ms'] / p['ttft_p50_ms']:.2f} | ≤ 1.0 | |")
        print(f"| ITL p50 / p99 ms (p99 ÷ p50) | {o['itl_p50_ms']:.0f} / {o['itl_p99_ms']:.0f} ({tail['ours']:.1f}) | "
              f"{p['itl_p50_ms']:.0f} / {p['itl_p99_ms']:.0f} ({tail['peer']:.1f}) | {tail['ours']:.2f} | ≤ 3 | |")
    # a --quick check is not a row to publish: its file goes to the temp folder
    # our spec's extras name the file (kv=streams,n_seq=16 -> -kv_streams_n_seq_16), and our flags
    # where they are not the default ones: one file per layout and schedule
    spec = _slug(a.ours_spec) + (_slug(a.ours_flags) if a.ours_flags != OURS_FLAGS else "")
    out = write_rows("llama_server_rows" + spec + (f"-{a.only}" if a.only else ""), rows, raw,
                     **({"folder": Path(tempfile.gettempdir())} if a.quick else {}))
    print(f"wrote {out}")
    return 0


def _slug(text: str) -> str:
    """``kv=streams,n_seq=16`` -> ``-kv_streams_n_seq_16`` ("" for "")."""
    words = "".join(ch if ch.isalnum() else " " for ch in text).split()
    return "-" + "_".join(words) if words else ""


if __name__ == "__main__":
    raise SystemExit(main())
