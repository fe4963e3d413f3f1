"""Sampling a whole batch as tensor ops on the rows' device, with one copy to the host.

:func:`device_choices` gives what :func:`.sampling.process_rows` gives for sampled-token rows
(greedy, temperature / top-k / top-p / min-p, masks, repetition penalties, seeds, top
log-probabilities), but every row's token is chosen on the device and the tokens, their
log-probabilities and the top-k lists come back in **one** device-to-host copy, instead of one
``.item()`` / ``.tolist()`` per row or per stage.

Draws. ``torch.multinomial(p, 1)`` is ``argmax(p / q)`` with ``q ~ Exp(1)`` drawn from the
generator over the row's vocabulary (ATen's one-sample path). The same is done here for every
drawing row at once, with ``q`` per row:

* a seeded row draws ``q`` on the host from a CPU generator seeded with ``seed + position`` — the
  very numbers the CPU path's ``multinomial`` draws — so at fp32 a seeded stream gives the same
  tokens on either device (up to ties in ``p / q``), and on the CPU exactly the same tokens;
* an unseeded row draws ``q`` on the device (the device's generator, as the CPU path's
  unseeded ``multinomial`` uses its own).
"""

from __future__ import annotations

import torch

from .logits_filters import filtered_probs, shaped_logits
from .types import LogitsPolicy


def seeded_noise(seed: int, position: int, vocab: int) -> torch.Tensor:
    """The ``Exp(1)`` draws ``torch.multinomial`` makes for a row seeded ``seed`` at ``position``
    (CPU generator, fp32, ``[vocab]``)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed((seed + position) % (1 << 63))
    return torch.empty(vocab, dtype=torch.float32).exponential_(1, generator=gen)


def choose_tokens(rows: torch.Tensor, policies: list[LogitsPolicy], histories: list[list[int]],
                  positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's token as a device tensor ``[B]`` (no host synchronisation), and the raw
    log-probabilities ``[B, V]``."""
    b, v = rows.shape
    dev = rows.device
    logprobs = torch.log_softmax(rows.float(), dim=-1)
    x = shaped_logits(rows, policies, histories)
    tokens = x.argmax(dim=-1)  # greedy rows keep this
    hot = [i for i, p in enumerate(policies) if p.sampling.temperature != 0.0]
    if not hot:
        return tokens, logprobs
    xs, probs = filtered_probs(x[hot], [policies[i] for i in hot])
    bad = (~torch.isfinite(probs).all(dim=-1)) | (probs.sum(dim=-1) <= 0)
    noise = torch.empty_like(probs).exponential_(1)
    seeded = [j for j, i in enumerate(hot) if policies[i].sampling.seed is not None]
    if seeded:
        host = torch.stack([seeded_noise(policies[hot[j]].sampling.seed, positions[hot[j]], v) for j in seeded])
        noise[seeded] = host.to(dev, non_blocking=True)
    drawn = torch.where(bad, xs.argmax(dim=-1), (probs / noise).argmax(dim=-1))
    tokens[hot] = drawn
    return tokens, logprobs


def device_choices(rows: torch.Tensor, policies: list[LogitsPolicy], histories: list[list[int]] | None = None,
                   positions: list[int] | None = None) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """Per row of ``rows`` (``[B, V]``, sampled-token policies): (token, its log-probability, top
    log-probabilities as the policy asks), through one device-to-host copy."""
    b = rows.shape[0]
    histories = histories or [[] for _ in range(b)]
    positions = positions or [0] * b
    tokens, logprobs = choose_tokens(rows, policies, histories, positions)
    chosen = logprobs.gather(1, tokens[:, None])
    k = min(max(p.top_logprobs for p in policies), logprobs.shape[-1])
    parts = [tokens[:, None].double(), chosen.double()]
    if k:
        top = torch.topk(logprobs, k)
        parts += [top.indices.double(), top.values.double()]
    host = torch.cat(parts, dim=1).cpu().tolist()  # the step's one device-to-host copy
    out = []
    for p, r in zip(policies, host):
        kk = min(p.top_logprobs, k)
        out.append((int(r[0]), r[1], [(int(i), float(v)) for i, v in zip(r[2:2 + kk], r[2 + k:2 + k + kk])]))
    return out


__all__ = ["choose_tokens", "device_choices", "seeded_noise"]
