"""Model fixtures for the executor tests (imported by the test modules; ``conftest.py`` is not ours).

Tiny random-weight checkpoints are built once per session in a temporary directory; the real
packaged models (SmolLM2 GGUF, all-MiniLM-L6-v2) are loaded once per module that asks for them.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

from ferrum_service.testing.tiny_models import build_tiny_bert, build_tiny_llama  # noqa: E402


class ForwardCounter:
    """Counts calls of a module's forward (a real forward hook, no mocking)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.calls = 0
        self._h = module.register_forward_hook(self._hook)

    def _hook(self, *_: object) -> None:
        self.calls += 1

    def __enter__(self) -> "ForwardCounter":
        return self

    def __exit__(self, *_: object) -> None:
        self._h.remove()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=0)


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory):
    return build_tiny_bert(tmp_path_factory.mktemp("tiny-bert"), seed=0, pooling="cls", normalize=False)


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_dir):
    """A shared tiny-Llama executor on CPU (tests release the caches they create)."""
    from ferrum_service.executors.transformers import HfCausalLmExecutor

    return HfCausalLmExecutor.from_path(tiny_llama_dir, model_id="tiny", device="cpu", kv_budget_tokens=16384)


@pytest.fixture(scope="module")
def smollm2():
    from ferrum_service.executors.transformers import HfCausalLmExecutor
    from .support.packaged import smollm2_gguf

    d, f = smollm2_gguf()
    return HfCausalLmExecutor.from_path(d, gguf_file=f, model_id="smollm2", device="cpu", kv_budget_tokens=8192)


@pytest.fixture(scope="module")
def minilm_path():
    from ferrum_service.hosting.packaged_models import PackagedModelMissing, minilm_dir

    try:
        return minilm_dir()
    except PackagedModelMissing as e:
        pytest.skip(str(e))
