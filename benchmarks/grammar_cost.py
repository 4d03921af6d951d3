"""What constrained decoding (a JSON schema, llguidance) costs per token.

One command (from the repository root):

    .venv/bin/python benchmarks/grammar_cost.py                  # prints the table
    .venv/bin/python benchmarks/grammar_cost.py --write-results  # also updates RESULTS.md

Two measurements:

1. Decode on the tiny test model (tests/tiny_models.py, llama, vocabulary 384),
   ``--tokens`` tokens per run, ``--repeats`` runs each, interleaved, medians:
   - ``free``: no processor (the loop feeds one token ahead);
   - ``no-op processor``: a processor that returns the logits unchanged (the loop
     is synchronous with any processor: this separates that from the grammar);
   - ``schema``: :class:`~mlx_chatcache.generation.constrain.Constraint` with a schema of
     exactly ``--tokens // 2`` small integers in an array (the reply runs long).
   Tokens/s counts every sampled token over the time from the first to the last.
2. The constraint alone on a 32k-token byte-level BPE (trained once from the Python
   standard library's sources and kept in the temp folder; ``--tokenizer FILE``
   takes another ``tokenizer.json``): tokenizer setup, schema compile, and the time
   of one processor call (consume the sampled token, compute the mask, apply it to
   ``(1, V)`` logits, evaluate), over ``--steps`` steps of random logits.
"""

from __future__ import annotations

import argparse
import glob
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from cache_io import header_block, md_table, median, write_results_section  # noqa: E402

SCHEMA_3 = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4}},
            "required": ["name", "age", "tags"], "additionalProperties": False}  # fmt: skip


def long_schema(n: int) -> dict:
    return {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": n, "maxItems": n}


def decode_rows(tokens: int, repeats: int) -> list[list]:
    import mlx.core as mx

    from mlx_chatcache.config import GenerationConfig
    from mlx_chatcache.generation.constrain import Constraint, json_schema_grammar
    from mlx_chatcache.generation.text import stream_generate
    from mlx_chatcache.models.loading import load
    from tiny_models import build_tiny_model

    folder = build_tiny_model("llama", Path(tempfile.mkdtemp()) / "llama")
    model, tokenizer = load(str(folder))
    grammar = json_schema_grammar(long_schema(tokens // 2))
    config = GenerationConfig(max_tokens=tokens, temp=1.0, seed=0)
    engines = {
        "free": lambda: None,
        "no-op processor": lambda: [lambda toks, logits: logits],
        "schema": lambda: [Constraint(tokenizer, grammar)],
    }
    times: dict[str, list[float]] = {k: [] for k in engines}
    counts: dict[str, list[int]] = {k: [] for k in engines}
    for r in range(repeats + 1):  # the first round warms up
        for name, make in engines.items():
            stamps = []
            for step in stream_generate(model, tokenizer, "Numbers:", config=config, logits_processors=make()):
                stamps.append(time.perf_counter())
            if r:
                times[name].append((stamps[-1] - stamps[0]) / max(len(stamps) - 1, 1))
                counts[name].append(len(stamps))
    mx.clear_cache()
    base = median(times["free"])
    return [[name, f"{median(counts[name]):.0f}", f"{1 / median(times[name]):.0f}",
             f"{median(times[name]) * 1e3:.3f}", f"{(median(times[name]) - base) * 1e3:+.3f}"]
            for name in engines]  # fmt: skip


def bpe_tokenizer(vocab: int) -> str:
    """A byte-level BPE ``tokenizer.json`` of ``vocab`` tokens (trained once, kept in the temp folder)."""
    path = Path(tempfile.gettempdir()) / f"mlxcc-bench-bpe{vocab}.json"
    if path.exists():
        return path.read_text()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/**/*.py", recursive=True))[:3000]
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)  # fmt: skip
    t.train_from_iterator((Path(f).read_text(errors="ignore") for f in files), trainer)
    path.write_text(t.to_str())
    return path.read_text()


def mask_rows(tokenizer_text: str, steps: int) -> list[list]:
    import llguidance as llg
    import mlx.core as mx
    import numpy as np

    from mlx_chatcache.generation.constrain import json_schema_grammar, mask_logits

    t0 = time.perf_counter()
    tok = llg.LLTokenizer(tokenizer_text, eos_token=2)
    setup = time.perf_counter() - t0
    V = tok.vocab_size
    rows = []
    for label, schema in (("3 fields", SCHEMA_3), (f"{steps} digits", long_schema(steps))):
        t0 = time.perf_counter()
        matcher = llg.LLMatcher(tok, json_schema_grammar(schema), log_level=0)
        compile_s = time.perf_counter() - t0
        rng = np.random.default_rng(0)
        per_call, n = [], 0
        while n < steps and not matcher.is_stopped():
            logits = mx.array(rng.standard_normal((1, V)).astype(np.float32))
            mx.eval(logits)
            t0 = time.perf_counter()
            masked = mask_logits(logits, matcher.compute_bitmask())
            token = int(mx.argmax(masked, axis=-1).item())
            per_call.append(time.perf_counter() - t0)
            if token == 2 and matcher.is_accepting():
                break
            assert matcher.consume_token(token), matcher.get_error()
            n += 1
        per_call.sort()
        p95 = per_call[int(0.95 * (len(per_call) - 1))]
        rows.append([f"V={V}, {label}", f"{setup * 1e3:.0f}", f"{compile_s * 1e3:.1f}", str(len(per_call)),
                     f"{statistics.median(per_call) * 1e6:.0f}", f"{p95 * 1e6:.0f}"])  # fmt: skip
    return rows


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tokenizer", help="a tokenizer.json to measure the mask on (default: a trained BPE of --vocab)")
    ap.add_argument("--write-results", action="store_true")
    args = ap.parse_args(argv[1:])
    import mlx_chatcache  # noqa: F401  (picks the BLAS before mlx.core loads)

    decode = md_table(["tiny model (V=384)", "tokens", "tokens/s", "ms/token", "vs free (ms/token)"],
                      decode_rows(args.tokens, args.repeats))  # fmt: skip
    text = Path(args.tokenizer).read_text() if args.tokenizer else bpe_tokenizer(args.vocab)
    mask = md_table(["constraint alone", "tokenizer setup ms", "schema compile ms", "steps", "per call median us",
                     "p95 us"], mask_rows(text, args.steps))  # fmt: skip
    out = header_block("Constrained decoding cost (grammar_cost.py)") + "\n" + decode + "\n" + mask
    print(out)
    if args.write_results:
        write_results_section("grammar_cost", out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
