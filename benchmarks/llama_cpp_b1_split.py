"""Where a B=1 greedy ``Generate`` token's time goes beyond ``llama_decode`` (issue 39), and the
B=1 row of several source trees side by side, alternated run by run in one process.

    python -m benchmarks.llama_cpp_b1_split --tree main=/work/main --tree new=. [--rounds 5] [--tokens 64]
        [--threads 2] [--peer]

Each tree's server (``llama-cpp`` executor on the packaged SmolLM2 GGUF, ``n_ctx=8192`` as in
``llama_cpp_rows``) runs as a subprocess with ``PYTHONPATH`` set to that tree and a probe loaded
before the server: it timestamps every ``llama_decode`` and every ``steps.run`` on the worker
(``time.perf_counter``, CLOCK_MONOTONIC, so the driver's token stamps share the clock). Per round,
one B=1 greedy stream of ``--tokens`` tokens on each server in turn (and, with ``--peer``,
llama-cpp-python's own ``create_completion`` in this process). Reported per tree, median over
rounds: decode tok/s (token timestamps, as the row), and per token in the stream's steady window:
``llama_decode`` ms, the worker's work around it inside ``steps.run`` (batch fill, logits,
sampling, bookkeeping) and the time between two steps on the worker (the event-loop round trip).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "clients" / "python"))

from .common import median  # noqa: E402

PROBE = r'''
import os, threading, time
OUT = os.environ["B1_PROBE_OUT"]
EV = []  # (kind, t0, t1)

def _wrap(fn, kind):
    def w(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            EV.append((kind, t0, time.perf_counter()))
    w.__wrapped__ = fn
    return w

import llama_cpp.llama_cpp as L
L.llama_decode = _wrap(L.llama_decode, "decode")
import ferrum_service.core.steps as steps
steps.run = _wrap(steps.run, "run")
import ferrum_service.hosting.host as host
if hasattr(host, "run"):
    host.run = steps.run
import ferrum_service.hosting.batcher as batcher
for name, kind in (("_measure", "measure"), ("_next_batch", "next_batch")):
    if hasattr(batcher.ContinuousBatcher, name):
        setattr(batcher.ContinuousBatcher, name, _wrap(getattr(batcher.ContinuousBatcher, name), kind))

def _dump():
    while True:
        time.sleep(0.3)
        tmp = OUT + ".tmp"
        with open(tmp, "w") as f:  # one event a line: kind t0 t1 (the driver's split reads it)
            f.writelines(f"{k} {a!r} {b!r}\n" for k, a, b in EV[-20000:])
        os.replace(tmp, OUT)

threading.Thread(target=_dump, daemon=True).start()
import runpy, sys
sys.argv = ["ferrum_service"] + sys.argv[1:]
runpy.run_module("ferrum_service", run_name="__main__", alter_sys=True)
'''

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712,
          8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]


def stream(target: str, model: str, n: int) -> tuple[list[float], list[int]]:
    """One greedy Generate of ``n`` tokens (ignore_eos): token arrival stamps and ids."""
    import asyncio

    from .remote import _streams

    (rec,) = asyncio.run(_streams(target, model, PROMPT, 1, n))
    return rec["stamps"], rec["tokens"]


def split(events: list, w0: float, w1: float) -> dict:
    """Per-token ms inside [w0, w1]: llama_decode, the rest of steps.run, and between runs."""
    runs = sorted((a, b) for k, a, b in events if k == "run" and w0 <= a and b <= w1)
    decs = sorted((a, b) for k, a, b in events if k == "decode" and w0 <= a and b <= w1)
    if len(runs) < 3:
        return {}
    dec = sum(b - a for a, b in decs) / len(runs)
    in_run = sum(b - a for a, b in runs) / len(runs) - dec
    between = sum(runs[i + 1][0] - runs[i][1] for i in range(len(runs) - 1)) / (len(runs) - 1)
    step = (runs[-1][0] - runs[0][0]) / (len(runs) - 1)
    out = {"steps": len(runs), "decode_ms": 1e3 * dec, "run_other_ms": 1e3 * in_run,
           "between_ms": 1e3 * between, "step_period_ms": 1e3 * step}
    # the loop's side of "between": the hop back (run end -> the batcher's _measure), the
    # stream's turn (-> _next_batch of the next step) and the hop to the worker (-> run start)
    meas = sorted(a for k, a, b in events if k == "measure" and w0 <= a <= w1)
    nexts = sorted(a for k, a, b in events if k == "next_batch" and w0 <= a <= w1)
    back, turn, there = [], [], []
    for (r0, r1), (n0, _) in zip(runs, runs[1:]):
        m = next((t for t in meas if r1 <= t <= n0), None)
        nb = next((t for t in nexts if (m or r1) <= t <= n0), None)
        if m is not None and nb is not None:
            back.append(m - r1)
            turn.append(nb - m)
            there.append(n0 - nb)
    if back:
        out.update(hop_back_ms=1e3 * median(back), stream_turn_ms=1e3 * median(turn), hop_there_ms=1e3 * median(there))
    return out


PEER_DECODES: list[tuple[float, float]] = []


def probe_peer() -> None:
    """Timestamp this process's ``llama_decode`` calls (llama-cpp-python looks it up per call)."""
    import llama_cpp.llama_cpp as L

    fn = L.llama_decode

    def timed(*a):
        t0 = time.perf_counter()
        try:
            return fn(*a)
        finally:
            PEER_DECODES.append((t0, time.perf_counter()))

    L.llama_decode = timed


def peer_run(llm, n: int) -> dict:
    """llama-cpp-python's own streamed greedy completion: tok/s and its llama_decode ms per token."""
    stamps = []
    for _ in llm.create_completion(PROMPT, max_tokens=n, temperature=0.0, top_k=1, repeat_penalty=1.0, stream=True):
        stamps.append(time.perf_counter())
    decs = [(a, b) for a, b in PEER_DECODES if stamps[1] <= a and b <= stamps[-1]]
    period = (stamps[-1] - stamps[1]) / max(1, len(stamps) - 2)
    dec = sum(b - a for a, b in decs) / max(1, len(decs))
    return {"tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]), "decode_ms": 1e3 * dec,
            "step_period_ms": 1e3 * period, "between_ms": 1e3 * (period - dec)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", action="append", required=True, help="NAME=PATH[@SPEC] of a source tree (SPEC: its executor spec fields, default --spec)")
    ap.add_argument("--tree-env", action="append", default=[], help="NAME:VAR=VALUE set for that tree's server")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peer", action="store_true", help="also llama-cpp-python's create_completion")
    ap.add_argument("--spec", default="n_ctx=8192", help="extra executor spec fields")
    ap.add_argument("--gguf", default=None, help="default: the smollm2-llama preset's F16 copy")
    a = ap.parse_args(argv)
    from ferrum_service.hosting.weight_cache import prepare_default
    from ferrum_service.testing.server_process import ServerProcess

    gguf = a.gguf or str(prepare_default())
    tmp = Path(tempfile.mkdtemp(prefix="b1split-"))
    (tmp / "b1probe.py").write_text(PROBE)
    servers = {}
    try:
        for spec in a.tree:
            name, path = spec.split("=", 1)
            path, _, extra = path.partition("@")
            extra = extra or a.spec
            path = str(Path(path).resolve())
            out = tmp / f"{name}.events"
            env = {"PYTHONPATH": f"{path}:{path}/clients/python", "B1_PROBE_OUT": str(out), "FERRUM_TORCH_THREADS": str(a.threads)}
            for e in a.tree_env:
                who, _, kv = e.partition(":")
                if who == name:
                    k, _, v = kv.partition("=")
                    env[k] = v
            srv = ServerProcess(["--log-level", "warning", "--model",
                                 f"llama-cpp,id=llc,path={gguf},threads={a.threads},{extra}"],
                                command=[sys.executable, str(tmp / "b1probe.py")], env=env, cwd=path,
                                log_path=tmp / f"{name}.log", ready_timeout=180)
            srv.start()
            servers[name] = (srv, out)
            stream(srv.target, "llc", 4)  # warm-up
        llm = None
        if a.peer:
            from llama_cpp import Llama

            probe_peer()
            llm = Llama(model_path=gguf, n_ctx=2048, n_threads=a.threads, n_threads_batch=a.threads, verbose=False,
                        flash_attn=True)
            peer_run(llm, 4)
        res: dict[str, list] = {n: [] for n in servers}
        res["peer"] = []
        ids0 = {}
        for r in range(a.rounds):
            order = list(servers) if r % 2 == 0 else list(reversed(servers))
            for name in order:
                srv, out = servers[name]
                stamps, ids = stream(srv.target, "llc", a.tokens)
                ids0.setdefault(name, ids)
                time.sleep(0.7)  # the probe's dump
                events = [(k, float(a), float(b)) for k, a, b in (ln.split() for ln in out.read_text().splitlines())]
                rate = (len(stamps) - 1) / (stamps[-1] - stamps[0])
                res[name].append({"tok_s": rate, **split(events, stamps[1], stamps[-1])})
            if llm is not None:
                res["peer"].append(peer_run(llm, a.tokens))
        same = len({tuple(v) for v in ids0.values()}) == 1
        print(f"threads {a.threads}, {a.tokens} tokens, {a.rounds} rounds alternated; same tokens: {same}")
        keys = ["tok_s", "decode_ms", "run_other_ms", "between_ms", "hop_back_ms", "stream_turn_ms", "hop_there_ms",
                "step_period_ms"]
        print("| tree | " + " | ".join(keys) + " | runs tok/s |")
        print("|---" * (len(keys) + 2) + "|")
        for name, recs in res.items():
            if not recs:
                continue
            cells = [f"{median([x[k] for x in recs if k in x]):.2f}" if any(k in x for x in recs) else "—" for k in keys]
            print(f"| {name} | " + " | ".join(cells) + " | " + ", ".join(f"{x['tok_s']:.1f}" for x in recs) + " |")
        if res["peer"]:
            p = median([x["tok_s"] for x in res["peer"]])
            for name in servers:
                # per round: this tree's run ÷ the peer's run of the same round (a burst of load on
                # the machine hits both), then the median over rounds
                paired = median([x["tok_s"] / y["tok_s"] for x, y in zip(res[name], res["peer"])])
                print(f"{name} ÷ peer: medians {median([x['tok_s'] for x in res[name]]) / p:.3f}, "
                      f"paired by round {paired:.3f}, best runs {max(x['tok_s'] for x in res[name]) / max(x['tok_s'] for x in res['peer']):.3f}")
    finally:
        for srv, _ in servers.values():
            srv.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
