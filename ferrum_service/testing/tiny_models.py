"""Tiny random-weight checkpoints for tests: a Llama causal LM and a BERT encoder.

Both are written with ``save_pretrained`` (config, safetensors weights, tokenizer, and for BERT the
sentence-transformers pooling files), so the executors' ``from_path(out_dir)`` loads them exactly
as it loads a real checkpoint. Everything is built offline: the tokenizers are trained here with
the ``tokenizers`` library on a small built-in corpus. Deterministic for a given ``seed``.

CLI::

    python -m ferrum_service.testing.tiny_models OUT_DIR [--kind llama|bert] [--seed N]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

#: Special tokens of the tiny Llama tokenizer, in id order (ids 0..4).
LLAMA_SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]

#: A ChatML-style template; generation stops on ``<|im_end|>`` (and ``</s>``).
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A KV cache stores the keys and values of every past token, layer by layer.",
    "Prefill runs the prompt; decode feeds one token at a time and returns the next logits.",
    "Speculative decoding verifies several draft tokens in one forward pass.",
    "gRPC carries protobuf messages over HTTP/2 between the scheduler and the executor.",
    "Hello world! How are you today? I am fine, thank you very much.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 1000 3.14159 2026-12-03.",
    "Rust, Python, C++, Go and TypeScript clients all speak the same contract.",
    "The cat sits on the mat. Kittens are small cats. Dogs bark at the mailman.",
    "Attention masks keep padded positions out of the softmax.",
    "Block tables map a sequence's logical positions to physical blocks in a pool.",
    "def forward(self, input_ids, cache=None):\n    return self.model(input_ids)\n",
    "SELECT id, name FROM users WHERE active = 1 ORDER BY name;",
    "Les modèles de langue prédisent le prochain jeton. Ünïcödé wörks tøø: 日本語, 中文, emoji 🙂.",
]


def _corpus() -> list[str]:
    # Repetition with variations gives the BPE trainer enough pair statistics to fill the vocab.
    out = []
    for i in range(40):
        for line in _CORPUS:
            out.append(f"{line} ({i})")
            out.append(line.lower())
            out.append(line.upper())
    return out


def _train_bytelevel_bpe(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=LLAMA_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok


def build_tiny_llama(
    out_dir: str | Path,
    *,
    seed: int = 0,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 1024,
    initializer_range: float = 0.2,
    tie_word_embeddings: bool = False,
) -> Path:
    """Write a random-weight ``LlamaForCausalLM`` with its own tokenizer and chat template to ``out_dir``.

    The tokenizer is a ByteLevel BPE trained offline (its vocabulary fits inside ``vocab_size``);
    ids 0..4 are ``<pad> <s> </s> <|im_start|> <|im_end|>``; EOS ids are 2 and 4.
    ``initializer_range`` is larger than Llama's 0.02 so that the logits are not near-uniform and
    greedy decoding is decisive (no near ties that float noise could flip). Returns ``out_dir``.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=[2, 4], pad_token_id=0)
    model.save_pretrained(out)

    raw = _train_bytelevel_bpe(vocab_size)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token="<s>",
        eos_token="<|im_end|>",
        pad_token="<pad>",
        additional_special_tokens=["</s>", "<|im_start|>"],
        model_max_length=max_position_embeddings,
    )
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    return out


def build_tiny_bert(
    out_dir: str | Path,
    *,
    seed: int = 0,
    vocab_size: int = 256,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int = 64,
    max_position_embeddings: int = 128,
    pooling: str = "mean",
    normalize: bool = True,
) -> Path:
    """Write a random-weight ``BertModel`` + WordPiece tokenizer + sentence-transformers files.

    ``pooling`` (mean | cls | max) goes into ``1_Pooling/config.json``; ``normalize`` adds a
    Normalize module to ``modules.json``, as sentence-transformers checkpoints do. Returns ``out_dir``.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    if pooling not in ("mean", "cls", "max"):
        raise ValueError(f"pooling must be mean, cls or max, not {pooling!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=0,
    )
    BertModel(config).eval().save_pretrained(out)

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    raw = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    raw.normalizer = normalizers.BertNormalizer(lowercase=True)
    raw.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    raw.decoder = decoders.WordPiece()
    raw.train_from_iterator(
        _corpus(), trainer=trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False)
    )
    cls_id, sep_id = raw.token_to_id("[CLS]"), raw.token_to_id("[SEP]")
    raw.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)]
    )
    PreTrainedTokenizerFast(
        tokenizer_object=raw,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=max_position_embeddings,
    ).save_pretrained(out)

    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (out / "modules.json").write_text(json.dumps(modules, indent=2))
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(
        json.dumps(
            {
                "word_embedding_dimension": hidden_size,
                "pooling_mode_cls_token": pooling == "cls",
                "pooling_mode_mean_tokens": pooling == "mean",
                "pooling_mode_max_tokens": pooling == "max",
                "pooling_mode_mean_sqrt_len_tokens": False,
            },
            indent=2,
        )
    )
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_position_embeddings}))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ferrum_service.testing.tiny_models", description=__doc__.split("\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--kind", choices=["llama", "bert"], default="llama")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    build = build_tiny_llama if a.kind == "llama" else build_tiny_bert
    print(build(a.out_dir, seed=a.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
