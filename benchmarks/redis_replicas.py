"""Two ``mlxcc serve`` replicas sharing one Redis: TTFT of a conversation's next
turn on the replica that has never seen it (served from Redis), vs cold.

One command (from the repository root; needs ``redis-server`` on the PATH):

    .venv/bin/python benchmarks/redis_replicas.py                  # prints the table
    .venv/bin/python benchmarks/redis_replicas.py --write-results  # also updates RESULTS.md

Everything runs on loopback in this one run: a ``redis-server`` on a free
port (no persistence), replicas A and B (``--cache-redis``, memory tier on,
disk tier off) and a reference server C with no store at all. The model is a
random float32 llama written to a temp folder (``--layers``/``--hidden``; the
tiny test tokenizer and ChatML template). For each history length, a new
conversation (own system prompt of about that many tokens) is served by A,
turn 1; once A's entry is in Redis, turn 2 is sent to:

- ``B via Redis``: the other replica (its memory has never seen the chat);
- ``cold``: C, which prefills the whole prompt;
- ``A memory``: for reference, the replica that served turn 1 (its own memory
  tier), asked last and with another last user message, so that nothing B
  wrote serves it better.

The model's prefill is cheap next to its K/V size (float32, 16 KiB per token
at 8L h512, 5x less compute per K/V byte than SmolLM2-135M in float16), so
the ratio is conservative for real models. Each is timed with the ``openai`` client, streaming: TTFT = request sent to the
first content chunk. ``--repeats`` conversations per length, engines
interleaved in alternating order; medians. B's reply must equal C's (greedy):
"same output" says whether it did. OpenBLAS is used when Debian's is
installed (``--no-openblas`` keeps the wheel's reference BLAS; the servers
inherit it). Bounded: ``--max-seconds`` stops adding
repeats, and each request has a 300 s timeout.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))  # tiny model builder, server and redis launchers

from cache_io import RESULTS, header_block, maybe_reexec_openblas, md_table, write_results_section  # noqa: E402

SENTENCES = [
    "A cache stores the results of earlier work so that it does not need to be done again.",
    "The train leaves the station at seven o'clock and arrives before noon.",
    "Light from the sun is scattered by the air, and blue light scatters the most.",
    "She baked bread in the evening and shared it with the people next door.",
    "Keep your answers short, clear and kind. Ask a question if something is unclear.",
]


def build_model(folder: Path, layers: int, hidden: int) -> Path:
    """A random float32 llama of ``layers`` x ``hidden`` with the test tokenizer."""
    import json

    from safetensors.numpy import save_file
    from tiny_models import build_tiny_model, model_config, random_weights

    build_tiny_model("llama", folder)  # tokenizer files, chat template
    heads = max(2, hidden // 64)
    config = {**model_config("llama"), "hidden_size": hidden, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2),
              "intermediate_size": hidden * 3, "head_dim": 64}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    save_file(random_weights(config, 0), str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def system_prompt(tokenizer, n_tokens: int, tag: int) -> str:
    words, i = [f"Conversation {tag}."], tag
    while len(tokenizer.encode(" ".join(words))) < n_tokens:
        words.append(SENTENCES[i % len(SENTENCES)])
        i += 1
    return " ".join(words)


def timed_turn(server, messages, max_tokens: int) -> tuple[float, str, int]:
    """(TTFT s, reply text, cached_tokens) of one streamed request."""
    import openai

    c = openai.OpenAI(base_url=server.base_url, api_key="unused", timeout=300, max_retries=0)
    t0 = time.perf_counter()
    stream = c.chat.completions.create(model=server.model_id, messages=messages, temperature=0, max_tokens=max_tokens,
                                       stream=True, stream_options={"include_usage": True})  # fmt: skip
    ttft, text, cached = None, "", 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
    return ttft if ttft is not None else float("nan"), text, cached


def wait_written(server, before: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = server.health()["store"]["redis"]
        if s["added"] > before and not s["pending_writes"]:
            return
        time.sleep(0.02)
    raise SystemExit(f"replica A's entry did not reach Redis within {timeout} s: {server.health()['store']}")


def measure(a, b, c, tokenizer, lengths, repeats, max_tokens, max_seconds) -> list[dict]:
    rows, t_end = [], time.monotonic() + max_seconds
    for n in lengths:
        samples = {"B via Redis": [], "cold": [], "A memory": []}
        cached, same, history = [], True, 0
        for r in range(repeats):
            if r and time.monotonic() > t_end:
                break
            msgs = [{"role": "system", "content": system_prompt(tokenizer, n, 1000 * n + r)},
                    {"role": "user", "content": "Summarise that in one line."}]  # fmt: skip
            before = a.health()["store"]["redis"]["added"]
            _, reply, _ = timed_turn(a, msgs, max_tokens)
            wait_written(a, before)
            turn2 = msgs + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Thank you!"}]
            history = len(tokenizer.apply_chat_template(turn2, tokenize=True, add_generation_prompt=True))
            order = [("B via Redis", b), ("cold", c)]
            replies = {}
            for name, server in order if r % 2 == 0 else order[::-1]:
                ttft, replies[name], got = timed_turn(server, turn2, max_tokens)
                samples[name].append(ttft)
                if name == "B via Redis":
                    cached.append(got)
            same = same and replies["B via Redis"] == replies["cold"]
            # last, and with another last message, so that no entry B wrote can serve it better than A's own
            other = turn2[:-1] + [{"role": "user", "content": "Thanks a lot."}]
            samples["A memory"].append(timed_turn(a, other, max_tokens)[0])
        rows.append({"tokens": history, "cached": statistics.median(cached), "same": same, "n": len(cached),
                     **{k: statistics.median(v) for k, v in samples.items()}})  # fmt: skip
    return rows


def report(rows, args, desc) -> str:
    out = [header_block("Two replicas sharing Redis: TTFT of a conversation's next turn on the other replica"),
           f"- model: {desc}; replicas A and B with --cache-redis (memory tier on, disk tier off), C with no store",
           f"- turn 2 of a fresh conversation per repeat ({args.repeats} per length, medians), "
           f"max_tokens {args.max_tokens}, TTFT measured by the openai client (streaming, first content chunk); "
           f"servers with OPENBLAS_NUM_THREADS={args.blas_threads}",
           ""]  # fmt: skip
    table = [[r["tokens"], r["cached"], f"{r['cold'] * 1e3:.0f} ms", f"{r['B via Redis'] * 1e3:.0f} ms",
              f"{r['A memory'] * 1e3:.0f} ms", f"{r['cold'] / r['B via Redis']:.1f}x", r["n"],
              "yes" if r["same"] else "NO"] for r in rows]  # fmt: skip
    out.append(md_table(["prompt tokens", "cached on B", "cold (C, no store)", "B via Redis", "A memory",
                         "cold / B", "repeats", "same output (B = C)"], table))  # fmt: skip
    extra = ", ".join(f"{(r['B via Redis'] - r['A memory']) * 1e3:.0f} ms at {r['tokens']}" for r in rows)
    out.append(f"\nB via Redis minus A memory (fetching and checking the entry from Redis): {extra}.")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="256,1024,2048", help="history lengths in tokens (comma separated)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--max-seconds", type=float, default=420, help="stop adding repeats after this long")
    p.add_argument("--no-openblas", action="store_true", help="keep the BLAS bundled in the mlx-cpu wheel")
    p.add_argument("--blas-threads", default="1",
                   help="OPENBLAS_NUM_THREADS of the servers (default 1: more threads thrash on shared cores)")
    p.add_argument("--write-results", action="store_true")
    p.add_argument("--results", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if argv is None and not args.no_openblas:
        maybe_reexec_openblas(sys.argv, auto=True)
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (Debian: apt-get install redis-server)")
    from redis_server import RedisServer
    from server_process import ServerProcess

    from mlx_chatcache.models.loading import load_tokenizer

    lengths = [int(x) for x in args.lengths.split(",") if x]
    with tempfile.TemporaryDirectory(prefix="mlxcc-bench-redis-") as tmp:
        tmp = Path(tmp)
        model = build_model(tmp / "model", args.layers, args.hidden)
        tokenizer = load_tokenizer(str(model))
        desc = f"random llama f32 {args.layers}L h{args.hidden} (tiny test tokenizer, vocab 384)"
        redis = RedisServer(tmp / "redis", binary=binary).start()
        common = ("--context-length", "8192", "--max-tokens", str(args.max_tokens), "--disk-cache-bytes", "0")
        kw = {"start_timeout": 300, "env": {"OPENBLAS_NUM_THREADS": args.blas_threads}}
        try:
            with ServerProcess(model, tmp / "a", "--cache-redis", redis.url, *common, **kw) as a, \
                    ServerProcess(model, tmp / "b", "--cache-redis", redis.url, *common, **kw) as b, \
                    ServerProcess(model, None, "--cache-bytes", "0", *common, **kw) as c:  # fmt: skip
                timed_turn(c, [{"role": "user", "content": "Warm up."}], 2)  # first-request costs out of the way
                timed_turn(b, [{"role": "user", "content": "Warm up."}], 2)
                rows = measure(a, b, c, tokenizer, lengths, args.repeats, args.max_tokens, args.max_seconds)
        finally:
            redis.stop()
    out = report(rows, args, desc)
    print(out)
    if args.write_results:
        write_results_section("redis_replicas", out, args.results)
    return 0 if all(r["same"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
