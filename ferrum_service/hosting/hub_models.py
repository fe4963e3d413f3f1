"""Models named by a Hugging Face Hub id: ``--model org/name[@revision][,key=value...]``.

The id resolves to a snapshot folder through ``huggingface_hub``'s cache (``HF_HOME`` /
``HF_HUB_CACHE``): a snapshot already there is used as it is; otherwise it is downloaded, unless
the hub is offline (``HF_HUB_OFFLINE=1``), in which case the spec is refused naming the id and
the cache. A private or gated repository takes the token of ``--hub-token-file`` (else
huggingface_hub's own: ``HF_TOKEN`` or a stored login). ``@revision`` is a branch, tag or commit.

The executor follows from the snapshot's files: a ``config.json`` whose architectures end in
``ForCausalLM`` is served by ``hf-causal-lm``, a BERT-family encoder by ``bert``; a repository of
GGUF files by ``llama-cpp`` (``gguf_file=`` picks one when there are several). The model id is the
hub id (without the revision) unless ``id=`` names another.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

#: ``org/name`` with an optional ``@revision``.
HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+))?")
#: Options of a hub spec that are not the chosen executor's.
HUB_OPTIONS = ("repo", "revision", "gguf_file")


def is_hub_id(text: str) -> bool:
    """Whether a spec's first word is a hub id (``org/name[@revision]``), not an executor or preset."""
    return HUB_ID.fullmatch(text) is not None


def hub_options(text: str) -> dict[str, str]:
    """``{repo, revision}`` of a hub id (revision omitted when not given)."""
    m = HUB_ID.fullmatch(text)
    if m is None:
        raise ValueError(f"{text!r} is not a hub id (org/name[@revision])")
    return {"repo": m["repo"], **({"revision": m["revision"]} if m["revision"] else {})}


def snapshot(repo: str, revision: str | None, token: str | None) -> Path:
    """The local snapshot folder of ``repo`` at ``revision`` (cached, or downloaded when online)."""
    from huggingface_hub import constants, snapshot_download

    where = f"{repo}@{revision}" if revision else repo
    try:
        return Path(snapshot_download(repo, revision=revision, token=token))
    except Exception as e:  # noqa: BLE001 - huggingface_hub's errors differ by version; the message names it
        if constants.HF_HUB_OFFLINE:
            raise ValueError(f"hub model {where}: not in the Hugging Face cache {constants.HF_HUB_CACHE} and the hub "
                             f"is offline (HF_HUB_OFFLINE=1)") from None
        raise ValueError(f"hub model {where}: cannot be fetched ({type(e).__name__}: {e})") from None


def executor_for(folder: Path, gguf_file: str | None = None) -> tuple[str, dict[str, Any]]:
    """(executor kind, options) that serve a snapshot folder (see the module doc)."""
    config = folder / "config.json"
    if config.is_file():
        try:
            archs = json.loads(config.read_text()).get("architectures") or []
        except ValueError as e:
            raise ValueError(f"{config}: not JSON ({e})") from None
        if any(str(a).endswith("ForCausalLM") for a in archs):
            return "hf-causal-lm", {"path": str(folder), **({"gguf_file": gguf_file} if gguf_file else {})}
        if any(str(a).startswith(("Bert", "Roberta", "XLMRoberta")) for a in archs):
            return "bert", {"path": str(folder)}
        if not gguf_file:
            raise ValueError(f"{folder}: architectures {archs} are neither a causal LM nor a BERT-family encoder")
    ggufs = sorted(p.name for p in folder.glob("*.gguf"))
    if gguf_file:
        if gguf_file not in ggufs:
            raise ValueError(f"gguf_file={gguf_file!r} is not in the snapshot (GGUF files: {', '.join(ggufs) or 'none'})")
        return "llama-cpp", {"path": str(folder / gguf_file)}
    if len(ggufs) == 1:
        return "llama-cpp", {"path": str(folder / ggufs[0])}
    if ggufs:
        raise ValueError(f"several GGUF files ({', '.join(ggufs)}): name one with gguf_file=")
    raise ValueError(f"{folder}: no config.json and no GGUF file to serve")


__all__ = ["HUB_ID", "HUB_OPTIONS", "executor_for", "hub_options", "is_hub_id", "snapshot"]
