"""ferrum's own engine over the wire (issues 15, 40): ferrum-engine 0.8.8's ``ContinuousBatchEngine``
driving the remote SmolLM2 through the Rust ``RemoteModelExecutor``, and ferrum-engine 0.18.4's
(the token-execution protocol) through ``RemoteTokenExecutor``, against the same server's own
``Generate``, side by side in one run.

    .venv/bin/python -m benchmarks.engine_rows [--quick] [--threads N] [--executor llama-cpp|hf] [--release]
        [--lines 0.8,0.18] [--runs N] [--tokens N]

Each line is its own example: ``clients/rust/examples/engine_bench.rs`` (0.8.8) and
``clients/rust-execution/examples/engine_bench_018.rs`` (0.18.4); both print the same JSON line.
Per round the sides go engine 0.8, engine 0.18, ``Generate`` (each line's ratio is against the
``Generate`` runs of the same rounds). Both lines send their steps on one ``Session`` stream
(``--unary``: unary calls); the 0.18 line has no step clock, so its rows carry no ``step_ms``.

Rows, at 1 and 8 concurrent requests of the same chat prompt (37 tokens), greedy, every request
``max_tokens`` long (EOS ignored on both sides):

* end-to-end aggregate tok/s (prefills included) of the engine
  (``clients/rust/examples/engine_bench.rs``, one process per run, after a warm-up request) ÷
  the same number of concurrent ``Generate`` streams (``remote.generate_streams``), target ≥ 0.8;
* the engine's step RPCs per generated token (``RemoteModelExecutor::rpc_counts``: per engine step
  one ``ReserveKvSlots`` + one ``UnifiedDecode``, prefills included; plus one ``ReleaseCache`` per
  request) — ``Generate`` sends one RPC per request.

The two sides alternate (engine, Generate, engine, Generate, …; medians), and the fixed reference
workload of ``llama_cpp_rows`` is timed before and after each row: a row whose drift exceeds 15 % is
flagged ``busy``. The example is built in the debug profile by default (the cargo target dir the
Rust tests use); ``--release`` builds it optimised (another ~15 minutes on 2 cores the first time),
which is what a deployed engine runs: only the engine's own bookkeeping and the client run there,
the model runs in the server.

Where an engine step's time goes (issue 30): ``engine_bench`` prints the executor's step clock
(``RemoteModelExecutor::step_clock``) as ``step_ms``, per step: the client's work before / after
the call, the round trip, the server's ``StepTimings`` (total = queued + forward + other, where
"other" is request checks, plan, admission, response), the wire (round trip − server total:
gRPC, (de)serialisation, loopback) and the engine's own time between steps. The row keeps the
medians (``extra.step_ms``) and the run prints them. ``--unary`` sends the engine's steps as unary
``UnifiedDecode`` calls instead of steps of one ``Session`` stream (the default since issue 30).

Measured on the busy 2-core box (short runs, release engine; a 1-thread server to keep llama.cpp's
forward stable under the other agents' load), ms per step, session / unary:

* B=1: round trip 34.6-36.2 = server 33.9-35.7 (forward 33.4-34.9, of which ``llama_decode`` 32.2
  and greedy sampling 0.3-0.6; queued 0.1-0.4; other 0.37-0.39) + wire 0.56-0.69 on the stream
  (1.05-1.87 unary); client 0.01; engine between steps 0.25-0.27 (0.75-1.0 in the debug build).
  ``Generate``: 33.9-34.3 ms per token with a 31.8-32.8 ms forward. Engine ÷ Generate tok/s
  0.96-1.02 there.
* B=8: every step carries all 8 rows (7.76 on average, the prompts' step included); round trip
  79.3-79.7 = server 78.5-78.9 (forward 77.7-78.2, other 0.59-0.62) + wire 0.85; between steps
  0.4-0.5. ``Generate`` 74.9-79.3 ms per step. Ratio 0.97-1.02.
* The command itself (``--quick --release``, 2 threads, drift 0-3 %, forward ~19 ms at B=1 and
  ~43 ms at B=8 on the shared box): B=1 0.92-1.06, B=8 1.02-1.03 on the stream; ``--unary`` 0.99 /
  1.00 in the same minutes (wire 1.2-1.4 ms against 0.76-1.08 on the stream: within the noise of
  one short run); same tokens at both.

What bounded the row before (0.76 / 0.61): ferrum's engine reserves every new sequence
(``ReserveKvSlots`` makes an empty cache) before its first step, and the llama.cpp executor gave
the prefix cache only to caches created by the step itself, so every engine prompt was computed
whole (8 × 37 tokens at B=8 where ``Generate`` computes 8 × 5 after its cached 32) and held its own
prompt cells, which every later decode step's attention then covered; at B=8 the 8 engine requests
did not even get identical greedy tokens. An empty reserved cache now takes its prompt's cached
prefix on its first chunk (``tests/test_llama_cpp_prefix.py``). What is left per step at B=1 is
about 1 ms more than ``Generate``'s own per-token overhead: the wire (~0.6-0.9 ms on the stream)
and the server's per-request bookkeeping (~0.4 ms, spread over checks, plan, admission and
response: no single cut), so with a ~8 ms forward (2 threads on a quiet box) the B=1 ratio is
bounded near 0.9; moving it further means fewer round trips per token (the server running several
engine steps per request, e.g. a decode-only step that repeats while the engine has nothing to
change), not cheaper ones. The transformers executor (``--executor hf``) still computes whole
prompts for reserved caches (its paged pool matches prefixes for new caches only).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

from .common import REPO, Server, median
from .llama_cpp_rows import timed_row
from .schema import row, write_rows
from .remote import generate_streams

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712,
          8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]


def target_dir() -> Path:
    cache = Path(os.environ.get("FERRUM_CACHE_DIR", Path.home() / ".cache" / "ferrum-service"))
    return Path(os.environ.get("CARGO_TARGET_DIR", cache / "cargo-target"))


#: ferrum line → (crate directory, example name).
LINES = {"0.8": ("rust", "engine_bench"), "0.18": ("rust-execution", "engine_bench_018")}


def build_example(release: bool = False, line: str = "0.8") -> Path:
    """``cargo build [--release] --example NAME`` of ``line``'s crate (cached target dir); the
    binary's path."""
    crate, name = LINES[line]
    env = {**os.environ, "CARGO_TARGET_DIR": str(target_dir())}
    cargo = Path.home() / ".cargo" / "bin" / "cargo"
    subprocess.run([str(cargo) if cargo.exists() else "cargo", "build", "--locked", "-q", "--example", name,
                    *(["--release"] if release else [])],
                   cwd=REPO / "clients" / crate, env=env, check=True, timeout=3600)
    return target_dir() / ("release" if release else "debug") / "examples" / name


def engine_run(exe: Path, target: str, model: str, prompt: list[int], b: int, max_tokens: int,
               unary: bool = False) -> dict:
    """One run of ``engine_bench`` (its own process, warm-up request first): its JSON line."""
    out = subprocess.run([str(exe), "--endpoint", f"http://{target}", "--model", model,
                          "--prompt", ",".join(map(str, prompt)), "--concurrency", str(b),
                          "--max-tokens", str(max_tokens), *(["--unary"] if unary else [])],
                         check=True, capture_output=True, text=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def step_split(runs: list[dict]) -> dict:
    """Median over runs of each per-step figure of ``engine_bench``'s ``step_ms`` (the executor's
    step clock): client work, round trip, the server's ``StepTimings`` split, the engine's own time
    between steps."""
    keys = runs[0].get("step_ms", {}).keys()
    return {k: round(median([r["step_ms"][k] for r in runs]), 3) for k in keys}


def paired(exes: dict[str, Path], target: str, model: str, b: int, n: int, runs: int,
           unary: bool = False) -> dict[str, dict]:
    """``runs`` rounds of (each line's engine, Generate); per line, medians of each side's e2e
    tok/s against the same rounds' ``Generate``."""
    eng: dict[str, list[dict]] = {line: [] for line in exes}
    gen = []
    for _ in range(runs):
        for line, exe in exes.items():
            eng[line].append(engine_run(exe, target, model, PROMPT, b, n, unary))
        gen.append(generate_streams(target, model, PROMPT, b, n))
    return {line: {
        "engine_tok_s": median([r["e2e_tok_s"] for r in runs_]),
        "generate_tok_s": median([r["e2e_tok_s"] for r in gen]),
        "rpc_per_token": median([r["rpc_per_token"] for r in runs_]),
        "step_ms": step_split(runs_),
        "generate_itl_p50_ms": median([r["itl_p50_ms"] for r in gen]),
        "engine_runs": runs_,
        "generate_runs": [{k: v for k, v in r.items() if k != "tokens0"} for r in gen],
        # greedy on both sides: the engine's tokens are the server's own
        "same_tokens": all(r["tokens0"] == gen[0]["tokens0"] for r in runs_),
    } for line, runs_ in eng.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--executor", choices=("llama-cpp", "hf"), default="llama-cpp")
    ap.add_argument("--release", action="store_true", help="build the engine examples optimised")
    ap.add_argument("--unary", action="store_true",
                    help="the engines' steps as unary UnifiedDecode calls (default: on one Session stream)")
    ap.add_argument("--lines", default="0.8,0.18", help="ferrum lines to run, comma-separated: 0.8, 0.18")
    ap.add_argument("--runs", type=int, default=0, help="runs per side, alternated (default 3; --quick 1)")
    ap.add_argument("--tokens", type=int, default=0, help="tokens per request (default 32; --quick 16)")
    a = ap.parse_args(argv)
    lines = [x.strip() for x in a.lines.split(",") if x.strip()]
    unknown = set(lines) - set(LINES)
    if unknown or not lines:
        ap.error(f"--lines: {sorted(unknown) or 'none'} (known: {', '.join(LINES)})")
    n = a.tokens or (16 if a.quick else 32)
    runs = a.runs or (1 if a.quick else 3)
    exes = {line: build_example(a.release, line) for line in lines}
    spec = (f"smollm2-llama,id=smollm2,threads={a.threads}" if a.executor == "llama-cpp"
            else "smollm2-hf,id=smollm2")
    rows, raw = [], {"threads": a.threads, "executor": a.executor, "max_tokens": n, "runs": runs,
                     "profile": "release" if a.release else "debug", "lines": lines,
                     "steps": "unary" if a.unary else "session", "load_before": os.getloadavg()}
    print("| row | engine tok/s | Generate tok/s | ratio | target | RPCs / token | same tokens | drift | flag |\n"
          "|---|---|---|---|---|---|---|---|---|", flush=True)
    split = {}
    with Server(spec, threads=a.threads, name="server-engine-rows") as srv:
        generate_streams(srv.target, "smollm2", PROMPT, 1, 4)  # warm-up
        for b in (1, 8):
            per_line, drift = timed_row(lambda: paired(exes, srv.target, "smollm2", b, n, runs, a.unary))
            for line, r in per_line.items():
                raw[f"b{b}" if line == "0.8" else f"b{b}-{line}"] = r
                steps = "unary" if a.unary else "on one Session stream"
                x = row(f"ferrum {line} engine, {b} concurrent ÷ {b} Generate streams ({a.executor})",
                        r["engine_tok_s"], r["generate_tok_s"], r["engine_tok_s"] / r["generate_tok_s"], "≥ 0.9",
                        target_value=0.9, drift=drift, unit="tok/s", rpc_per_token=r["rpc_per_token"],
                        same_tokens=r["same_tokens"], step_ms=r["step_ms"],
                        generate_itl_p50_ms=r["generate_itl_p50_ms"],
                        note=f"ferrum-engine {'0.8.8' if line == '0.8' else '0.18.4'}; {a.executor} executor, {n} "
                             f"tokens per request, greedy, {runs} runs per side alternated, medians; "
                             f"{'release' if a.release else 'debug'} build of the engine example; steps {steps}")
                rows.append(x)
                print(f"| {x['name']} | {x['ours']:.1f} | {x['peer']:.1f} | {x['ratio']:.2f} | {x['target']} | "
                      f"{r['rpc_per_token']:.2f} | {r['same_tokens']} | {100 * drift:.0f} % | "
                      f"{'busy' if x['busy'] else ''} |", flush=True)
                if r["step_ms"]:
                    split[(line, b)] = (r["step_ms"], r["generate_itl_p50_ms"])
    for (line, b), (sm, itl) in split.items():
        print(f"{line} B={b}, ms per engine step: rpc {sm.get('rpc_ms')} = server {sm.get('server_total_ms')} "
              f"(forward {sm.get('server_forward_ms')}, queued {sm.get('server_queued_ms')}, other "
              f"{sm.get('server_other_ms')}) + wire {sm.get('wire_ms')}; client {sm.get('client_prep_ms')} + "
              f"{sm.get('client_post_ms')}; engine between steps {sm.get('between_steps_ms')}; rows/step "
              f"{sm.get('rows_per_step')}; Generate ITL p50 {itl:.2f}", flush=True)
    write_rows("engine_rows" + ("-release" if a.release else "") + ("-unary" if a.unary else ""), rows, raw)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
