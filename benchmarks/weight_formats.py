"""Quality and speed of the weight formats the SmolLM2 presets can serve (issue 25).

    .venv/bin/python -m benchmarks.weight_formats [--quick] [--threads N] [--runs N]

Formats: the packaged Q4_1 GGUF on llama.cpp (``smollm2-llama,quant=q4_1``), its F16 copy on
llama.cpp (``smollm2-llama``, the default on a machine without CUDA), and the same GGUF loaded by
transformers in fp32 (``smollm2-hf``, the reference) and bf16 (``smollm2-hf,dtype=bf16``).

Quality, in-process, each format against the fp32 transformers executor:

* greedy agreement over a fixed set of chat prompts: tokens equal before the first divergence ÷
  tokens generated (32 per prompt), mean over the prompts;
* top-1 agreement over a teacher-forced text: the share of positions whose argmax equals fp32's.

Speed, served: steady-state aggregate decode tok/s of 1 / 8 / 32 concurrent ``Generate`` streams of
the chat prompt, the formats' servers run alternately, run by run (``--runs``, median per format),
each round between two probes of the reference workload (``drift`` > 15 % flags the row ``busy``).
Writes ``results/weight_formats.json``.
"""

from __future__ import annotations

import argparse
import os

import torch

from .common import Server, median
from .inproc import all_logits, greedy_tokens
from .llama_cpp_rows import reference_workload
from .schema import DRIFT_LIMIT, row, write_rows
from .remote import generate_streams

FORMATS = {  # name: (spec served, spec loaded in-process)
    "Q4_1 (llama.cpp)": "smollm2-llama,quant=q4_1",
    "F16 (llama.cpp, default)": "smollm2-llama",
    "fp32 (transformers)": "smollm2-hf",
    "bf16 (transformers)": "smollm2-hf,dtype=bf16",
}
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Write one sentence about the sea.",
    "What is 12 plus 7?",
    "Give me a synonym for happy.",
    "Explain what a noun is in one sentence.",
    "List two fruits that are yellow.",
    "How many days are in a week?",
]
TEXT = ("The printing press was invented in the fifteenth century. It changed how books were made and "
        "how ideas spread across Europe. Before it, every book was copied by hand, which took months. "
        "Within fifty years, millions of books had been printed, and reading became common in cities.")


def load(spec: str, threads: int):
    from ferrum_service.hosting.model_specs import build_executor, parse_spec

    extra = f",threads={threads},n_ctx=4096" if spec.startswith("smollm2-llama") else ""
    return build_executor(parse_spec(spec + extra), device="cpu")


def agreement(a: list[int], ref: list[int]) -> float:
    n = 0
    for x, y in zip(a, ref):
        if x != y:
            break
        n += 1
    return n / len(ref)


@torch.inference_mode()
def quality(threads: int, new_tokens: int) -> dict:
    ref_ex = load(FORMATS["fp32 (transformers)"], threads)
    tok = ref_ex.tokenizer
    prompts = [tok.encode(ref_ex.apply_chat_template([{"role": "user", "content": p}], True), add_special_tokens=False)
               for p in CHAT_PROMPTS]
    text_ids = tok.encode(TEXT, add_special_tokens=False)
    ref_greedy = [greedy_tokens(ref_ex, p, new_tokens) for p in prompts]
    ref_top1 = all_logits(ref_ex, text_ids).argmax(-1)
    del ref_ex
    out = {}
    for name, spec in FORMATS.items():
        ex = load(spec, threads)
        greedy = [greedy_tokens(ex, p, new_tokens) for p in prompts]
        top1 = all_logits(ex, text_ids).argmax(-1)
        out[name] = {
            "greedy_agreement": sum(agreement(g, r) for g, r in zip(greedy, ref_greedy)) / len(prompts),
            "greedy_exact_prompts": sum(g == r for g, r in zip(greedy, ref_greedy)),
            "top1_agreement": float((top1 == ref_top1).float().mean()),
            "france": ex.tokenizer.decode(greedy[0], skip_special_tokens=True),
        }
        print(f"{name}: {out[name]}", flush=True)
        del ex
    return out


def speed(threads: int, streams: tuple[int, ...], runs: int, new_tokens: int) -> dict:
    """Every format's server up at once; rounds alternate the formats at each stream count."""
    servers = {}
    try:
        for i, (name, spec) in enumerate(FORMATS.items()):
            extra = ",n_ctx=40000" if spec.startswith("smollm2-llama") else ""
            servers[name] = Server(f"{spec},id=m{extra}", threads=threads, name=f"server-formats-{i}").start()
        from ferrum_client import Client

        with Client(servers["fp32 (transformers)"].target) as c:
            prompt = list(c.apply_chat_template("m", [("user", CHAT_PROMPTS[2])]).token_ids)
        for s in servers.values():
            generate_streams(s.target, "m", prompt, 1, 4)  # warm-up
        out: dict = {name: {b: [] for b in streams} for name in FORMATS}
        drift: dict = {b: [] for b in streams}
        for r in range(runs):
            for b in streams:
                before = reference_workload()
                order = list(FORMATS) if r % 2 == 0 else list(reversed(FORMATS))
                for name in order:
                    res = generate_streams(servers[name].target, "m", prompt, b, new_tokens)
                    out[name][b].append(res["steady_tok_s"] if b > 1 else res["e2e_tok_s"])
                after = reference_workload()
                drift[b].append(abs(after - before) / before)
                print(f"run {r} B={b}: " + ", ".join(f"{n} {out[n][b][-1]:.1f}" for n in FORMATS)
                      + f" (drift {100 * drift[b][-1]:.0f} %)", flush=True)
        return {"tok_s": {n: {b: median(v) for b, v in d.items()} for n, d in out.items()},
                "drift": {b: max(v) for b, v in drift.items()}, "runs": out}
    finally:
        for s in servers.values():
            s.stop()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--runs", type=int, default=None)
    ap.add_argument("--streams", default="1,8,32")
    ap.add_argument("--only", choices=("quality", "speed"), default=None,
                    help="one half (quality needs no quiet machine: it times nothing)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    raw: dict = {"load_before": os.getloadavg()}
    streams = tuple(int(x) for x in a.streams.split(","))
    q = raw["quality"] = quality(a.threads, 16 if a.quick else 32) if a.only != "speed" else None
    s = (speed(a.threads, streams, a.runs or (1 if a.quick else 2), 16 if a.quick else 32)
         if a.only != "quality" else None)
    raw["speed"] = s
    rows = []
    head = " | ".join(f"tok/s B={b}" for b in streams)
    print(f"\n| format | greedy agreement with fp32 | top-1 agreement | {head} | drift | flag |")
    print("|---|---|---|" + "---|" * len(streams) + "---|---|")
    worst = max(s["drift"].values()) if s else None
    ref = "fp32 (transformers)"
    default = "F16 (llama.cpp, default)"
    for name in FORMATS:
        if q:
            ga, t1 = q[name]["greedy_agreement"], q[name]["top1_agreement"]
            # the bar for the default format: mean greedy agreement with fp32 >= 0.9
            tgt = {"target": "≥ 0.9", "target_value": 0.9} if name == default else {}
            rows.append(row(f"{name}: greedy chat replies, agreement with {ref}", round(ga, 3), 1.0, round(ga, 3),
                            **tgt, format=name, prompts=len(CHAT_PROMPTS),
                            exact_prompts=q[name]["greedy_exact_prompts"], top1_agreement=round(t1, 3),
                            france=q[name]["france"],
                            note=f"tokens equal before the first divergence ÷ tokens generated, mean over "
                                 f"{len(CHAT_PROMPTS)} chat prompts; top-1 agreement over a teacher-forced text "
                                 f"{t1:.3f}; times nothing, so no drift probe"))
        if s:
            for b in streams:
                ours, peer = s["tok_s"][name][b], s["tok_s"][ref][b]
                rows.append(row(f"{name}, {b} Generate stream{'s' if b > 1 else ''}: tok/s ÷ {ref}", ours, peer,
                                ours / peer if peer else None, drift=s["drift"][b], unit="tok/s", format=name,
                                streams=b,
                                note=f"{'steady-state aggregate' if b > 1 else 'end to end'} decode tok/s, formats "
                                     f"alternated run by run, median; reported (no target)"))
        cells = [f"{q[name][k]:.2f}" if q else "—" for k in ("greedy_agreement", "top1_agreement")]
        cells += [f"{s['tok_s'][name][b]:.1f}" if s else "—" for b in streams]
        cells += [f"{100 * worst:.0f} %" if s else "—", "busy" if s and worst > DRIFT_LIMIT else ""]
        print(f"| {name} | " + " | ".join(cells) + " |")
    write_rows("weight_formats" + (f"-{a.only}" if a.only else ""), rows, raw)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
