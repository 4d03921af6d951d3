"""Where a CPU decode step of the demo model goes, per weight policy.

One command (from the repository root):

    .venv/bin/python benchmarks/decode_profile.py                  # prints the tables
    .venv/bin/python benchmarks/decode_profile.py --write-results  # also updates RESULTS.md

In one process (OpenBLAS swap on, unless ``MLXCC_BLAS=off``), for SmolLM2 Q4_1
as loaded, with ``--weights q`` and with ``--weights float32``, after a
37-token prompt, ``--steps`` synchronous decode steps split into

- graph build: the Python model call and sampling ops (no compute: MLX is lazy);
- compute: ``mx.eval`` of the next token;

and, for comparison, mlx_chatcache's ``generate_step`` (which builds the next
step's graph while the current one computes) in tokens/s. Then one layer's
product on one row (the MLP up projection, 576 -> 1536): MLX's 4-bit kernel
with float16 and with float32 scales, dequantize-then-GEMV, and the float32
GEMV (OpenBLAS), which is what decode costs per layer under each policy.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mlx_chatcache  # noqa: E402,F401  (first: the BLAS swap)
from cache_io import RESULTS, header_block, md_table, write_results_section  # noqa: E402


def med_ms(f, n: int) -> float:
    import mlx.core as mx

    mx.eval(f())
    times = []
    for _ in range(n):
        start = time.perf_counter()
        mx.eval(f())
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def step_split(model, prompt: list[int], steps: int) -> tuple[float, float]:
    """Median (graph build ms, compute ms) of synchronous greedy decode steps."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    y = mx.argmax(model(mx.array([prompt]), cache=cache)[:, -1], axis=-1)  # (1,)
    mx.eval(y)
    build, compute = [], []
    for _ in range(steps):
        a = time.perf_counter()
        y = mx.argmax(model(y[None], cache=cache)[:, -1], axis=-1)  # (1, 1) in -> (1,)
        b = time.perf_counter()
        mx.eval(y)
        build.append(b - a)
        compute.append(time.perf_counter() - b)
    return statistics.median(build) * 1e3, statistics.median(compute) * 1e3


def generate_step_tps(model, prompt: list[int], steps: int) -> float:
    from mlx_chatcache.config import DEFAULTS
    from mlx_chatcache.generation.loop import generate_step

    times = [time.perf_counter() for _ in generate_step(prompt, model, config=DEFAULTS.updated(max_tokens=steps + 1))]
    return (len(times) - 1) / (times[-1] - times[0])


def layer_rows(reps: int) -> list[list]:
    import mlx.core as mx

    w = mx.random.normal((1536, 576))  # (out, in)
    q, s, b = mx.quantize(w, 32, 4)
    s16, b16 = s.astype(mx.float16), b.astype(mx.float16)
    x = mx.random.normal((1, 576))  # one decode row
    dense = mx.dequantize(q, s, b, 32, 4)
    cases = [
        ("4-bit kernel, float16 scales (as loaded)", lambda: mx.quantized_matmul(x, q, s16, b16, True, 32, 4)),
        ("4-bit kernel, float32 scales (q)", lambda: mx.quantized_matmul(x, q, s, b, True, 32, 4)),
        ("dequantize + float32 GEMV", lambda: x @ mx.dequantize(q, s, b, 32, 4).T),
        ("float32 GEMV (float32)", lambda: x @ dense.T),
    ]
    flops = 2 * 1536 * 576
    return [[name, f"{(t := med_ms(f, reps)):.3f}", f"{flops / t / 1e6:.2f}"] for name, f in cases]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=24, help="decode steps per policy")
    ap.add_argument("--reps", type=int, default=50, help="repetitions of each one-layer product")
    ap.add_argument("--write-results", action="store_true")
    ap.add_argument("--results", default=str(RESULTS), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    from mlx_chatcache.models.loading import load

    rows = []
    for policy in ("loaded", "q", "float32"):
        model, tok = load(None, weights=policy)
        prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         add_generation_prompt=True)  # fmt: skip
        build, compute = step_split(model, prompt, args.steps)
        tps = generate_step_tps(model, prompt, args.steps)
        rows.append([policy, f"{build:.1f}", f"{compute:.1f}", f"{100 * build / (build + compute):.0f} %",
                     f"{1e3 / (build + compute):.1f}", f"{tps:.1f}"])  # fmt: skip
        del model
    text = header_block("Decode profile: SmolLM2-135M-Instruct Q4_1, one process")
    text += "\n" + md_table(
        ["weights", "graph build ms", "compute ms", "build share", "sync tok/s", "generate_step tok/s"], rows
    )
    text += "\nOne layer, one row (576 -> 1536):\n\n" + md_table(["product", "ms", "GF/s"], layer_rows(args.reps))
    print(text)
    if args.write_results:
        write_results_section("decode_profile", text, Path(args.results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
