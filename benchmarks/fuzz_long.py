"""Long loader fuzz: ``python benchmarks/fuzz_long.py --count 10000 [--seed N]``.

Runs ``tests/fuzz_files.py``'s generator (the same one ``tests/test_fuzz_loader.py``
uses for ~2,000 files per test run) for ``--count`` files and prints a table:
files per mutation class, outcomes (loaded, or which ChatCacheError), contract
violations, seconds, and the process's peak RSS / mlx peak memory. Exit code 1
when any file broke the contract (each violation is listed with what
rebuilds it: generator seed, file index, mutation class and description).
"""

from __future__ import annotations

import argparse
import collections
import resource
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import mlx.core as mx  # noqa: E402
from fuzz_files import MUTATIONS, ContractViolation, build_seeds, check_file, generate  # noqa: E402


def run(count: int, seed: int, workdir: Path, seeds=None, trace_python: bool = True) -> dict:
    seeds = build_seeds() if seeds is None else seeds
    case_path = workdir / "case.safetensors"
    outcomes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    seconds: collections.Counter = collections.Counter()
    violations = []
    total_bytes = max_size = mx_peak = 0
    tracing = trace_python and not tracemalloc.is_tracing()
    if tracing:
        tracemalloc.start()
    start = time.perf_counter()
    try:
        for case in generate(seeds, count, seed):
            t = time.perf_counter()
            case_path.unlink(missing_ok=True)  # a new file: ext4 flushes a file truncated and rewritten
            case_path.write_bytes(case.data)
            total_bytes += len(case.data)
            max_size = max(max_size, len(case.data))
            try:
                outcome = check_file(case_path, workdir)
            except ContractViolation as e:
                violations.append(f"seed {seed} #{case.index} {case.kind} from {case.seed_name} ({case.what}): {e}")
                outcome = "VIOLATION"
            outcomes[case.kind][outcome] += 1
            seconds[case.kind] += time.perf_counter() - t
            mx_peak = max(mx_peak, mx.get_peak_memory())  # check_file resets it before each load
    finally:
        if tracing:
            tracemalloc.stop()
    elapsed = time.perf_counter() - start
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    cols = ["loaded", "CacheFileError", "CacheFormatError", "UnsupportedCacheError"]
    cols += sorted({o for c in outcomes.values() for o in c} - set(cols) - {"VIOLATION"}) + ["VIOLATION"]
    head = f"| {'mutation class':<16} | {'files':>6} | " + " | ".join(f"{c:>{max(len(c), 6)}}" for c in cols) + " | seconds |"
    rule = "|" + "|".join("-" * len(part) for part in head.split("|")[1:-1]) + "|"
    lines = [head, rule]
    totals = collections.Counter()
    for kind in MUTATIONS:
        c = outcomes[kind]
        totals.update(c)
        lines.append(
            f"| {kind:<16} | {sum(c.values()):>6} | "
            + " | ".join(f"{c[col]:>{max(len(col), 6)}}" for col in cols)
            + f" | {seconds[kind]:>7.1f} |"
        )
    lines.append(
        f"| {'total':<16} | {sum(totals.values()):>6} | "
        + " | ".join(f"{totals[col]:>{max(len(col), 6)}}" for col in cols)
        + f" | {elapsed:>7.1f} |"
    )
    summary = (
        f"{count} files ({total_bytes / 1e6:.1f} MB, largest {max_size / 1e3:.0f} KB) from {len(seeds)} seed files, "
        f"generator seed {seed}: {elapsed:.1f} s ({count / elapsed:.0f} files/s); "
        f"peak RSS {peak_rss / 1e6:.0f} MB, largest mlx peak for one file {mx_peak / 1e6:.1f} MB; "
        f"{len(violations)} contract violations"
    )
    return {
        "table": "\n".join(lines) + "\n\n" + summary,
        "outcomes": outcomes,
        "violations": violations,
        "elapsed": elapsed,
        "peak_rss": peak_rss,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=10_000, help="files to generate (default 10000)")
    ap.add_argument("--seed", type=int, default=1, help="generator seed (default 1)")
    ap.add_argument("--no-tracemalloc", action="store_true", help="skip the per-file Python allocation bound (faster)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mlxcc-fuzz-") as d:
        report = run(args.count, args.seed, Path(d), trace_python=not args.no_tracemalloc)
    print(report["table"])
    for v in report["violations"][:50]:
        print("VIOLATION", v)
    return 1 if report["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
