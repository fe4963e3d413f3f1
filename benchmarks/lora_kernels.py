"""How to run mixed LoRA adapters in one batched step (issue 17: "PEFT's mixed-adapter batches, or a
grouped per-row LoRA matmul, whichever measures better"): one decode step of 8 sequences on SmolLM2
(fp32, CPU), 2 sequences on each of 4 random rank-16 adapters on every linear layer, against the
same step with no adapters, for three ways of applying them:

- ``stacked`` (what the server does, ``executors/transformers/lora.py``): per module ``x @ A_cat``, a rank-column
  mask, ``@ B_cat`` over the step's adapters stacked;
- ``grouped``: per module and adapter, gather the adapter's rows, two matmuls, scatter them back
  (the same hooks with ``LoraStep.apply`` replaced for this measurement);
- ``peft``: PEFT's own mixed-adapter batch (``adapter_names=``) on the transformers model with a
  ``DynamicCache`` (PEFT's base: ``"__base__"`` for every row).

    .venv/bin/python -m benchmarks.lora_kernels [--steps 20] [--rounds 4]

Each implementation's mixed step is divided by its own plain step; rounds alternate the
implementations; medians. Drift-probed around the whole run. Prints a Markdown table and writes
``results/lora_kernels.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from .llama_cpp_rows import reference_workload
from .lora_rows import ADAPTERS, build_adapters
from .schema import DRIFT_LIMIT, row, write_rows

ROWS = 8
PROMPT = 64


def _grouped_apply(self, name, x, y):
    """The grouped alternative: a gather, two matmuls and a scatter per adapter per module."""
    st = self.stacks.get(name)
    if st is None:
        return y
    xf, yf = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
    parts = st.__dict__.get("_parts")
    if parts is None:
        parts, off = [], 0
        for g in st.groups:
            r = int((st.cols == g).sum())
            parts.append((g, st.a_cat[:, off:off + r].contiguous(), st.b_cat[off:off + r].contiguous()))
            off += r
        st.__dict__["_parts"] = parts
    idx_of = self.__dict__.setdefault("_idx", {})
    for g, a, b in parts:
        if self.slots is None:
            yf.add_((xf @ a) @ b)
            continue
        idx = idx_of.get(g)
        if idx is None:
            idx = idx_of[g] = (self.slots == g).nonzero().squeeze(1)
        yf.index_add_(0, idx, (xf.index_select(0, idx) @ a) @ b)
    return y


class Ours:
    def __init__(self, adapters: Path) -> None:
        from ferrum_service.executors import lora
        from ferrum_service.executors.transformers import HfCausalLmExecutor
        from ferrum_service.hosting.packaged_models import smollm2_gguf

        d, f = smollm2_gguf()
        self.lora = lora
        self.stacked = lora.LoraStep.apply
        self.ex = HfCausalLmExecutor.from_path(str(d / f), model_id="smollm2", device="cpu", max_adapters=ADAPTERS)
        for k in range(ADAPTERS):
            self.ex.load_adapter(f"a{k}", str(adapters / f"a{k}"))

    def step_ms(self, mixed: bool, grouped: bool, steps: int) -> float:
        from ferrum_service.core.types import DecodeInput, PrefillInput

        self.lora.LoraStep.apply = _grouped_apply if grouped else self.stacked
        ex = self.ex
        names = [f"a{i % ADAPTERS}" if mixed else "" for i in range(ROWS)]
        ids = [ex.prefill(PrefillInput(token_ids=list(range(100 + i, 100 + i + PROMPT)), adapter=a,
                                       bypass_prefix_cache=True)).cache.cache_id for i, a in enumerate(names)]
        try:
            ex.batch_decode([DecodeInput(cache_id=c, token_id=5) for c in ids])  # warm
            t0 = time.perf_counter()
            for _ in range(steps):
                ex.batch_decode([DecodeInput(cache_id=c, token_id=5) for c in ids])
            return 1000 * (time.perf_counter() - t0) / steps
        finally:
            for c in ids:
                ex.release_cache(c)
            self.lora.LoraStep.apply = self.stacked


class Peft:
    def __init__(self, adapters: Path) -> None:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        from ferrum_service.hosting.packaged_models import smollm2_gguf

        d, f = smollm2_gguf()
        base = AutoModelForCausalLM.from_pretrained(str(d), gguf_file=f, dtype=torch.float32)
        self.model = PeftModel.from_pretrained(base, str(adapters / "a0"), adapter_name="a0").eval()
        for k in range(1, ADAPTERS):
            self.model.load_adapter(str(adapters / f"a{k}"), adapter_name=f"a{k}")

    @torch.inference_mode()
    def step_ms(self, mixed: bool, steps: int) -> float:
        from transformers import DynamicCache

        names = [f"a{i % ADAPTERS}" if mixed else "__base__" for i in range(ROWS)]
        ids = torch.tensor([list(range(100 + i, 100 + i + PROMPT)) for i in range(ROWS)])
        cache = DynamicCache()
        self.model(input_ids=ids, past_key_values=cache, use_cache=True, adapter_names=names)
        tok = torch.full((ROWS, 1), 5)
        self.model(input_ids=tok, past_key_values=cache, use_cache=True, adapter_names=names)  # warm
        t0 = time.perf_counter()
        for _ in range(steps):
            self.model(input_ids=tok, past_key_values=cache, use_cache=True, adapter_names=names)
        return 1000 * (time.perf_counter() - t0) / steps


def to_row(rec: dict, date: str | None = None) -> dict:
    """The results row of one way's record (``way``, ``mixed_ms``, ``plain_ms``, ``ratio``,
    ``drift``). Reported only: no target."""
    return row(f"LoRA decode step of {ROWS} sequences over {ADAPTERS} adapters, {rec['way']}: mixed ÷ no adapters "
               "(tok/s; ours / peer in ms per step)", rec["mixed_ms"], rec["plain_ms"], rec["ratio"],
               drift=rec["drift"], date=date, unit="ms/step", way=rec["way"],
               note="ratio = plain ms ÷ mixed ms; each way's mixed step ÷ its own step without adapters, "
                    "rounds alternated, medians")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    a = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("FERRUM_TORCH_THREADS", os.cpu_count() or 1)))
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="ferrum-lora-kernels-") as tmp:
        build_adapters(Path(tmp), a.rank)
        ours, peft = Ours(Path(tmp)), Peft(Path(tmp))
        sides = {
            "stacked": lambda m: ours.step_ms(m, False, a.steps),
            "grouped": lambda m: ours.step_ms(m, True, a.steps),
            "peft": lambda m: peft.step_ms(m, a.steps),
        }
        ms = {(k, m): [] for k in sides for m in (True, False)}
        before = reference_workload()
        for r in range(a.rounds):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for k in order:
                for m in ((True, False) if r % 2 else (False, True)):
                    ms[(k, m)].append(sides[k](m))
        drift = abs(reference_workload() - before) / before
    rows = []
    print(f"| way | {ADAPTERS} adapters mixed ms/step | no adapters ms/step | mixed ÷ plain tok/s | drift |")
    print("|---|---|---|---|---|")
    for k in sides:
        mixed, plain = statistics.median(ms[(k, True)]), statistics.median(ms[(k, False)])
        rows.append(to_row({"way": k, "mixed_ms": mixed, "plain_ms": plain, "ratio": plain / mixed,
                            "drift": drift}))
        print(f"| {k} | {mixed:.1f} | {plain:.1f} | {plain / mixed:.2f} | {100 * drift:.0f} %"
              f"{' (busy)' if drift > DRIFT_LIMIT else ''} |")
    write_rows("lora_kernels", rows, {"rows": ROWS, "prompt": PROMPT, "rank": a.rank, "steps": a.steps,
                                      "rounds": a.rounds, "ms": {f"{k}/{m}": v for (k, m), v in ms.items()},
                                      "load_before": load_before})


if __name__ == "__main__":
    main()
