"""Loader fuzzing (issue #5): thousands of bad cache files, generated from valid
seeds by ``tests/fuzz_files.py``, go through ``load_prompt_cache`` and
``read_cache_info`` (the contract is ``fuzz_files.check_file``), then a sample of
them through the real CLI, in-process and in subprocesses.

The run is seeded (``FUZZ_SEED``) so a failure names a file that can be rebuilt:
``next(c for c in generate(build_seeds(), i + 1, FUZZ_SEED) if c.index == i)``.
``benchmarks/fuzz_long.py`` runs the same generator for 10,000+ files.
"""

from __future__ import annotations

import collections
import resource
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
from fuzz_files import MUTATIONS, ContractViolation, FuzzCase, build_seeds, check_file, generate

import mlx_chatcache.cli as cli_pkg
from mlx_chatcache.files.mlxcc_format import load_cache_file
from mlx_chatcache.cli.main import main


FUZZ_SEED = 20261130
N_FILES = 110 * len(MUTATIONS)  # 2,090: 110 files of every mutation class
CLI_PER_CLASS = 3  # rejected files of each class sent through the CLI in-process (~57)
CLI_SUBPROCESSES = 10
UNFORGED_DAMAGE = ("truncate", "random_flips")  # mutations that never recompute a checksum
GENERATE_CLI = Path(cli_pkg.__file__).parent / "generate.py"


@pytest.fixture(scope="module")
def seeds():
    return build_seeds()


@pytest.fixture(scope="module")
def fuzz_run(seeds, tmp_path_factory):
    """Run every generated file once; tests below inspect the results."""
    work = tmp_path_factory.mktemp("fuzz")
    case_path = work / "case.safetensors"
    outcomes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    violations: list[tuple[FuzzCase, str]] = []
    rejected: dict[str, list[FuzzCase]] = collections.defaultdict(list)  # by the loader
    info_rejected: dict[str, list[FuzzCase]] = collections.defaultdict(list)  # by read_cache_info too
    seed_of = {s.name: s for s in seeds}
    damaged_loaded: list[FuzzCase] = []  # unforged damage to a checksummed file that loaded anyway
    max_size = 0
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start()  # check_file then also bounds Python allocations per file
    start = time.perf_counter()
    try:
        for case in generate(seeds, N_FILES, FUZZ_SEED):
            case_path.unlink(missing_ok=True)  # a new file: ext4 flushes a file truncated and rewritten
            case_path.write_bytes(case.data)
            max_size = max(max_size, len(case.data))
            try:
                outcome = check_file(case_path, work)
            except ContractViolation as e:
                violations.append((case, str(e)))
                outcome = "VIOLATION"
            outcomes[case.kind][outcome] += 1
            seed = seed_of[case.seed_name]
            if (outcome == "loaded" and case.kind in UNFORGED_DAMAGE and seed.layout == "mlxcc"
                    and case.data != seed.data):  # fmt: skip
                damaged_loaded.append(case)
            if outcome not in ("loaded", "VIOLATION") and len(rejected[case.kind]) < CLI_PER_CLASS:
                rejected[case.kind].append(case)
            if outcome != "VIOLATION" and check_file.info_outcome != "ok" and len(info_rejected[case.kind]) < CLI_PER_CLASS:
                info_rejected[case.kind].append(case)
    finally:
        if not tracing:
            tracemalloc.stop()
    elapsed = time.perf_counter() - start
    rss_growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
    return {
        "outcomes": outcomes, "violations": violations, "damaged_loaded": damaged_loaded,
        "rejected": rejected, "info_rejected": info_rejected,
        "elapsed": elapsed,
        "rss_growth": rss_growth, "max_size": max_size, "work": work,
    }


def _table(outcomes) -> str:
    cols = sorted({o for c in outcomes.values() for o in c})
    lines = [f"{'mutation class':18}" + "".join(f"{c:>23}" for c in cols)]
    for kind in MUTATIONS:
        lines.append(f"{kind:18}" + "".join(f"{outcomes[kind][c]:>23}" for c in cols))
    return "\n".join(lines)


# ---------------------------------------------------------------------- generator
def test_seed_files_are_valid_and_cover_every_layout(seeds, tmp_path):
    layouts = collections.Counter(s.layout for s in seeds)
    assert set(layouts) == {"mlxcc", "mlx-lm", "mlx-lm-legacy"}
    classes = set()
    for s in seeds:
        p = tmp_path / f"{s.name}.safetensors"
        p.write_bytes(s.data)
        assert check_file(p, tmp_path) == "loaded", s.name
        _, info = load_cache_file(p)
        assert info.layout == s.layout
        classes |= set(info.classes)
    assert classes >= {"KVCache", "RotatingKVCache", "QuantizedKVCache", "QuantizedRotatingKVCache",
                       "ChunkedKVCache", "ArraysCache", "CacheList"}


def test_generator_is_deterministic(seeds):
    a = [(c.kind, c.what, c.data) for c in generate(seeds, 60, FUZZ_SEED)]
    b = [(c.kind, c.what, c.data) for c in generate(seeds, 60, FUZZ_SEED)]
    assert a == b
    assert a != [(c.kind, c.what, c.data) for c in generate(seeds, 60, FUZZ_SEED + 1)]


# ---------------------------------------------------------------------- loader
def test_loader_contract_on_2000_bad_files(fuzz_run):
    """Every file loads consistently or raises a ChatCacheError (one line), with
    mlx and Python allocations bounded by the file size; see fuzz_files.check_file."""
    print(f"\n{N_FILES} files in {fuzz_run['elapsed']:.1f} s\n{_table(fuzz_run['outcomes'])}")
    shown = "\n".join(
        f"  #{c.index} {c.kind} from {c.seed_name} ({c.what}): {err}" for c, err in fuzz_run["violations"][:15]
    )
    assert not fuzz_run["violations"], f"{len(fuzz_run['violations'])} contract violations:\n{shown}"


def test_checksums_find_every_flip_and_cut_of_our_files(fuzz_run):
    """A file of our format whose bytes were flipped or cut (no checksum recomputed) never loads."""
    cases = fuzz_run["damaged_loaded"]
    shown = ", ".join(f"#{c.index} {c.kind} ({c.what})" for c in cases[:10])
    assert not cases, f"{len(cases)} damaged files loaded: {shown}"


def test_every_mutation_class_is_exercised(fuzz_run):
    outcomes = fuzz_run["outcomes"]
    assert sum(sum(c.values()) for c in outcomes.values()) == N_FILES >= 2000
    for kind in MUTATIONS:
        rejected = sum(n for o, n in outcomes[kind].items() if o not in ("loaded", "VIOLATION"))
        assert rejected >= 20, f"{kind}: only {rejected} files rejected: {dict(outcomes[kind])}"
    # harmless mutations exist too, so the 'loaded' branch of the contract is exercised
    assert sum(c["loaded"] for c in outcomes.values()) >= 100


def test_fuzz_run_memory_is_bounded(fuzz_run):
    # per-file bounds are in check_file; this bounds the whole process (max RSS only grows)
    bound = (256 << 20) + 16 * fuzz_run["max_size"]
    assert fuzz_run["rss_growth"] < bound, f"max RSS grew by {fuzz_run['rss_growth'] >> 20} MB"


# ---------------------------------------------------------------------- CLI
def _cli_sample(fuzz_run, which: str) -> list[tuple[FuzzCase, Path]]:
    """Files of every mutation class that ``which`` ("rejected": the loader,
    "info_rejected": read_cache_info) refused, each written to its own path."""
    out = []
    folder = fuzz_run["work"] / "cli"
    folder.mkdir(exist_ok=True)
    for kind in MUTATIONS:
        for case in fuzz_run[which][kind]:
            p = folder / f"bad-{case.index:05d}-{kind}.safetensors"
            p.write_bytes(case.data)
            out.append((case, p))
    return out


def _assert_one_error_line(rc: int, err: str, what: str) -> None:
    lines = err.splitlines()
    assert rc != 0, what
    assert "Traceback" not in err, f"{what}: {err}"
    assert len(lines) == 1 and lines[0].strip(), f"{what}: stderr was {err!r}"
    assert lines[0].startswith("mlxcc: error: "), f"{what}: {lines[0]!r}"


def test_cli_cache_info_rejects_bad_files_in_one_line(fuzz_run, capsys):
    sample = _cli_sample(fuzz_run, "info_rejected")
    assert len(sample) >= 40
    for i, (case, p) in enumerate(sample):
        argv = ["cache", "info", str(p)] + (["--json"] if i % 2 else [])
        rc = main(argv)
        out, err = capsys.readouterr()
        _assert_one_error_line(rc, err, f"#{case.index} {case.kind} ({case.what})")
        assert out == ""


def test_cli_cache_info_subprocesses(fuzz_run):
    sample = _cli_sample(fuzz_run, "info_rejected")
    step = max(1, len(sample) // CLI_SUBPROCESSES)
    for case, p in sample[::step][:CLI_SUBPROCESSES]:
        r = subprocess.run([sys.executable, "-m", "mlx_chatcache", "cache", "info", str(p)],
                           capture_output=True, text=True, timeout=120)
        _assert_one_error_line(r.returncode, r.stderr, f"#{case.index} {case.kind} ({case.what})")
        assert r.stdout == ""


@pytest.mark.skipif(not GENERATE_CLI.exists(), reason="mlxcc generate (cli/generate.py) does not exist yet")
def test_cli_generate_rejects_bad_cache_files_in_one_line(fuzz_run, make_tiny_model_dir, capsys):
    model = str(make_tiny_model_dir("llama", 0))
    sample = _cli_sample(fuzz_run, "rejected")
    assert len(sample) >= 40
    for case, p in sample:
        rc = main(["generate", "--model", model, "--prompt-cache-file", str(p), "-p", "hi", "-m", "2"])
        out, err = capsys.readouterr()
        _assert_one_error_line(rc, err, f"#{case.index} {case.kind} ({case.what})")
        assert out == ""
    # and one through the real entry point (test_cli_cache_info_subprocesses sends more)
    case, p = sample[len(sample) // 2]
    r = subprocess.run([sys.executable, "-m", "mlx_chatcache", "generate", "--model", model,
                        "--prompt-cache-file", str(p), "-p", "hi", "-m", "2"],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    _assert_one_error_line(r.returncode, r.stderr, f"#{case.index} {case.kind} ({case.what})")


@pytest.mark.slow
def test_fuzz_long(seeds, tmp_path):
    """The 10,000-file run of benchmarks/fuzz_long.py, as a test (make test-slow)."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    from fuzz_long import run

    report = run(count=10_000, seed=FUZZ_SEED + 1, workdir=tmp_path, seeds=seeds)
    print(report["table"])
    assert not report["violations"], report["violations"][:10]
