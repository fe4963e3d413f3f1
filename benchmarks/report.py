"""The Markdown table and the PNG plots of a ``benchmarks.run`` run (its rows in the schema of
:mod:`benchmarks.schema`; ``python -m benchmarks.targets`` tables every results file)."""

from __future__ import annotations

from pathlib import Path


def _f(x, nd=2) -> str:
    if x is None:
        return "—"
    if isinstance(x, str):
        return x
    if x != x:  # nan
        return "nan"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.{nd}f}"


def markdown(res: dict) -> str:
    mi = res["machine"]
    lines = [
        f"### ferrum-service benchmarks — {res['date']}",
        "",
        f"Machine: {mi['cpu']}, {mi['cores']} cores ({mi['cpu_flags']}), {mi['memory_gib']} GiB; "
        f"torch {mi['torch']} (threads: driver {mi['torch_threads']}, server {res['server_threads']}), "
        f"transformers {mi['transformers']}, Python {mi['python']}. Model: {res['model']}. "
        f"Total run time {res['seconds']:.0f} s.",
        "",
        "| # | measure | ours | baseline / peer | ratio | target | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(res["rows"], 1):
        met = "—" if r.get("met") is None else ("yes" if r["met"] else "**no**")
        lines.append(f"| {i} | {r['name']} | {_f(r['ours'])} | {_f(r['peer'])} | {_f(r.get('ratio'))} | {r['target'] or '—'} | {met} |")
    notes = [f"{i}. {r['note']}" for i, r in enumerate(res["rows"], 1) if r.get("note")]
    if res.get("latency"):
        lines += ["", "Generate streams (SmolLM2, server subprocess, "
                  f"{res['latency'][0]['max_tokens']} tokens each, ignore_eos):", "",
                  "| streams | TTFT p50 / p99 ms | ITL p50 / p99 ms | steady agg tok/s | e2e agg tok/s | slowest ÷ median stream | all complete |",
                  "|---|---|---|---|---|---|---|"]
        for g in res["latency"]:
            lines.append(f"| {g['b']} | {_f(g['ttft_p50_ms'],0)} / {_f(g['ttft_p99_ms'],0)} | {_f(g['itl_p50_ms'],1)} / "
                         f"{_f(g['itl_p99_ms'],1)} | {_f(g['steady_tok_s'],1)} | {_f(g['e2e_tok_s'],1)} | "
                         f"{_f(g['slowest_over_median'])} | {'yes' if g['all_complete'] else 'NO'} |")
    if res.get("variants"):
        lines += ["", "Weight variants (in-process executor; quality vs fp32):", "",
                  "| weights | bytes | B=1 tok/s | B=8 tok/s | max abs logit diff | top-1 agreement | greedy tokens equal to fp32 |",
                  "|---|---|---|---|---|---|---|"]
        for v in res["variants"]:
            if "error" in v:
                lines.append(f"| {v['variant']} | not available: {v['error']} | | | | | |")
                continue
            lines.append(f"| {v['variant']} | {v['weight_bytes']/1e6:.0f} MB | {_f(v['b1_tok_s'],1)} | {_f(v['b8_tok_s'],1)} | "
                         f"{_f(v['max_logit_diff'],3)} | {100*v['top1_agreement']:.1f} % | "
                         f"{v['greedy_prefix_agree']} / {v['greedy_tokens']} (first divergence) |")
    if res.get("drift"):
        busy = [k for k, v in res["drift"].items() if v > 0.15]
        lines += ["", "Machine drift per section (a fixed reference workload timed before and after; > 15 % = busy): "
                  + ", ".join(f"{k} {100 * v:.0f} %{' **busy**' if v > 0.15 else ''}" for k, v in res["drift"].items())
                  + (f". Rerun on a quiet machine: {', '.join(busy)}." if busy else ".")]
    if notes:
        lines += ["", "Notes:", "", *notes]
    return "\n".join(lines) + "\n"


def plots(res: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    # 1. throughput vs batch
    fig, ax = plt.subplots(figsize=(6, 4))
    ip = res.get("inproc_batches", {})
    if ip:
        bs = sorted(int(k) for k in ip)
        ax.plot(bs, [ip[str(b)] for b in bs], "o-", label="executor in-process (batch_decode + sampling)")
    if res.get("latency"):
        ax.plot([g["b"] for g in res["latency"]], [g["steady_tok_s"] for g in res["latency"]], "s-",
                label="server: concurrent Generate streams (steady)")
    for dt, d in (res.get("served_dtypes") or {}).items():
        pts = [(int(b), v) for b, v in d.items() if v]
        if pts:
            ax.plot([b for b, _ in pts], [v for _, v in pts], "D:", label=f"server, {dt} weights (steady)")
    if res.get("hf"):
        ax.plot([1, 8], [res["hf"]["1"], res["hf"]["8"]], "^--", label="transformers generate() (e2e)")
    if res.get("llama_cpp_tok_s"):
        ax.axhline(res["llama_cpp_tok_s"], color="gray", ls=":", label="llama.cpp B=1 (decode)")
    ax.set_xlabel("batch size / concurrent streams")
    ax.set_ylabel("aggregate decode tok/s")
    ax.set_title("SmolLM2-135M decode throughput (CPU)")
    ax.set_xscale("log", base=2)
    ax.grid(alpha=.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=110)
    files.append("throughput.png")
    plt.close(fig)
    # 2. latency vs concurrency
    if res.get("latency"):
        fig, ax = plt.subplots(figsize=(6, 4))
        lat = res["latency"]
        x = [g["b"] for g in lat]
        for key, lab in (("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99"), ("itl_p50_ms", "ITL p50"),
                         ("itl_p99_ms", "ITL p99")):
            ax.plot(x, [g[key] for g in lat], "o-", label=lab)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("concurrent Generate streams")
        ax.set_ylabel("ms")
        ax.set_title("TTFT and inter-token latency")
        ax.grid(alpha=.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "latency.png", dpi=110)
        files.append("latency.png")
        plt.close(fig)
    # 3. RSS curve
    if res.get("rss_curve"):
        fig, ax = plt.subplots(figsize=(6, 4))
        c = sorted((int(k), v) for k, v in res["rss_curve"].items())
        ax.plot([k for k, _ in c], [v / 2**20 for _, v in c], "o-")
        ax.set_xlabel("short sessions completed")
        ax.set_ylabel("server RSS (MiB)")
        ax.set_title("Server resident memory over sessions")
        ax.grid(alpha=.3)
        fig.tight_layout()
        fig.savefig(out / "rss.png", dpi=110)
        files.append("rss.png")
        plt.close(fig)
    # 4. ratios vs targets
    rr = [(i + 1, {**r, **r.get("extra", {})}) for i, r in enumerate(res["rows"])
          if isinstance(r.get("ratio"), float) and r.get("extra", {}).get("target_value")]
    if rr:
        fig, ax = plt.subplots(figsize=(7, 4))
        xs = range(len(rr))
        vals = [r["ratio"] / r["target_value"] if not r.get("lower_is_better") else r["target_value"] / r["ratio"]
                for _, r in rr]
        ax.bar(xs, vals, color=["tab:green" if r.get("met") else "tab:red" for _, r in rr])
        ax.axhline(1.0, color="k", lw=1)
        ax.set_xticks(list(xs), [f"#{i}" for i, _ in rr])
        ax.set_ylabel("measured ÷ target (≥ 1 = met)")
        ax.set_title("Targets (row numbers as in the table)")
        fig.tight_layout()
        fig.savefig(out / "targets.png", dpi=110)
        files.append("targets.png")
        plt.close(fig)
    return files
