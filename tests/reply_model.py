"""A tiny random-weight llama whose every reply is one short text, then ``<|im_end|>``: for clients
(coding agents) that treat a reply cut at ``max_tokens`` as a failure.

``build_reply_model(folder, reply, tool_format="json_tools")`` writes the tiny llama of
:func:`tiny_models.build_tiny_model` (tool-call template in ``tool_format``), then changes
two things: every attention output projection is zero (so the next token depends on the
current token alone: attention and its K/V are still computed, cached and served, they
just do not move the output), and the output layer is untied from the embeddings with
one row per step of the reply raised along the hidden state of the token before it. So
greedy decoding after the generation prompt (``...<|im_start|>assistant\\n``) writes
``reply`` and ends, whatever came before; every other weight stays random. The reply's
tokens must be distinct (a pure bigram chain); ValueError otherwise.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tiny_models import IM_END, IM_START, build_tiny_model

LIFT = 60.0  # logit added to each scripted next token (random logits have a spread of about 2)


def build_reply_model(folder: Path, reply: str, tool_format: str = "json_tools") -> Path:
    import mlx.core as mx
    from mlx_lm.utils import load_model
    from safetensors.numpy import load_file, save_file
    from tokenizers import Tokenizer

    folder = build_tiny_model("llama", Path(folder), tool_format=tool_format)
    config = json.loads((folder / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    weights = load_file(str(folder / "model.safetensors"))
    for name in weights:
        if name.endswith("self_attn.o_proj.weight"):
            weights[name] = np.zeros_like(weights[name])
    rng = np.random.default_rng(1)
    embed = weights["model.embed_tokens.weight"]
    weights["lm_head.weight"] = embed + rng.normal(0, embed.std(), size=embed.shape).astype(np.float32)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    head = f"{IM_START}user\nhi{IM_END}\n{IM_START}assistant\n"
    ids = tok.encode(head + reply + IM_END).ids
    prompt = tok.encode(head).ids
    chain = ids[len(prompt) - 1 :]  # the prompt's last token, the reply's, the end
    if ids[: len(prompt)] != prompt or len(set(chain[:-1])) != len(chain) - 1:
        raise ValueError(f"the reply {reply!r} does not tokenize as a chain of distinct tokens")
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    model, _ = load_model(folder)
    hidden = np.array(model.model(mx.array([chain[:-1]])).astype(mx.float32))[0]  # per token: no attention mixes them
    for h, nxt in zip(hidden, chain[1:]):
        weights["lm_head.weight"][nxt] += LIFT * h / float(h @ h)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


__all__ = ["build_reply_model"]
