"""In-process measurements (the driver process): the executor alone, transformers' own
``generate``, llama.cpp, memory bandwidth, and lighter-weight variants (bf16, int8 weight-only)."""

from __future__ import annotations

import time

import torch

from .common import median

PROMPT_TEXT = "Write a long story about a lighthouse keeper who finds a mysterious map. Describe every detail."
REPETITIVE_TEXT = (
    "Copy the following list exactly, line by line, then copy it again.\n"
    + "\n".join(f"- item {i}: the quick brown fox jumps over the lazy dog number {i}" for i in range(1, 9))
)


def load_smollm2(dtype: str = "auto"):
    from ferrum_service.executors.transformers import HfCausalLmExecutor
    from ferrum_service.hosting.packaged_models import smollm2_gguf

    d, f = smollm2_gguf()
    ex = HfCausalLmExecutor.from_path(d, gguf_file=f, model_id="smollm2", device="cpu", dtype=dtype,
                                      kv_budget_tokens=32768)
    ex.warmup()
    return ex


def chat_ids(ex, text: str) -> list[int]:
    s = ex.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ex.tokenizer.encode(s, add_special_tokens=False))


def mixed_prompts(vocab: int, b: int, max_len: int = 128) -> list[list[int]]:
    import random

    rng = random.Random(0)
    base = [rng.randrange(100, vocab) for _ in range(max_len)]
    return [base[: max(1, max_len * (i + 1) // b)] for i in range(b)]


@torch.inference_mode()
def executor_decode(ex, prompts: list[list[int]], steps: int, repeats: int, sampled: bool = True,
                    warmup: bool = True) -> dict:
    """Aggregate decode tok/s of ``batch_decode`` over ``prompts`` (one forward per step). With
    ``sampled`` each step also runs server-side greedy sampling (what the server does per step).
    ``warmup``: one untimed pass first."""
    from ferrum_service.core.sampling import process_rows
    from ferrum_service.core.types import DecodeInput, LogitsPolicy, OutputMode, PrefillInput

    none = LogitsPolicy(mode=OutputMode.NONE)
    greedy = LogitsPolicy(mode=OutputMode.SAMPLED_TOKEN)
    rates, trace = [], []
    for r in range(-1 if warmup else 0, repeats):  # r = -1: untimed warm-up (first touch of KV blocks)
        outs = ex.batch_prefill([PrefillInput(token_ids=p[:-1] or p, policy=none) for p in prompts])
        ids = [o.cache.cache_id for o in outs]
        tok = [p[-1] for p in prompts]
        toks = []
        t = time.perf_counter()
        for _ in range(steps):
            inputs = [DecodeInput(cache_id=c, token_id=x, policy=greedy) for c, x in zip(ids, tok)]
            dec = ex.batch_decode(inputs) if len(inputs) > 1 else [ex.decode(inputs[0])]
            if sampled:
                rows = process_rows([d.logits for d in dec], [i.policy for i in inputs],
                                    [ex.registry.get(c).tokens for c in ids], [d.cache.num_tokens for d in dec])
                tok = [rr.token_id for rr in rows]
            else:
                tok = [int(d.logits.argmax()) for d in dec]
            toks.append(tok)
        if r >= 0:
            rates.append(len(prompts) * steps / (time.perf_counter() - t))
        if r == 0:
            trace = toks
        for c in ids:
            ex.release_cache(c)
    return {"tok_s": median(rates), "runs": rates, "tokens": trace}


@torch.inference_mode()
def hf_generate(model, prompt: list[int], b: int, new_tokens: int, repeats: int, warmup: bool = True) -> dict:
    """transformers' own greedy ``generate`` (DynamicCache), batch ``b`` of the same prompt."""
    ids = torch.tensor([prompt] * b, dtype=torch.long)
    am = torch.ones_like(ids)
    rates, out = [], None
    if warmup:
        model.generate(input_ids=ids, attention_mask=am, max_new_tokens=2, do_sample=False, pad_token_id=0)
    for _ in range(repeats):
        t = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=am, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)
        rates.append(b * new_tokens / (time.perf_counter() - t))
    return {"tok_s": median(rates), "runs": rates, "tokens": out[0, len(prompt):].tolist()}


def bandwidth(gib: float = 1.0, repeats: int = 7) -> dict:
    """Memory read bandwidth with the process's torch threads: ``x.sum()`` over a large fp32
    tensor (read only), and ``copy_`` (read + write), medians."""
    n = int(gib * 2**30) // 4
    x = torch.ones(n, dtype=torch.float32)
    y = torch.empty_like(x)
    x.sum()
    y.copy_(x)
    ts, tc = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        ts.append(time.perf_counter() - t)
        t = time.perf_counter()
        y.copy_(x)
        tc.append(time.perf_counter() - t)
    nbytes = n * 4
    del x, y
    return {"read_gb_s": nbytes / median(ts) / 1e9, "copy_gb_s": 2 * nbytes / median(tc) / 1e9,
            "read_gb_s_best": nbytes / min(ts) / 1e9}


def weight_bytes(model) -> int:
    """Bytes of weights read by one decode step: every parameter and int8 weight buffer once. The
    input embedding counts only when it is also the LM head (tied): a lookup alone reads one row
    per token."""
    from ferrum_service.executors.transformers.int8_weights import Int8WeightOnlyLinear

    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    head_is_emb = getattr(head, "weight", None) is not None and head.weight.data_ptr() == emb.data_ptr()
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() in seen or (p.data_ptr() == emb.data_ptr() and not head_is_emb):
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    for m in model.modules():
        if isinstance(m, Int8WeightOnlyLinear):
            total += sum(b.numel() * b.element_size() for b in m.buffers())
    return total


def llama_cpp(gguf_path: str, prompt: list[int], new_tokens: int, repeats: int, threads: int) -> dict:
    """llama.cpp (llama-cpp-python) on the same GGUF file, greedy, B=1; decode tok/s from token
    timestamps (prefill excluded) and end-to-end tok/s (prefill included)."""
    try:
        from llama_cpp import Llama
    except ImportError as e:
        return {"error": f"not available: llama-cpp-python not installed ({e})"}
    import llama_cpp as lc

    llm = Llama(model_path=gguf_path, n_ctx=1024, n_threads=threads, n_threads_batch=threads, n_batch=512,
                verbose=False, seed=0)
    dec, e2e, toks = [], [], []
    for r in range(repeats):
        llm.reset()
        stamps = []
        got = []
        t0 = time.perf_counter()
        for tok in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
            stamps.append(time.perf_counter())
            got.append(int(tok))
            if len(got) >= new_tokens:
                break
        dec.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
        e2e.append(len(stamps) / (stamps[-1] - t0))
        if r == 0:
            toks = got
    return {"decode_tok_s": median(dec), "e2e_tok_s": median(e2e), "tokens": toks, "version": lc.__version__,
            "threads": threads}


@torch.inference_mode()
def greedy_tokens(ex, prompt: list[int], n: int) -> list[int]:
    from ferrum_service.core.types import DecodeInput, PrefillInput

    out = ex.prefill(PrefillInput(token_ids=prompt))
    cid = out.cache.cache_id
    toks = [int(out.logits.argmax())]
    for _ in range(n - 1):
        d = ex.decode(DecodeInput(cache_id=cid, token_id=toks[-1]))
        toks.append(int(d.logits.argmax()))
    ex.release_cache(cid)
    return toks


@torch.inference_mode()
def all_logits(ex, ids: list[int]) -> torch.Tensor:
    from ferrum_service.core.types import PrefillInput

    out = ex.prefill(PrefillInput(token_ids=ids, all_positions=True))
    ex.release_cache(out.cache.cache_id)
    return out.all_logits.float()


def variants(ex32, prompt: list[int], text_ids: list[int], steps: int, repeats: int) -> list[dict]:
    """fp32 (reference), bf16 and int8 weight-only (``dtype="int8"``: int8 linears on torch's fused
    CPU kernel, bf16 activations) loads of the same GGUF: B=1 and B=8 decode tok/s, weight bytes
    read per step, and quality vs fp32 (max |logit diff| and top-1 agreement over a teacher-forced
    text, first greedy divergence over ``2*steps`` generated tokens)."""
    ref_logits = all_logits(ex32, text_ids)
    ref_greedy = greedy_tokens(ex32, prompt, 2 * steps)
    vocab = ex32.info().vocab_size
    rows = []

    def measure(name, ex):
        b1 = executor_decode(ex, [prompt], steps, repeats)["tok_s"]
        b8 = executor_decode(ex, mixed_prompts(vocab, 8), steps, repeats)["tok_s"]
        lg = all_logits(ex, text_ids)
        g = greedy_tokens(ex, prompt, 2 * steps)
        agree = next((i for i, (a, b) in enumerate(zip(g, ref_greedy)) if a != b), len(g))
        top1 = float((lg.argmax(-1) == ref_logits.argmax(-1)).float().mean())
        rows.append({"variant": name, "b1_tok_s": b1, "b8_tok_s": b8, "weight_bytes": weight_bytes(ex.model),
                     "max_logit_diff": float((lg - ref_logits).abs().max()), "top1_agreement": top1,
                     "greedy_prefix_agree": agree, "greedy_tokens": len(g)})

    measure("fp32", ex32)
    for name in ("bf16", "int8"):
        try:
            ex = load_smollm2(name)
            measure(name, ex)
            del ex
        except Exception as e:  # noqa: BLE001
            rows.append({"variant": name, "error": f"{type(e).__name__}: {e}"})
    return rows


@torch.inference_mode()
def decode_vs_context(ex, b: int = 8, contexts: tuple[int, int] = (32, 1536), steps: int = 8, repeats: int = 3) -> dict:
    """BatchDecode step time of ``b`` sequences at each context length (issue 21): every context's
    caches are prefilled once, then ``steps`` greedy ``batch_decode`` steps run at each context in
    turn (ABAB..., ``repeats`` times) and the caches are truncated back after each run, so every run
    sees the same context. Returns p50 step ms per context and their ratio (long ÷ short)."""
    from ferrum_service.core.types import DecodeInput, LogitsPolicy, OutputMode, PrefillInput

    vocab = ex.info().vocab_size
    none = LogitsPolicy(mode=OutputMode.NONE)
    caches = {}
    for ctx in contexts:
        prompts = [[100 + (7 * i + 13 * j) % (vocab - 100) for j in range(ctx)] for i in range(b)]
        per = max(1, ex.max_batch_tokens // ctx)  # rows per prefill forward, within the step limit
        caches[ctx] = [o.cache.cache_id for k in range(0, b, per)
                       for o in ex.batch_prefill([PrefillInput(token_ids=p, policy=none) for p in prompts[k:k + per]])]
    times: dict[int, list[float]] = {ctx: [] for ctx in contexts}
    for r in range(repeats + 1):  # r = 0: untimed warm-up
        for ctx in contexts:
            ids = caches[ctx]
            tok = [101] * b
            for _ in range(steps):
                t = time.perf_counter()
                dec = ex.batch_decode([DecodeInput(cache_id=c, token_id=x) for c, x in zip(ids, tok)])
                if r:
                    times[ctx].append(1e3 * (time.perf_counter() - t))
                tok = [int(d.logits.argmax()) for d in dec]
            for c in ids:
                ex.truncate_kv(c, ctx)
    for ids in caches.values():
        for c in ids:
            ex.release_cache(c)
    p50 = {ctx: median(v) for ctx, v in times.items()}
    short, long = contexts
    return {"b": b, "steps": steps, "step_ms": {str(k): v for k, v in p50.items()},
            "ratio": p50[long] / p50[short], "runs_ms": {str(k): v for k, v in times.items()}}


@torch.inference_mode()
def prompt_joins_decodes(ex, prompt_len: int = 800, decodes: int = 31, context: int = 128, repeats: int = 3) -> dict:
    """One ``prompt_len``-token prompt joining ``decodes`` running decodes (``context`` tokens each)
    in one ``mixed_step``, against the decodes alone (``batch_decode``) plus the prompt alone
    (``prefill``), each side timed in turn (ABC ABC ...). Ratio = joint ÷ (decodes + prompt)."""
    from ferrum_service.core.types import DecodeInput, LogitsPolicy, OutputMode, PrefillInput

    vocab = ex.info().vocab_size
    none = LogitsPolicy(mode=OutputMode.NONE)
    seqs = [[100 + (11 * i + 5 * j) % (vocab - 100) for j in range(context)] for i in range(decodes)]
    ids = [o.cache.cache_id for o in ex.batch_prefill([PrefillInput(token_ids=s, policy=none) for s in seqs])]
    prompt = [100 + (3 * j) % (vocab - 100) for j in range(prompt_len)]
    joint, dec_alone, pre_alone = [], [], []

    def decs():
        return [DecodeInput(cache_id=c, token_id=101) for c in ids]

    for r in range(repeats + 1):  # r = 0: untimed warm-up
        t = time.perf_counter()
        p_out, _ = ex.mixed_step([PrefillInput(token_ids=prompt)], decs())
        t1 = time.perf_counter()
        ex.release_cache(p_out[0].cache.cache_id)
        for c in ids:
            ex.truncate_kv(c, context)
        t2 = time.perf_counter()
        ex.batch_decode(decs())
        t3 = time.perf_counter()
        for c in ids:
            ex.truncate_kv(c, context)
        t4 = time.perf_counter()
        out = ex.prefill(PrefillInput(token_ids=prompt))
        t5 = time.perf_counter()
        ex.release_cache(out.cache.cache_id)
        if r:
            joint.append(1e3 * (t1 - t))
            dec_alone.append(1e3 * (t3 - t2))
            pre_alone.append(1e3 * (t5 - t4))
    for c in ids:
        ex.release_cache(c)
    j, d, p = median(joint), median(dec_alone), median(pre_alone)
    return {"prompt_len": prompt_len, "decodes": decodes, "context": context, "joint_ms": j, "decodes_ms": d,
            "prompt_ms": p, "ratio": j / (d + p), "runs": {"joint": joint, "decodes": dec_alone, "prompt": pre_alone}}
