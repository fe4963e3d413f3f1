"""Prefix caching, forks and Generate n (issue 20): SmolLM2-135M on the transformers executor
(``smollm2-hf``; the llama.cpp executor has no prefix cache yet), served as a subprocess.

    .venv/bin/python -m benchmarks.prefix_rows [--quick] [--threads N] [--rows ttft,chat,n4] [--spec SPEC]

Rows:

* **TTFT, 1,024-token shared system prompt + 32-token question, warm ÷ cold** (target ≥ 10× faster):
  ``Generate(max_tokens=1)`` of system prompt + a new question each time; cold = the same request
  with ``bypass_prefix_cache`` (every token computed), warm = the system prompt's blocks cached by
  an earlier request. Client-side TTFT (send → first token), the two sides alternated run by run.
* **multi-turn chat, prefill tokens computed ÷ sent** (target ≤ 0.2): a conversation of ``turns``
  user messages on a ~500-token system prompt; every turn resends the whole conversation (chat
  template over all messages so far, the assistant's earlier replies as text), as a chat client
  does; computed = ``prompt_tokens − cached_tokens`` from ``GenerateStarted``.
* **Generate n=4 of one 512-token prompt** (sampled, ``ignore_eos``, the prompt computed on both
  sides with ``bypass_prefix_cache``): KV blocks held by live caches (``KvCapacity``: total − free −
  evictable, polled during the stream, peak) ÷ one stream's (target ≤ 1.3); aggregate decode tok/s
  ÷ one stream's (target ≥ 3×), the two sides alternated.

Each row is timed between two runs of ``reference_workload()`` (drift > 15 % = ``busy``). Writes
``results/prefix_rows.json`` and prints a Markdown table and the load average.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

from .common import REPO, Server, median
from .llama_cpp_rows import timed_row
from .schema import write_rows

MODEL = "smollm2"
QUESTIONS = [
    "What does the server do when a client asks for the same system prompt again, and how is that measured",
    "Explain in two sentences why a router would send a new session to the replica holding its prefix",
    "Which executor families does this service host, and which of them page their KV cache in blocks",
    "How does a scheduler written in Go know which token blocks a replica already holds in its cache",
    "Summarise the retry rules for Prefill and Decode when a client step id is given with the request",
    "Why are full-vocabulary logits never sent back unless the caller asks for them explicitly here",
    "What happens to the caches of a Session stream when the client closes the stream without releasing",
    "Describe the difference between truncating a cache and releasing it, in terms of the block pool",
]
CHAT_TURNS = [
    "Hi! Can you tell me what a KV cache is?",
    "Why does it grow with the conversation?",
    "What is a block in a paged KV cache?",
    "And what is prefix caching?",
    "How would two users share cached blocks?",
    "What is a cache salt for?",
    "When are cached blocks evicted?",
    "What does copy-on-write mean for a fork?",
    "Give me an example of a fork in beam search.",
    "How does a router know where a prefix is cached?",
    "Which hash is used for the block keys?",
    "Thanks. Summarise our chat in one sentence.",
]


def _text_tokens(c, n: int, offset: int = 0) -> list[int]:
    """``n`` tokens of real text (the repo's README and contract docs), from token ``offset``."""
    text = (REPO / "README.md").read_text() + "\n" + (REPO / "docs" / "contract.md").read_text()
    ids = c.tokenize(MODEL, text)
    assert len(ids) >= offset + n, (len(ids), offset, n)
    return ids[offset:offset + n]


def _fit(c, text: str, n: int) -> list[int]:
    """``text`` tokenized, cut or padded (with its own tokens) to exactly ``n`` tokens."""
    ids = c.tokenize(MODEL, " " + text + "?")
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def _ttft(c, prompt: list[int], bypass: bool) -> dict:
    t0 = time.perf_counter()
    first = None
    cached = prompt_tokens = 0
    for ev in c.generate(MODEL, token_ids=prompt, max_tokens=1, ignore_eos=True, bypass_prefix_cache=bypass):
        kind = ev.WhichOneof("event")
        if kind == "started":
            cached, prompt_tokens = ev.started.cached_tokens, ev.started.prompt_tokens
        elif kind == "token" and first is None:
            first = time.perf_counter() - t0
    return {"ttft_s": first, "cached_tokens": cached, "prompt_tokens": prompt_tokens}


def ttft_row(target: str, runs: int) -> dict:
    """Cold (bypass) and warm TTFT of system prompt (1,024 tokens) + 32-token questions, alternated."""
    from ferrum_client import Client

    with Client(target, timeout=600) as c:
        system = _text_tokens(c, 1024)
        questions = [_fit(c, q, 32) for q in QUESTIONS]
        _ttft(c, system + questions[-1], bypass=False)  # warm-up; caches the system prompt's blocks
        cold, warm = [], []
        for i in range(runs):
            q = questions[i % (len(questions) - 1)]
            cold.append(_ttft(c, system + q, bypass=True))
            warm.append(_ttft(c, system + q[::-1], bypass=False))  # a question not seen before
    return {"cold": cold, "warm": warm, "cold_s": median([x["ttft_s"] for x in cold]),
            "warm_s": median([x["ttft_s"] for x in warm]), "prompt_tokens": len(system) + 32}


def chat_row(target: str, turns: int, reply_tokens: int) -> dict:
    """A multi-turn chat resending the conversation each turn: prompt tokens sent vs computed."""
    from ferrum_client import Client

    with Client(target, timeout=600) as c:
        system = c.detokenize(MODEL, _text_tokens(c, 480, offset=1500), skip_special_tokens=True)
        messages = [("system", "You are a helpful assistant. Background:\n" + system)]
        per_turn = []
        salt = f"chat-{time.time_ns()}"  # a conversation of its own: nothing cached from other rows
        for k in range(turns):
            messages.append(("user", CHAT_TURNS[k % len(CHAT_TURNS)]))
            ids = c.apply_chat_template(MODEL, messages).token_ids
            toks, started = [], None
            for ev in c.generate(MODEL, token_ids=ids, max_tokens=reply_tokens, cache_salt=salt, temperature=0.0):
                kind = ev.WhichOneof("event")
                if kind == "started":
                    started = ev.started
                elif kind == "token":
                    toks.append(ev.token.token_id)
            per_turn.append({"sent": len(ids), "cached": started.cached_tokens, "generated": len(toks)})
            messages.append(("assistant", c.detokenize(MODEL, toks, skip_special_tokens=True)))
    sent = sum(x["sent"] for x in per_turn)
    computed = sum(x["sent"] - x["cached"] for x in per_turn)
    return {"turns": per_turn, "sent": sent, "computed": computed, "ratio": computed / sent}


class _HeldBlocks:
    """Polls ``KvCapacity`` on a thread: the peak of blocks held by live caches (total − free −
    evictable) while it runs."""

    def __init__(self, target: str, period_s: float = 0.02) -> None:
        from ferrum_client import Client

        self.c = Client(target, timeout=10)
        self.period_s = period_s
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def held(self) -> int:
        k = self.c.kv_capacity(MODEL)
        return int(k.total_blocks - k.free_blocks - k.evictable_blocks)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.held())
            self.samples += 1
            self._stop.wait(self.period_s)

    def __enter__(self) -> "_HeldBlocks":
        self.base = self.held()
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join(10)
        self.c.close()


def _sample_stream(c, prompt: list[int], n: int, max_tokens: int, seed: int) -> dict:
    t0 = time.perf_counter()
    stamps: dict[int, list[float]] = {}
    tokens: dict[int, list[int]] = {}
    finished = 0
    for ev in c.generate(MODEL, token_ids=prompt, max_tokens=max_tokens, ignore_eos=True, n=n, temperature=0.8,
                         top_p=0.95, seed=seed, bypass_prefix_cache=True):
        kind = ev.WhichOneof("event")
        if kind == "token":
            stamps.setdefault(ev.token.sample_index, []).append(time.perf_counter())
            tokens.setdefault(ev.token.sample_index, []).append(ev.token.token_id)
        elif kind == "finished":
            finished += 1
    t1 = time.perf_counter()
    total = sum(len(v) for v in tokens.values())
    w0 = max(s[0] for s in stamps.values())  # every sample has its first token
    w1 = max(s[-1] for s in stamps.values())
    after_first = sum(1 for s in stamps.values() for x in s if x > w0)
    return {"n": n, "samples": len(tokens), "finished": finished, "total_tokens": total,
            "e2e_tok_s": total / (t1 - t0), "decode_tok_s": after_first / (w1 - w0) if w1 > w0 else float("nan"),
            "ttft_s": min(s[0] for s in stamps.values()) - t0, "tokens": {str(k): v for k, v in tokens.items()}}


def n_samples_row(target: str, runs: int, max_tokens: int) -> dict:
    """Generate n=4 vs n=1 of one 512-token prompt: peak KV blocks held and decode tok/s."""
    from ferrum_client import Client

    with Client(target, timeout=600) as c:
        prompt = _text_tokens(c, 512, offset=3000)
        kv = {}
        for n in (1, 4):
            with _HeldBlocks(target) as h:
                kv[n] = _sample_stream(c, prompt, n, max_tokens, seed=7)
            kv[n] = {"peak_blocks": h.peak - h.base, "base_blocks": h.base, "samples": h.samples,
                     "finished": kv[n]["finished"], "total_tokens": kv[n]["total_tokens"]}
        cap = c.kv_capacity(MODEL)
        one, four = [], []
        for i in range(runs):
            one.append(_sample_stream(c, prompt, 1, max_tokens, seed=100 + i))
            four.append(_sample_stream(c, prompt, 4, max_tokens, seed=100 + i))
    return {"kv": kv, "block_size": cap.block_size, "bytes_per_token": cap.bytes_per_token,
            "one": one, "four": four, "one_tok_s": median([x["decode_tok_s"] for x in one]),
            "four_tok_s": median([x["decode_tok_s"] for x in four]),
            "one_e2e": median([x["e2e_tok_s"] for x in one]), "four_e2e": median([x["e2e_tok_s"] for x in four]),
            "max_tokens": max_tokens, "prompt_tokens": len(prompt)}


def rows_from(R: dict, drift: dict) -> list[dict]:
    """Results rows (:mod:`benchmarks.schema`), each with the drift of its section."""
    from .run import row

    out = []
    t = R.get("ttft")
    if t:
        warm_hit = median([x["cached_tokens"] for x in t["warm"]])
        out.append(row("TTFT, 1,024-token shared system prompt + 32-token question: warm ÷ cold",
                       f"{1e3 * t['warm_s']:.0f} ms", f"{1e3 * t['cold_s']:.0f} ms", t["cold_s"] / t["warm_s"],
                       "≥ 10× faster", 10.0, drift=drift.get("ttft"),
                       note=f"Generate(max_tokens=1) of {t['prompt_tokens']} tokens; cold = bypass_prefix_cache, warm = "
                            f"system prompt cached ({warm_hit:.0f} tokens reused, median), a new question each run; "
                            f"{len(t['warm'])} runs per side alternated; ratio = cold ÷ warm TTFT; "
                            f"drift {100 * drift.get('ttft', 0):.0f} %"))
    ch = R.get("chat")
    if ch:
        out.append(row(f"multi-turn chat ({len(ch['turns'])} turns, conversation resent): prefill tokens computed ÷ sent",
                       f"{ch['computed']:,} computed", f"{ch['sent']:,} sent", ch["ratio"], "≤ 0.2", 0.2,
                       lower_is_better=True, drift=drift.get("chat"),
                       note="chat template over all messages each turn, earlier replies as text; computed = "
                            "prompt_tokens − cached_tokens (GenerateStarted); per turn sent/cached: "
                            + ", ".join(f"{x['sent']}/{x['cached']}" for x in ch["turns"])))
    ns = R.get("n4")
    if ns:
        k1, k4 = ns["kv"][1]["peak_blocks"], ns["kv"][4]["peak_blocks"]
        bpb = ns["block_size"] * ns["bytes_per_token"]
        out.append(row(f"Generate n=4 of one {ns['prompt_tokens']}-token prompt: KV bytes ÷ one sequence's",
                       f"{k4 * bpb / 2**20:.1f} MiB ({k4} blocks)", f"{k1 * bpb / 2**20:.1f} MiB ({k1} blocks)",
                       k4 / k1 if k1 else None, "≤ 1.3", 1.3, lower_is_better=True, drift=drift.get("n4"),
                       note=f"peak blocks held by live caches (KvCapacity total − free − evictable, polled every 20 ms) "
                            f"during Generate of {ns['max_tokens']} sampled tokens per sample; block size "
                            f"{ns['block_size']}"))
        out.append(row(f"Generate n=4 of one {ns['prompt_tokens']}-token prompt: tok/s ÷ one stream",
                       f"{ns['four_tok_s']:.1f} tok/s", f"{ns['one_tok_s']:.1f} tok/s",
                       ns["four_tok_s"] / ns["one_tok_s"], "≥ 3×", 3.0, drift=drift.get("n4"),
                       note=f"decode tok/s after every sample's first token, {len(ns['four'])} runs per side alternated, "
                            f"prompt computed on both sides (bypass_prefix_cache); end to end incl. prefill "
                            f"{ns['four_e2e']:.1f} ÷ {ns['one_e2e']:.1f} tok/s; drift {100 * drift.get('n4', 0):.0f} %"))
    return out


SECTIONS = ("ttft", "chat", "n4")


def measure(target: str, quick: bool = False, model: str = "smollm2",
            sections: tuple[str, ...] = SECTIONS) -> tuple[dict, dict]:
    """The sections (default: every one) against a running ``smollm2-hf`` server (model id
    ``model``): (results, drift per section)."""
    global MODEL
    MODEL = model
    R, drift = {}, {}
    for name, fn in (("ttft", lambda: ttft_row(target, 2 if quick else 4)),
                     ("chat", lambda: chat_row(target, 6 if quick else 12, 16 if quick else 32)),
                     ("n4", lambda: n_samples_row(target, 2 if quick else 3, 16 if quick else 32))):
        if name not in sections:
            continue
        t = time.perf_counter()
        try:
            R[name], drift[name] = timed_row(fn)
        except Exception as e:  # noqa: BLE001 - one broken row must not lose the others
            import traceback

            traceback.print_exc()
            R[name], drift[name] = {"error": f"{type(e).__name__}: {e}"}, 0.0
        print(f"[prefix_rows] {name}: {time.perf_counter() - t:.0f} s, drift {100 * drift[name]:.0f} %", flush=True)
    return R, drift


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--spec", default=f"smollm2-hf,id={MODEL}",
                    help="the served model (a smoke run may use a tiny hf-causal-lm with 4k positions)")
    ap.add_argument("--rows", default=",".join(SECTIONS),
                    help="sections to measure, comma-separated (ttft, chat, n4): rerun a busy one alone")
    a = ap.parse_args(argv)
    sections = tuple(x.strip() for x in a.rows.split(",") if x.strip())
    assert set(sections) <= set(SECTIONS), sections
    model = dict(kv.split("=", 1) for kv in a.spec.split(",")[1:] if "=" in kv).get("id", MODEL)
    raw: dict = {"threads": a.threads, "load_before": os.getloadavg(), "spec": a.spec}
    with Server(a.spec, threads=a.threads, name="server-prefix") as srv:
        R, drift = measure(srv.target, a.quick, model, sections)
    rows = rows_from({k: v for k, v in R.items() if "error" not in v}, drift)
    print("| row | ours | base | ratio | target | met | drift |\n|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "—"
        flag = " busy" if r["busy"] else ""
        print(f"| {r['name']} | {r['ours']} | {r['peer']} | {ratio} | {r['target']} | "
              f"{'yes' if r['met'] else 'no'} | {100 * (r['drift'] or 0):.0f} %{flag} |")
    for k, v in R.items():
        if "error" in v:
            print(f"- {k}: {v['error']}")
    write_rows("prefix_rows" if sections == SECTIONS else f"prefix_rows-{'-'.join(sections)}", rows,
               {**raw, "drift": drift, "sections": R})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
