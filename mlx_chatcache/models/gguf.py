"""Load a llama-family GGUF file into mlx-lm's llama model, keeping it quantized.

Contract: ``load_gguf(path) -> (model, tokenizer, fingerprint)`` where

- ``model`` is an ``mlx_lm.models.llama.Model`` in eval mode. Tensors stored as
  Q4_0, Q4_1 or Q8_0 stay quantized (``nn.QuantizedLinear`` /
  ``nn.QuantizedEmbedding``, affine, group size 32, 4 or 8 bits, as MLX's GGUF
  reader returns them); F32/F16/BF16 tensors stay float. GGUF stores q/k
  weights in GGML's rotary layout (rotated pairs are adjacent), so the model
  uses ``rope_traditional=True``.
- ``tokenizer`` is an ``mlx_lm.tokenizer_utils.TokenizerWrapper`` around a
  ``transformers.PreTrainedTokenizerFast`` built from the GGUF metadata alone
  (``tokenizer.ggml.*``): a byte-level BPE whose pre-tokenizer follows
  ``tokenizer.ggml.pre``, with control tokens registered as special tokens so
  ``<|im_start|>`` is one token, the file's chat template, and mlx-lm's
  ``BPEStreamingDetokenizer`` (what mlx-lm picks for a ByteLevel decoder).
- ``fingerprint`` is a :class:`ModelFingerprint`: weights hash over a sample of
  the file plus the model arguments, tokenizer hash over the vocabulary, merges,
  token types, special ids and chat template.

Anything else (another architecture, K-quants or other tensor types, a
non-BPE tokenizer, an unknown pre-tokenizer, RoPE scaling other than linear)
raises :class:`ModelLoadError` with a one-line message saying what is supported.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..errors import ModelLoadError
from .fingerprint import ModelFingerprint, canonical_json, hash_files

SUPPORTED = (
    "supported: llama-architecture GGUF with F32/F16/BF16/Q4_0/Q4_1/Q8_0 tensors "
    "and a gpt2 (byte-level BPE) tokenizer"
)

GROUP_SIZE = 32  # every GGUF type MLX reads quantized (Q4_0, Q4_1, Q8_0) uses 32
QUANT_BITS = (4, 8)
FLOAT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
# general.file_type values (llama.cpp's LLAMA_FTYPE) whose main tensor type MLX
# reads natively. Such a file may still hold a few tensors of another type (e.g.
# a Q6_K output layer): mx.load then either returns them as float arrays (used
# as float layers) or fails (reported as ModelLoadError).
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 32: "BF16"}

CONTROL, USER_DEFINED = 3, 4  # GGUF token_type values that become added tokens

# Control tokens llama.cpp also treats as end of generation when it sees them.
EOG_TEXTS = frozenset(
    ["<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>"]
)

_TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_PER_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def load_gguf(path: str):
    """Load ``(model, tokenizer, fingerprint)`` from the GGUF file at ``path``."""
    weights, meta = read_gguf(path)
    args = model_args(meta, weights)
    spec = tokenizer_spec(meta)
    model = build_model(args, rename_weights(weights))
    return model, build_tokenizer(spec), gguf_fingerprint(path, args, spec)


def load_gguf_tokenizer(path: str):
    """Only the tokenizer of the GGUF file at ``path`` (for decoding previews)."""
    _, meta = read_gguf(path)
    return build_tokenizer(tokenizer_spec(meta))


# ---------------------------------------------------------------- reading


def read_gguf(path: str) -> tuple[dict, dict]:
    """``(tensors, metadata)`` of a GGUF file; unreadable files raise ModelLoadError."""
    try:
        weights, meta = mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError) as e:
        raise ModelLoadError(
            f"MLX cannot read GGUF '{path}' ({e}): the file is corrupt or uses a "
            f"tensor type MLX lacks (e.g. K-quants); {SUPPORTED}"
        ) from e
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"GGUF architecture '{arch}' is not supported; {SUPPORTED}")
    file_type = meta_value(meta, "general.file_type", None)
    if file_type is not None and file_type not in FILE_TYPES:
        raise ModelLoadError(f"GGUF file type {file_type} is not supported; {SUPPORTED}")
    for name, w in weights.items():
        packed = w.dtype == mx.uint32 and f"{name.rpartition('.')[0]}.scales" in weights
        if w.dtype not in FLOAT_DTYPES and not packed:
            raise ModelLoadError(f"GGUF tensor '{name}' has type {w.dtype}; {SUPPORTED}")
    return weights, meta


_REQUIRED = object()


def meta_value(meta: dict, key: str, default=_REQUIRED):
    """A metadata value as a Python object (scalars unwrapped, arrays as lists)."""
    if key not in meta:
        if default is _REQUIRED:
            raise ModelLoadError(f"GGUF metadata lacks '{key}'; {SUPPORTED}")
        return default
    value = meta[key]
    if isinstance(value, mx.array):
        return value.item() if value.ndim == 0 else value.tolist()
    return value


# ---------------------------------------------------------------- model


def model_args(meta: dict, weights: dict):
    """mlx-lm ``ModelArgs`` for the llama model described by ``llama.*`` metadata."""
    from mlx_lm.models.llama import ModelArgs

    def num(key, default=_REQUIRED):
        value = meta_value(meta, f"llama.{key}", default)
        if not isinstance(value, (int, float)):
            raise ModelLoadError(f"GGUF 'llama.{key}' must be one number; {SUPPORTED}")
        return value

    hidden, heads = int(num("embedding_length")), int(num("attention.head_count"))
    head_dim = int(num("attention.key_length", hidden // heads))
    if int(num("rope.dimension_count", head_dim)) != head_dim:
        raise ModelLoadError(f"partial rotary embeddings are not supported; {SUPPORTED}")
    return ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=int(num("block_count")),
        intermediate_size=int(num("feed_forward_length")),
        num_attention_heads=heads,
        num_key_value_heads=int(num("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(num("attention.layer_norm_rms_epsilon")),
        vocab_size=len(meta_value(meta, "tokenizer.ggml.tokens")),
        max_position_embeddings=int(num("context_length")),
        rope_theta=float(num("rope.freq_base", 10000.0)),
        rope_traditional=True,
        rope_scaling=rope_scaling(meta),
        attention_bias="blk.0.attn_q.bias" in weights,
        mlp_bias="blk.0.ffn_up.bias" in weights,
        tie_word_embeddings="output.weight" not in weights,
    )


def rope_scaling(meta: dict) -> dict | None:
    """mlx-lm's ``rope_scaling`` for the file: None or linear; others are refused."""
    kind = meta_value(meta, "llama.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"type": "linear", "factor": float(meta_value(meta, "llama.rope.scaling.factor"))}
    raise ModelLoadError(f"RoPE scaling '{kind}' is not supported; {SUPPORTED}")


def mlx_name(gguf_name: str) -> str | None:
    """mlx-lm parameter name of a GGUF tensor name, or None if it has none."""
    module, _, leaf = gguf_name.rpartition(".")
    parts = module.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _PER_LAYER:
        return f"model.layers.{parts[1]}.{_PER_LAYER[parts[2]]}.{leaf}"
    if module in _TOP_LEVEL:
        return f"{_TOP_LEVEL[module]}.{leaf}"
    return None


def rename_weights(weights: dict) -> dict:
    """GGUF tensors under mlx-lm names; a tensor without a place is refused."""
    renamed = {}
    for name, w in weights.items():
        new = mlx_name(name)
        if new is None:
            raise ModelLoadError(f"GGUF tensor '{name}' has no llama counterpart; {SUPPORTED}")
        renamed[new] = w
    return renamed


def quantization(weights: dict, float_shapes: dict) -> dict[str, dict]:
    """``{module path: {"bits", "group_size"}}`` for every quantized tensor.

    A quantized weight packs ``in_dims * bits / 32`` values per uint32 row and
    has ``in_dims / group_size`` scales per row; ``in_dims`` comes from the
    float model's weight shape.
    """
    params = {}
    for name, scales in weights.items():
        if not name.endswith(".scales"):
            continue
        module = name[: -len(".scales")]
        if f"{module}.weight" not in float_shapes:
            raise ModelLoadError(f"GGUF tensor '{module}' does not fit the model; {SUPPORTED}")
        packed = weights[f"{module}.weight"].shape[-1]
        in_dims = float_shapes[f"{module}.weight"][-1]
        bits, group_size = packed * 32 // in_dims, in_dims // scales.shape[-1]
        if bits not in QUANT_BITS or group_size != GROUP_SIZE or packed * 32 != bits * in_dims:
            raise ModelLoadError(
                f"tensor '{module}' is {bits}-bit with groups of {group_size}; {SUPPORTED}"
            )
        params[module] = {"bits": bits, "group_size": group_size}
    return params


def build_model(args, weights: dict):
    """A llama ``Model`` with ``weights`` loaded, quantized where the file is."""
    from mlx_lm.models.llama import Model

    model = Model(args)
    float_shapes = {k: v.shape for k, v in tree_flatten(model.parameters())}
    quant = quantization(weights, float_shapes)
    nn.quantize(model, class_predicate=lambda path, _module: quant.get(path, False))
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ModelLoadError(f"GGUF tensors do not fit a llama model ({e}); {SUPPORTED}") from e
    mx.eval(model.parameters())
    model.eval()
    return model


# ---------------------------------------------------------------- tokenizer


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
    """What the GGUF says about its tokenizer (``tokenizer.ggml.*`` and template)."""

    tokens: list[str]
    merges: list[str]
    token_types: list[int]
    pre: str
    bos_id: int | None
    eos_ids: list[int]  # end-of-sequence first, then end-of-turn/message ids
    pad_id: int | None
    add_bos: bool
    chat_template: str | None

    def as_json(self) -> bytes:
        # the fields by name, not dataclasses.asdict: it deep-copies each of the ~150k list items first
        return canonical_json({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})


def tokenizer_spec(meta: dict) -> TokenizerSpec:
    """Read the tokenizer description; only gpt2-style BPE is accepted."""
    kind = meta_value(meta, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(f"GGUF tokenizer model '{kind}' is not supported; {SUPPORTED}")
    tokens = meta_value(meta, "tokenizer.ggml.tokens")
    eos_keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    eos_ids = [meta_value(meta, f"tokenizer.ggml.{k}", None) for k in eos_keys]
    return TokenizerSpec(
        tokens=tokens,
        merges=meta_value(meta, "tokenizer.ggml.merges"),
        token_types=meta_value(meta, "tokenizer.ggml.token_type", [1] * len(tokens)),
        pre=meta_value(meta, "tokenizer.ggml.pre", "default"),
        bos_id=meta_value(meta, "tokenizer.ggml.bos_token_id", None),
        eos_ids=list(dict.fromkeys(i for i in eos_ids if i is not None)),
        pad_id=meta_value(meta, "tokenizer.ggml.padding_token_id", None),
        add_bos=bool(meta_value(meta, "tokenizer.ggml.add_bos_token", False)),
        chat_template=meta_value(meta, "tokenizer.chat_template", None),
    )


# Llama 3's split (llama.cpp's "llama-bpe"): case-insensitive contractions,
# words with at most one leading non-letter, digits in runs of up to three,
# punctuation runs with trailing newlines, then whitespace runs.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def pre_tokenizer(pre: str):
    """The ``tokenizers`` pre-tokenizer matching llama.cpp's pre-tokenizer ``pre``."""
    from tokenizers import Regex, pre_tokenizers

    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("gpt2", "gpt-2"):
        return gpt2
    if pre in ("smollm", "starcoder", "refact"):  # each digit alone, then GPT-2
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    if pre in ("llama-bpe", "llama3"):
        split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        return pre_tokenizers.Sequence([split, byte_level])
    raise ModelLoadError(
        f"GGUF pre-tokenizer '{pre}' is not supported (supported: gpt2, smollm, "
        "starcoder, refact, llama-bpe)"
    )


def backend_tokenizer(spec: TokenizerSpec):
    """A ``tokenizers.Tokenizer`` equivalent to llama.cpp's for this vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    vocab = {}
    for i, tok in enumerate(spec.tokens):
        vocab.setdefault(tok, i)
    merges = [tuple(m.split(" ", 1)) for m in spec.merges]
    bpe = models.BPE(
        vocab, merges, fuse_unk=False, byte_fallback=False,
        ignore_merges=spec.pre in ("llama-bpe", "llama3"),
    )
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizer(spec.pre)
    tok.decoder = decoders.ByteLevel()
    added = [
        AddedToken(text, special=kind == CONTROL, normalized=False)
        for text, kind in zip(spec.tokens, spec.token_types)
        if kind in (CONTROL, USER_DEFINED)
    ]
    tok.add_tokens(added)
    if spec.add_bos and spec.bos_id is not None:
        bos = spec.tokens[spec.bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, spec.bos_id)]
        )
    return tok


def build_tokenizer(spec: TokenizerSpec):
    """mlx-lm ``TokenizerWrapper`` over a fast HF tokenizer built from ``spec``."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
    from transformers import PreTrainedTokenizerFast

    def text(i):
        return spec.tokens[i] if i is not None else None

    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend_tokenizer(spec),
        bos_token=text(spec.bos_id),
        eos_token=text(spec.eos_ids[0]) if spec.eos_ids else None,
        pad_token=text(spec.pad_id),
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = spec.chat_template
    eog = {i for i, (t, k) in enumerate(zip(spec.tokens, spec.token_types))
           if k == CONTROL and t in EOG_TEXTS}
    return TokenizerWrapper(
        hf, BPEStreamingDetokenizer, eos_token_ids=sorted(eog.union(spec.eos_ids))
    )


# ---------------------------------------------------------------- fingerprint


def gguf_fingerprint(path: str, args, spec: TokenizerSpec) -> ModelFingerprint:
    """Weights: file sample + model args. Tokenizer: the whole tokenizer spec."""
    return ModelFingerprint(
        model_id=str(path),
        weights_hash=hash_files([Path(path)], extra=canonical_json(dataclasses.asdict(args))),
        tokenizer_hash=hash_files([], extra=spec.as_json()),  # no files: hash of the spec
    )
