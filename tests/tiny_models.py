"""Tiny random models written to disk as Hugging Face-style folders, for tests.

Contract
--------
``build_tiny_model(kind, folder, seed=0) -> Path`` writes into ``folder``:

- ``config.json``: an mlx-lm architecture (``model_type``) sized to run in
  milliseconds on CPU; ``eos_token_id`` is ``<|im_end|>``.
- ``model.safetensors``: float32 random weights in mlx-lm's parameter names and
  layouts (conv kernels as MLX ``(C, K, 1)``), drawn from
  ``numpy.random.default_rng(seed)``. Same ``(kind, seed)`` gives byte-identical
  files; another seed gives other weights (and so another ``model.fingerprint``).
  Scales are chosen so greedy continuations vary, depend on the whole prompt,
  never emit the special tokens (they run their full length), and logits have a
  spread of about ``LOGIT_STD``.
- ``tokenizer.json``: byte-level BPE (vocab ``VOCAB_SIZE``) trained on a small
  built-in English corpus, so any text encodes. ``<|endoftext|>``,
  ``<|im_start|>`` and ``<|im_end|>`` (ids 0, 1, 2) are special tokens, each
  encoded as a single id. The tokenizer does not depend on the seed.
- ``tokenizer_config.json``: a ChatML chat template
  (``<|im_start|>role\\n...<|im_end|>\\n``, any role including ``system``,
  ``add_generation_prompt`` appends ``<|im_start|>assistant\\n``); eos is
  ``<|im_end|>``, pad is ``<|endoftext|>``, no bos.

``build_tiny_model(kind, folder, seed, tool_format=FORMAT)`` (``TOOL_FORMATS``:
json_tools, mistral, qwen3_coder, pythonic, glm47, minimax_m2, function_gemma, gemma4,
kimi_k2, longcat, minicpm5, muse_spark, kimi_k3) writes a model whose chat template
renders ``tools``, assistant ``tool_calls`` in that mlx-lm tool-call format and
``tool`` results; ``tokenizer_config.json`` names the format (``tool_parser_type``)
and the template holds the marker mlx-lm infers it from. The format's markers are
special tokens appended after the trained vocabulary (``vocab_size`` grows by
their number); without ``tool_format`` the files are exactly as before.

Load the folder through the real path: ``mlx_chatcache.models.loading.load(str(folder))``.
Building takes ~30 ms. It instantiates the mlx-lm model once to learn parameter
names and shapes, which draws from the global ``mx.random`` stream (the weights
written do not depend on it).

Kinds (``KINDS``) and what their ``model.make_cache()`` returns:

- ``"llama"``: mlx-lm ``llama``, GQA, all layers ``KVCache``.
- ``"sliding"``: mlx-lm ``llama`` with ``layer_types``; sliding-window layers get
  ``RotatingKVCache(max_size=SLIDING_WINDOW)``, the full layer ``KVCache``.
- ``"hybrid"``: mlx-lm ``lfm2``; short-conv layers get ``ArraysCache``, the
  attention layer ``KVCache``.
- ``"ssm"``: mlx-lm ``mamba2``, pure state space; every layer ``ArraysCache``.

Extra kinds (``EXTRA_KINDS``: built on request, e.g. ``make_tiny_model_dir("mamba")``,
not part of the fixtures parametrised over ``KINDS``):

- ``"mamba"``: mlx-lm ``mamba`` (Mamba-1), every layer ``ArraysCache``. Unlike
  mamba2 the model stores its state only in a cache that is an mlx-lm
  ``ArraysCache`` and never calls ``advance`` (issue 10).
"""

from __future__ import annotations

import functools
import importlib
import json
import math
from pathlib import Path

import numpy as np

KINDS = ("llama", "sliding", "hybrid", "ssm")
EXTRA_KINDS = ("mamba",)

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # ids 0, 1, 2 in this order
VOCAB_SIZE = 384
SLIDING_WINDOW = 16
HIDDEN = 128
HEAD_DIM = 64  # fits 32- and 64-wide quantization groups (mlx-lm's KV default is 64)

# Weight scales, tuned so greedy continuations vary and depend on far context
# (changing a prompt's first word, ~40 tokens back, changes the continuation):
# - embeddings are small next to the residual branches, else the current token
#   dominates and the tied output layer predicts that same token forever;
# - matrices a little above unit gain, else the branches are too smooth;
# - lfm2 normalises q and k per head, which flattens its attention; scaling the
#   norms sharpens it so the single attention layer reaches far tokens.
EMBED_STD = 0.02
MATRIX_GAIN = 1.5
QK_NORM_SCALE = 2.0
SPECIAL_EMBED_SCALE = 0.1
# The final norm's scale sets the logits' spread (std ~LOGIT_STD) without
# changing their order, so sampling is not near-uniform.
LOGIT_STD = 2.0
FINAL_NORM_SCALE = LOGIT_STD / (EMBED_STD * math.sqrt(HIDDEN))
FINAL_NORMS = ("model.norm.weight", "model.embedding_norm.weight", "backbone.norm_f.weight")

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_TOOL_HEAD = (
    "{%- if tools %}{{- '<|im_start|>system\\nTools:' }}"
    "{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
)
_TOOL_TAIL = (
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_ARGS = "{%- set args = tc.function.arguments %}"
_ARGS_JSON = "{{- args if args is string else (args | tojson) }}"
_TOOL_CALLS = {
    "json_tools": "{%- for tc in message.tool_calls %}{%- set tool_call = tc.function %}" + _ARGS
    + "{{- '<tool_call>{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}" + _ARGS_JSON
    + "{{- '}</tool_call>' }}{%- endfor %}",
    "mistral": "{{- '[TOOL_CALLS][' }}{%- for tc in message.tool_calls %}" + _ARGS
    + "{{- '{\"name\": \"' + tc.function.name + '\", \"arguments\": ' }}" + _ARGS_JSON
    + "{{- '}' + (', ' if not loop.last else '') }}{%- endfor %}{{- ']' }}",
    "qwen3_coder": "{%- for tc in message.tool_calls %}" + _ARGS
    + "{{- '<tool_call>\\n<function=' + tc.function.name + '>\\n' }}"
    "{%- for k, v in args.items() %}{{- '<parameter=' + k + '>\\n' + (v if v is string else (v | tojson))"
    " + '\\n</parameter>\\n' }}{%- endfor %}{{- '</function>\\n</tool_call>' }}{%- endfor %}",
    "pythonic": "{{- '<|tool_call_start|>[' }}{%- for tc in message.tool_calls %}" + _ARGS
    + "{{- tc.function.name + '(' }}{%- for k, v in args.items() %}{{- k + '=' + (v | tojson)"
    " + (', ' if not loop.last else '') }}{%- endfor %}{{- ')' + (', ' if not loop.last else '') }}{%- endfor %}"
    "{{- ']<|tool_call_end|>' }}",
    "glm47": "{%- for tc in message.tool_calls %}" + _ARGS + "{{- '<tool_call>' + tc.function.name }}"
    "{%- for k, v in args.items() %}{{- '<arg_key>' + k + '</arg_key><arg_value>' + (v if v is string else"
    " (v | tojson)) + '</arg_value>' }}{%- endfor %}{{- '</tool_call>' }}{%- endfor %}",
    "minimax_m2": "{{- '<minimax:tool_call>' }}{%- for tc in message.tool_calls %}" + _ARGS
    + "{{- '<invoke name=\"' + tc.function.name + '\">' }}{%- for k, v in args.items() %}{{- '<parameter name=\"'"
    " + k + '\">' + (v if v is string else (v | tojson)) + '</parameter>' }}{%- endfor %}{{- '</invoke>' }}"
    "{%- endfor %}{{- '</minimax:tool_call>' }}",
    "function_gemma": "{%- for tc in message.tool_calls %}" + _ARGS
    + "{{- '<start_function_call>call:' + tc.function.name + '{' }}{%- for k, v in args.items() %}{{- k + ':' + ("
    "'<escape>' + v + '<escape>' if v is string else (v | tojson)) + (',' if not loop.last else '') }}{%- endfor %}"
    "{{- '}<end_function_call>' }}{%- endfor %}",
    "gemma4": "{%- for tc in message.tool_calls %}" + _ARGS
    + "{{- '<|tool_call>call:' + tc.function.name + '{' }}{%- for k, v in args.items() %}{{- k + ':' + ("
    "'<|\"|>' + v + '<|\"|>' if v is string else (v | tojson)) + (',' if not loop.last else '') }}{%- endfor %}"
    "{{- '}<tool_call|>' }}{%- endfor %}",
    "kimi_k2": "{{- '<|tool_calls_section_begin|>' }}{%- for tc in message.tool_calls %}" + _ARGS
    + "{{- '<|tool_call_begin|>functions.' + tc.function.name + ':' + (loop.index0 | string)"
    " + '<|tool_call_argument_begin|>' }}" + _ARGS_JSON + "{{- '<|tool_call_end|>' }}{%- endfor %}"
    "{{- '<|tool_calls_section_end|>' }}",
    "longcat": "{%- for tc in message.tool_calls %}" + _ARGS + "{{- '<longcat_tool_call>' + tc.function.name }}"
    "{%- for k, v in args.items() %}{{- '<longcat_arg_key>' + k + '</longcat_arg_key><longcat_arg_value>' + (v if v"
    " is string else (v | tojson)) + '</longcat_arg_value>' }}{%- endfor %}{{- '</longcat_tool_call>' }}{%- endfor %}",
    "minicpm5": "{%- for tc in message.tool_calls %}" + _ARGS + "{{- '<function name=\"' + tc.function.name + '\">' }}"
    "{%- for k, v in args.items() %}{{- '<param name=\"' + k + '\">' + (v if v is string else (v | tojson))"
    " + '</param>' }}{%- endfor %}{{- '</function>' }}{%- endfor %}",
    "muse_spark": "{{- '<atem:function_calls>' }}{%- for tc in message.tool_calls %}" + _ARGS
    + "{{- '<atem:invoke name=\"' + tc.function.name + '\">' }}{%- for k, v in args.items() %}"
    "{{- '<atem:parameter name=\"' + k + '\">' + (v | tojson) + '</atem:parameter>' }}{%- endfor %}"
    "{{- '</atem:invoke>' }}{%- endfor %}{{- '</atem:function_calls>' }}",
    "kimi_k3": "{{- '<|open|>tools<|sep|>' }}{%- for tc in message.tool_calls %}" + _ARGS
    + "{{- '<|open|>call tool=\"' + tc.function.name + '\"<|sep|><|open|>json type=\"object\"<|sep|>' }}"
    + _ARGS_JSON + "{{- '<|close|>json<|sep|><|close|>call<|sep|>' }}{%- endfor %}{{- '<|close|>tools<|sep|>' }}",
}
# each format's markers, added as special tokens
TOOL_FORMATS = {
    "json_tools": ("<tool_call>", "</tool_call>"),
    "mistral": ("[TOOL_CALLS]",),
    "qwen3_coder": ("<tool_call>", "</tool_call>"),
    "pythonic": ("<|tool_call_start|>", "<|tool_call_end|>"),
    "glm47": ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
    "minimax_m2": ("<minimax:tool_call>", "</minimax:tool_call>"),
    "function_gemma": ("<start_function_call>", "<end_function_call>", "<escape>"),
    "gemma4": ("<|tool_call>", "<tool_call|>", '<|"|>'),
    "kimi_k2": ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                "<|tool_call_end|>", "<|tool_call_argument_begin|>"),
    "longcat": ("<longcat_tool_call>", "</longcat_tool_call>", "<longcat_arg_key>", "</longcat_arg_key>",
                "<longcat_arg_value>", "</longcat_arg_value>"),
    "minicpm5": (),  # its markers are plain text, as in its own tokenizer
    "muse_spark": ("<atem:function_calls>", "</atem:function_calls>"),
    "kimi_k3": ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"),  # its XTML vocabulary
}


def tool_chat_template(tool_format: str) -> str:
    """The ChatML template of a tiny model with tool calls in ``tool_format``."""
    return _TOOL_HEAD + _TOOL_CALLS[tool_format] + _TOOL_TAIL


_CORPUS = """\
Good morning! How are you today? I am well, thank you for asking.
Can you help me write a short note to my neighbour about the garden fence?
Of course. Here is a friendly draft you could send this afternoon.
The weather was cold and windy, so we stayed inside and read our books.
Please summarise the following paragraph in two or three sentences.
A cache stores the results of earlier work so that it does not need to be done again.
When the same question comes back, the answer is ready at once.
She baked bread in the evening and shared it with the people next door.
What is the capital of Italy? The capital of Italy is Rome.
Numbers such as 1, 2, 3, 10, 42 and 2024 appear in many questions.
Write a list: apples, oranges, pears, plums and a few ripe bananas.
The train leaves the station at seven o'clock and arrives before noon.
Thank you very much; that was exactly what I needed. Have a nice day!
Explain why the sky looks blue during the day and red at sunset.
Light from the sun is scattered by the air, and blue light scatters the most.
The model reads the conversation, then writes the next message one word at a time.
Keep your answers short, clear and kind. Ask a question if something is unclear.
"""


def build_tiny_model(kind: str, folder: Path, seed: int = 0, tool_format: str | None = None) -> Path:
    """Write a complete tiny model of ``kind`` into ``folder`` and return it."""
    if kind not in KINDS + EXTRA_KINDS:
        raise ValueError(f"unknown tiny model kind {kind!r}; choose from {KINDS + EXTRA_KINDS}")
    if tool_format is not None and tool_format not in TOOL_FORMATS:
        raise ValueError(f"unknown tool format {tool_format!r}; choose from {tuple(TOOL_FORMATS)}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = model_config(kind)
    tokenizer_config = _tokenizer_config()
    tokenizer_text = _tokenizer_json()
    if tool_format is not None:
        markers = TOOL_FORMATS[tool_format]
        config["vocab_size"] = VOCAB_SIZE + len(markers)
        tokenizer_text = _tokenizer_json_with(markers)
        tokenizer_config.update(chat_template=tool_chat_template(tool_format), tool_parser_type=tool_format,
                                additional_special_tokens=[IM_START, *markers])  # fmt: skip
    _write_json(folder / "config.json", config)
    _write_weights(folder / "model.safetensors", config, seed)
    (folder / "tokenizer.json").write_text(tokenizer_text, encoding="utf-8")
    _write_json(folder / "tokenizer_config.json", tokenizer_config)
    return folder


# -- configs ------------------------------------------------------------------


def model_config(kind: str) -> dict:
    """The ``config.json`` contents for ``kind``."""
    common = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": HIDDEN,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
        "bos_token_id": None,
        "eos_token_id": SPECIAL_TOKENS.index(IM_END),
        "torch_dtype": "float32",
    }
    return {**common, **_KIND_CONFIGS[kind]()}


def _llama_config() -> dict:
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": HEAD_DIM,
        "intermediate_size": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
    }


def _sliding_config() -> dict:
    layer_types = ["sliding_attention", "full_attention", "sliding_attention"]
    return {
        **_llama_config(),
        "num_hidden_layers": len(layer_types),
        "layer_types": layer_types,
        "sliding_window": SLIDING_WINDOW,
    }


def _hybrid_config() -> dict:
    layer_types = ["conv", "full_attention", "conv"]
    return {
        "model_type": "lfm2",
        "architectures": ["Lfm2ForCausalLM"],
        "num_hidden_layers": len(layer_types),
        "layer_types": layer_types,
        # lfm2 derives head_dim = hidden_size // num_attention_heads
        "num_attention_heads": HIDDEN // HEAD_DIM,
        "num_key_value_heads": 1,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": HIDDEN,
        "block_ff_dim": 256,
        "block_multiple_of": 32,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "rope_theta": 1000000.0,
    }


def _ssm_config() -> dict:
    return {
        "model_type": "mamba2",
        "architectures": ["Mamba2ForCausalLM"],
        "num_hidden_layers": 2,
        "num_heads": 8,
        "head_dim": 32,
        "intermediate_size": 256,
        "state_size": 16,
        "n_groups": 1,
        "conv_kernel": 4,
        "layer_norm_epsilon": 1e-5,
        "use_bias": False,
        "use_conv_bias": False,
        "time_step_limit": [0.001, 100.0],
        "time_step_rank": "auto",
    }


def _mamba_config() -> dict:
    return {
        "model_type": "mamba",
        "architectures": ["MambaForCausalLM"],
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "state_size": 16,
        "conv_kernel": 4,
        "use_bias": False,
        "use_conv_bias": True,
        "time_step_rank": "auto",
    }


_KIND_CONFIGS = {
    "llama": _llama_config,
    "sliding": _sliding_config,
    "hybrid": _hybrid_config,
    "ssm": _ssm_config,
    "mamba": _mamba_config,
}


# -- weights ------------------------------------------------------------------


def parameter_templates(config: dict) -> dict[str, np.ndarray]:
    """mlx-lm's own parameters for ``config``: names, shapes, default values."""
    from mlx.utils import tree_flatten

    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = arch.Model(arch.ModelArgs.from_dict(config))
    return {name: np.array(value) for name, value in tree_flatten(model.parameters())}


def random_weights(config: dict, seed: int) -> dict[str, np.ndarray]:
    """Random float32 weights for ``config``, a pure function of ``seed``.

    - token embeddings ~ N(0, EMBED_STD); the special tokens' rows are scaled by
      SPECIAL_EMBED_SCALE so their (tied) logits sit near 0 and greedy decoding
      practically never emits them: continuations run their full length;
    - matrices and conv kernels ~ N(0, MATRIX_GAIN / sqrt(fan_in));
    - biases 0; per-head q/k norm scales QK_NORM_SCALE; final norm scale
      FINAL_NORM_SCALE; SSM parameters as below; other vectors (norm scales)
      keep mlx-lm's defaults (ones).
    """
    rng = np.random.default_rng(seed)
    weights = {}
    for name, template in sorted(parameter_templates(config).items()):
        weights[name] = _init_parameter(name, template, rng).astype(np.float32)
    return weights


def _init_parameter(name: str, template: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    shape = template.shape
    if name.endswith(("embed_tokens.weight", "embeddings.weight")):
        table = rng.normal(0.0, EMBED_STD, size=shape)
        table[: len(SPECIAL_TOKENS)] *= SPECIAL_EMBED_SCALE
        return table
    if template.ndim >= 2:
        return rng.normal(0.0, MATRIX_GAIN / math.sqrt(math.prod(shape[1:])), size=shape)
    if name.endswith(("dt_bias", "dt_proj.bias")):  # SSM steps dt log-uniform in [1e-3, 3e-2]: long memory
        dt = np.exp(rng.uniform(math.log(1e-3), math.log(3e-2), size=shape))
        return dt + np.log(-np.expm1(-dt))  # inverse softplus
    if name.endswith(".bias"):
        return np.zeros(shape)
    if name.endswith(("q_layernorm.weight", "k_layernorm.weight")):
        return np.full(shape, QK_NORM_SCALE)
    if name in FINAL_NORMS:
        return np.full(shape, FINAL_NORM_SCALE)
    if name.endswith("A_log"):  # SSM decay rates A in [1, 16], as Mamba-2 does
        return np.log(rng.uniform(1.0, 16.0, size=shape))
    if name.endswith(".D"):  # no skip path: it would drown the small-dt state
        return np.zeros(shape)
    return template


def _write_weights(path: Path, config: dict, seed: int) -> None:
    from safetensors.numpy import save_file

    save_file(random_weights(config, seed), str(path), metadata={"format": "pt"})


# -- tokenizer ----------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    """The trained tokenizer as ``tokenizer.json`` text (trained once per process)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(), trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(
            f"tiny tokenizer has {tokenizer.get_vocab_size()} tokens, expected "
            f"{VOCAB_SIZE}; lengthen the built-in corpus"
        )
    return tokenizer.to_str(pretty=True)


def _tokenizer_json_with(markers: tuple[str, ...]) -> str:
    """The trained tokenizer with ``markers`` appended as special tokens (ids VOCAB_SIZE, ...)."""
    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_str(_tokenizer_json())
    tokenizer.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in markers])
    return tokenizer.to_str(pretty=True)


def _tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "additional_special_tokens": [IM_START],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
