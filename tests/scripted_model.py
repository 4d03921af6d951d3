"""A tiny model that says a fixed script, its weights set by construction (no training).

``build_scripted_model(folder, first, then, marker, tool_format="json_tools") -> Path``
writes a tiny llama (tests/tiny_models.py's tokenizer, config and chat template with
that tool format) whose greedy reply to any chat prompt is the text ``first`` while the
prompt does not hold the special token ``marker``, and ``then`` once it does; each reply
ends with ``<|im_end|>``. Example: ``first`` a tool call, ``then`` the answer, ``marker``
the call's closing marker, which the next turn's prompt holds.

How: each stretch of a reply between special tokens becomes one new vocabulary entry
(its byte-level spelling, with no merge that makes it, so encoding never yields it), so
a reply is a chain of tokens each of which names its successor. The one layer's attention
sees whether ``marker`` is in the context (one head attends to it on the slowest rotary
pair: score > 25 at any distance, 0 elsewhere), the MLP is zero, and the output layer
reads the current token and that flag. Greedy margins are 16 logits or more, so the
replies do not depend on the CPU or BLAS.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from tiny_models import HEAD_DIM, IM_END, IM_START, build_tiny_model, model_config, parameter_templates

SCALE = 10.0  # logit per unit of a normalized feature


def _add_pieces(folder: Path, pieces: list[str]) -> dict[str, int]:
    """Add ``pieces`` (texts) to the folder's tokenizer as byte-level vocabulary entries
    (the ids after the trained ones; the added tokens move up); their ids."""
    from tokenizers import Tokenizer

    path = folder / "tokenizer.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    tokenizer = Tokenizer.from_str(path.read_text(encoding="utf-8"))
    vocab, ids = data["model"]["vocab"], {}
    first = len(vocab)
    for piece in pieces:
        spelled = "".join(tokenizer.encode(piece, add_special_tokens=False).tokens)
        if spelled in vocab:
            raise ValueError(f"{piece!r} is one token already: a script needs pieces of two tokens or more")
        vocab[spelled] = ids[piece] = len(vocab)
    for added in data["added_tokens"]:
        if added["id"] >= first:
            added["id"] += len(pieces)
    path.write_text(json.dumps(data, ensure_ascii=False, indent=2), encoding="utf-8")
    return ids


def build_scripted_model(folder: Path, first: str, then: str, marker: str, tool_format: str = "json_tools") -> Path:
    """Write the scripted model into ``folder`` (see the module docstring) and return it."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer

    folder = build_tiny_model("llama", Path(folder), tool_format=tool_format)
    tokenizer = Tokenizer.from_str((folder / "tokenizer.json").read_text(encoding="utf-8"))
    specials = [t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special]
    split = re.compile("(" + "|".join(map(re.escape, specials)) + ")")
    texts = [[p for p in split.split(reply) if p] for reply in (first, then)]
    vocab = _add_pieces(folder, [p for reply in texts for p in reply if p not in specials])
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    vocab.update({t: tokenizer.token_to_id(t) for t in specials})
    start = tokenizer.encode(IM_START + "assistant\n", add_special_tokens=False).ids[-1]
    chains = [[vocab[p] for p in reply] + [vocab[IM_END]] for reply in texts]
    links = {t: u for chain in chains for t, u in zip(chain, chain[1:])}
    if len(links) != sum(len(c) - 1 for c in chains) or start in links or chains[0][0] == chains[1][0]:
        raise ValueError("each token of the two replies must occur once, and they must start differently")

    config = {**model_config("llama"), "num_hidden_layers": 1, "tie_word_embeddings": False,
              "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True)}  # fmt: skip
    weights = {n: np.zeros_like(t) if t.ndim > 1 else t for n, t in parameter_templates(config).items()}
    hidden = config["hidden_size"]
    marked = [start, vocab[marker], *links]  # tokens with a dimension of their own
    dim = {t: 1 + i for i, t in enumerate(dict.fromkeys(marked))}  # dimension 0: every token's 1
    seen = hidden - 1  # the flag: the marker is in the context
    if len(dim) + 2 > hidden:
        raise ValueError("the script has more tokens than the model has dimensions")
    embed = weights["model.embed_tokens.weight"]
    embed[:, 0] = 1.0
    for t, d in dim.items():
        embed[t, d] = 1.0
    attn = "model.layers.0.self_attn."
    slowest = HEAD_DIM // 2 - 1  # the rotary pair that turns least per position (head 0)
    weights[attn + "q_proj.weight"][slowest, 0] = 2.0  # every query; normalized inputs are >= 8
    weights[attn + "k_proj.weight"][slowest, dim[vocab[marker]]] = 2.0  # keys of the marker only
    weights[attn + "v_proj.weight"][0, dim[vocab[marker]]] = 1 / 8  # its value: 1
    weights[attn + "o_proj.weight"][seen, 0] = 1.0
    head = weights["lm_head.weight"]
    for t, u in links.items():
        head[u, dim[t]] += SCALE
    head[chains[0][0], dim[start]] += SCALE  # no marker: the first reply
    head[chains[0][0], seen] -= 2 * SCALE
    head[chains[1][0], dim[start]] += SCALE / 2  # marker: the second (3/4 loses to any link)
    head[chains[1][0], seen] += SCALE * 3 / 4
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    save_file({n: w.astype(np.float32) for n, w in weights.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    return folder
