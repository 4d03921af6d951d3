"""``mlxcc doctor``: what this machine runs MLX with, and whether it is the fast path.

Reports the MLX version and device, the BLAS MLX's CPU matmuls use (and its
threads), checks that an optimized BLAS really took effect (a timed float32
512^3 matmul, and the libraries mapped in this process), and the weight
policy (with ``--model``, the one chosen for that model).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

from ..config import FLOAT32_MAX_BYTES, WEIGHTS


def add_parser(sub) -> None:
    p = sub.add_parser(
        "doctor",
        help="show the BLAS, threads and weight policy in use, and check the fast path works",
        description="Report what MLX runs with here: device, BLAS (and whether the optimized "
        "BLAS is in effect, by timing a float32 512^3 matmul), OpenBLAS threads, and the "
        "weight policy. Environment: MLXCC_BLAS=off keeps MLX's bundled BLAS, "
        "MLXCC_BLAS_THREADS=N sets the threads.",
    )
    p.add_argument("--model", help="also load this model (or the demo model with --model demo) and report its weight policy")
    p.add_argument("--weights", choices=("q", "float32", "auto"), help=f"weight policy for --model (default {WEIGHTS})")
    p.add_argument("--json", action="store_true", help="print a JSON object instead of text")
    p.set_defaults(run=run)


def report(model_ref: str | None, weights: str | None) -> dict:
    from ..config import VERSION
    from ..backend import blas

    import mlx.core as mx

    gflops = blas.measure_gflops()
    s = blas.STATUS
    provider = blas.sgemm_provider()
    swapped = s.active and provider == s.library
    if s.active:
        check = "the optimized BLAS is in effect" if swapped else "NOT in effect: cblas_sgemm resolves elsewhere"
        if swapped and gflops < blas.FAST_GFLOPS:
            check += " (but slow now: the machine is busy?)"
    else:
        check = "fast" if gflops >= blas.FAST_GFLOPS else "slow: MLX's bundled reference BLAS"
    out = {
        "mlxcc": VERSION,
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "blas": blas.describe(),
        "blas_active": s.active,
        "blas_reason": s.reason,
        "blas_library": s.library,
        "blas_config": s.config,
        "blas_threads": s.threads,
        "blas_mapped": blas.mapped_blas_libraries(),
        "cblas_sgemm_from": provider,
        "blas_in_effect": swapped,
        "sgemm_512_gflops": round(gflops, 1),
        "check": check,
        "weights_default": WEIGHTS,
        "weights_rule": f"auto on CPU: float32 when the float32 weights take <= {FLOAT32_MAX_BYTES / 1e9:.1f} GB "
        "and a quarter of RAM, else q; other backends: as loaded",
    }
    if model_ref is not None:
        from ..models.loading import load

        model, _ = load(None if model_ref == "demo" else model_ref, weights=weights)
        out["model"] = model.fingerprint.model_id
        out["weights"] = model.weight_report.describe()
    return out


def run(args: argparse.Namespace) -> int:
    r = report(args.model, args.weights)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    lines = [
        f"mlxcc {r['mlxcc']}, Python {r['python']}, {r['platform']}",
        f"mlx:      {r['mlx']}, default device {r['device']}",
        f"BLAS:     {r['blas']}",
    ]
    if r["blas_library"]:
        lines.append(f"          {r['blas_library']}")
    lines.append(f"check:    cblas_sgemm from {r['cblas_sgemm_from']}; float32 512^3 matmul at "
                 f"{r['sgemm_512_gflops']} GF/s: {r['check']}")
    if r["blas_mapped"]:
        lines.append("mapped:   " + "\n          ".join(r["blas_mapped"]))
    lines.append(f"weights:  default {r['weights_default']} ({r['weights_rule']})")
    if "weights" in r:
        lines.append(f"model:    {r['model']}: {r['weights']}")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0
