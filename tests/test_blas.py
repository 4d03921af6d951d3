"""The OpenBLAS swap (mlx_chatcache.backend.blas), each case in a fresh Python process:
on by default on Linux with the CPU wheel, off with MLXCC_BLAS=off, not done
when mlx.core came first, a silent fallback when anything fails, and the
unprefixed copy made once (cached) and reused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from mlx_chatcache.backend import blas
from mlx_chatcache.backend.blas_elf import dynamic_symbols

linux_cpu = pytest.mark.skipif(
    not sys.platform.startswith("linux") or blas.bundled_blas() is None,
    reason="the swap runs on Linux with the mlx-cpu wheel only",
)

PROBE = textwrap.dedent(
    """
    import json, sys
    FIRST
    import mlx_chatcache
    from mlx_chatcache.backend import blas
    import mlx.core as mx
    a = mx.arange(64 * 64, dtype=mx.float32).reshape(64, 64) / 4096
    product = (a @ a).sum().item()
    s = blas.STATUS
    print(json.dumps({"active": s.active, "reason": s.reason, "library": s.library, "threads": s.threads,
                      "provider": blas.sgemm_provider(), "mapped": blas.mapped_blas_libraries(),
                      "product": product}))
    """
)


def probe(tmp_path, first: str = "", **env) -> tuple[dict, str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("MLXCC_BLAS", "OPENBLAS"))}
    full.setdefault("XDG_CACHE_HOME", str(tmp_path / "cache"))
    full.update(env)
    proc = subprocess.run(
        [sys.executable, "-c", PROBE.replace("FIRST", first)],
        capture_output=True, text=True, timeout=120, env=full,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout), proc.stderr


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("blas_cache"))


@linux_cpu
def test_swap_is_on_by_default_and_takes_effect(tmp_path, shared_cache):
    got, err = probe(tmp_path, XDG_CACHE_HOME=shared_cache)
    assert got["active"], got["reason"]
    assert got["library"].startswith(os.path.join(shared_cache, "mlx_chatcache", "libopenblas-"))
    assert got["provider"] == got["library"]  # cblas_sgemm resolves to our copy
    assert got["library"] in got["mapped"]
    assert got["threads"] >= 1
    assert err == ""  # silent


@linux_cpu
@pytest.mark.parametrize("value", ["off", "0", "OFF", "false"])
def test_opt_out_keeps_the_bundled_blas(tmp_path, value):
    got, _ = probe(tmp_path, MLXCC_BLAS=value)
    assert not got["active"] and "MLXCC_BLAS" in got["reason"]
    assert got["provider"] is None and not any("libopenblas-" in p for p in got["mapped"])
    assert not (tmp_path / "cache" / "mlx_chatcache").exists()  # nothing written either


@linux_cpu
def test_same_results_both_ways(tmp_path, shared_cache):
    on, _ = probe(tmp_path, XDG_CACHE_HOME=shared_cache)
    off, _ = probe(tmp_path, MLXCC_BLAS="off")
    assert on["product"] == pytest.approx(off["product"], rel=1e-5)


@linux_cpu
def test_not_done_when_mlx_core_came_first(tmp_path):
    got, _ = probe(tmp_path, first="import mlx.core")
    assert not got["active"] and "mlx.core was imported before" in got["reason"]


@linux_cpu
def test_threads_from_the_environment(tmp_path, shared_cache):
    got, _ = probe(tmp_path, XDG_CACHE_HOME=shared_cache, MLXCC_BLAS_THREADS="1")
    assert got["active"] and got["threads"] == 1


@linux_cpu
def test_failure_falls_back_silently(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")  # the cache folder cannot be made under a file
    got, err = probe(tmp_path, XDG_CACHE_HOME=str(blocker))
    assert not got["active"] and got["reason"].startswith("failed (")
    assert got["product"] > 0 and err == ""


@linux_cpu
def test_copy_is_made_once_and_reused(tmp_path):
    folder = tmp_path / "copies"
    first = blas.unprefixed_copy(blas.source_library(), folder)
    stamp = first.stat().st_mtime_ns
    again = blas.unprefixed_copy(blas.source_library(), folder)
    assert again == first and again.stat().st_mtime_ns == stamp
    assert [p.name for p in folder.iterdir()] == [first.name]  # no temp files left
    names = set(dynamic_symbols(first))
    assert {"cblas_sgemm", "openblas_set_num_threads"} <= names
    assert not any(n.startswith("scipy_") for n in names)


def test_elf_reader_refuses_other_files(tmp_path):
    path = tmp_path / "x.so"
    path.write_bytes(b"not an elf file at all")
    with pytest.raises(ValueError, match="not a 64-bit little-endian ELF"):
        dynamic_symbols(path)


def test_auto_threads_is_sane():
    assert 1 <= blas.auto_threads() <= min(os.cpu_count() or 1, 8)
