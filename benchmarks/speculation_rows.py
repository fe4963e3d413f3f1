"""Server-side speculation (issue 30): ``Generate`` with the n-gram drafter ÷ plain ``Generate``,
decode tok/s on a repetitive copy task, greedy output asserted identical.

    .venv/bin/python -m benchmarks.speculation_rows [--model smollm2-hf|smollm2] [--threads N]
        [--runs N] [--retries N] [--streams 1,4] [--max-tokens N] [--draft N] [--tasks copy,prose]

The prompt is a paragraph written twice and the start of its third copy (a copy task: the model
continues the paragraph it has seen, and the drafter finds each next run of tokens earlier in the
prompt). One server (``--model``), the same prompt; per row, plain and speculating streams run
alternately (``--runs`` each, medians), every pair of runs between two probes of the reference
workload (``llama_cpp_rows.reference_workload``); a row whose drift exceeds 15 % is flagged ``busy``
and measured again (``--retries``), and one still busy is not a result. Decode tok/s of a stream = (tokens − 1) ÷ (last token's arrival − first's);
B streams: their tokens ÷ the window from the first first token to the last last token.
Results: ``benchmarks/results/speculation_rows[-MODEL].json``.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

from .common import Server, median
from .schema import row, write_rows
from .llama_cpp_rows import DRIFT_LIMIT, timed_row

PARAGRAPH = (
    "The committee met on Tuesday to review the budget for the new library. After a long discussion, "
    "the members agreed to fund the reading room, the children's section and a small cafe near the "
    "entrance, and asked the architect to present revised drawings at the next meeting in March."
)


def copy_prompt() -> str:
    return f"{PARAGRAPH}\n\n{PARAGRAPH}\n\n{PARAGRAPH[:40]}"


def prose_prompt() -> str:
    """No repeated text: what speculation costs when its drafts are mostly rejected (reported, no target)."""
    return "Write a short story about a lighthouse keeper who finds a message in a bottle.\n\nOnce upon a time,"


TASKS = {"copy": (copy_prompt, "≥ 1.5x"), "prose": (prose_prompt, "reported")}


def _stream(client, model: str, prompt: str, max_tokens: int, draft: int, out: list) -> None:
    from ferrum_client import pb

    req = pb.GenerateRequest(model_id=model, text=prompt, bypass_prefix_cache=True,
                             stop=pb.StopConditions(max_tokens=max_tokens, ignore_eos=True))
    if draft:
        req.speculation.CopyFrom(pb.SpeculationOptions(max_draft_tokens=draft))
    toks, stamps, fin = [], [], None
    for ev in client.stub.Generate(req):
        if ev.WhichOneof("event") == "token":
            toks.append(ev.token.token_id)
            stamps.append(time.perf_counter())
        elif ev.WhichOneof("event") == "finished":
            fin = ev.finished
    out.append({"tokens": toks, "stamps": stamps, "draft": fin.draft_tokens, "accepted": fin.accepted_draft_tokens})


def run_streams(client, model: str, prompt: str, b: int, max_tokens: int, draft: int) -> dict:
    recs: list = []
    ts = [threading.Thread(target=_stream, args=(client, model, prompt, max_tokens, draft, recs)) for _ in range(b)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    w0 = min(r["stamps"][0] for r in recs)
    w1 = max(r["stamps"][-1] for r in recs)
    n = sum(len(r["tokens"]) - 1 for r in recs)
    drafted = sum(r["draft"] for r in recs)
    return {"tok_s": n / (w1 - w0) if w1 > w0 else float("nan"), "tokens": [r["tokens"] for r in recs],
            "draft_tokens": drafted, "accepted": sum(r["accepted"] for r in recs),
            "acceptance": sum(r["accepted"] for r in recs) / drafted if drafted else 0.0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-hf", help="a model preset (smollm2-hf, smollm2, smollm2-llama)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--runs", type=int, default=2, help="runs per side and row (medians)")
    ap.add_argument("--streams", default="1,4", help="rows: concurrent streams (comma-separated)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--draft", type=int, default=8, help="max_draft_tokens of the speculating side")
    ap.add_argument("--retries", type=int, default=2, help="re-measurements of a row flagged busy")
    ap.add_argument("--tasks", default="copy",
                    help="copy (the target row) and/or prose (low acceptance), comma-separated")
    a = ap.parse_args(argv)
    from ferrum_client import Client

    rows, raw = [], {"threads": a.threads, "model": a.model, "load_before": os.getloadavg(), "rows": {}}
    print("| row | speculation tok/s | plain tok/s | ratio | target | acceptance | identical | drift | flag |\n"
          "|---|---|---|---|---|---|---|---|---|", flush=True)
    with Server(f"{a.model},id=m", threads=a.threads, name=f"server-speculation-{a.model}") as srv, \
            Client(srv.target) as c:
        run_streams(c, "m", copy_prompt(), 1, 8, 0)  # warm-up of both paths
        run_streams(c, "m", copy_prompt(), 1, 8, a.draft)
        cells = [(t, int(b)) for t in a.tasks.split(",") for b in a.streams.split(",")]
        for task, b in cells:
            prompt, target = TASKS[task][0](), TASKS[task][1]
            for attempt in range(1 + a.retries):  # a busy row is measured again, not published
                plain, spec, drifts = [], [], []
                for _ in range(a.runs):
                    (p, s), d = timed_row(lambda: (run_streams(c, "m", prompt, b, a.max_tokens, 0),
                                                   run_streams(c, "m", prompt, b, a.max_tokens, a.draft)))
                    plain.append(p)
                    spec.append(s)
                    drifts.append(d)
                if max(drifts) <= DRIFT_LIMIT:
                    break
                print(f"({task}, streams={b}: drift {100 * max(drifts):.0f} %, busy; attempt {attempt + 1})",
                      flush=True)
            same = all(t == plain[0]["tokens"][0] for r in plain + spec for t in r["tokens"])
            assert same, "speculation changed greedy output"
            ps, ss = median([r["tok_s"] for r in plain]), median([r["tok_s"] for r in spec])
            acc = median([r["acceptance"] for r in spec])
            drift = max(drifts)
            flag = "busy" if drift > DRIFT_LIMIT else ""
            rows.append(row(f"{a.model}: Generate n-gram speculation ÷ plain, {task} task, {b} stream(s), "
                            f"{a.max_tokens} tokens", round(ss, 1), round(ps, 1), round(ss / ps, 2),
                            None if target == "reported" else target,
                            target_value=1.5 if target == "≥ 1.5x" else None, drift=round(drift, 3),
                            unit="tok/s", acceptance=round(acc, 2), greedy_identical=bool(same),
                            note="server-side speculation ÷ plain Generate, sides alternated; acceptance "
                                 f"{acc:.2f}; greedy output identical: {same}"))
            raw["rows"][f"{task}_b{b}"] = {
                "attempts": attempt + 1, "drifts": drifts, "tokens0": plain[0]["tokens"][0],
                "plain": [{k: v for k, v in r.items() if k != "tokens"} for r in plain],
                "spec": [{k: v for k, v in r.items() if k != "tokens"} for r in spec]}
            r = rows[-1]
            print(f"| {r['name']} | {r['ours']} | {r['peer']} | {r['ratio']} | {r['target'] or ''} | "
                  f"{acc:.2f} | {same} | {100 * drift:.0f} % | {flag} |", flush=True)
    write_rows(f"speculation_rows-{a.model}", rows, raw)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
