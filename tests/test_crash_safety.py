"""Crash safety and memory bounds of cache files (issue #5).

- **kill -9**: a process saves a few-MB cache to one path in a loop; it is
  killed at seeded random moments (>= 20 times, a new process each time, forked from
  one that imported MLX: tests/fork_server.py). After every
  kill the file loads and is exactly one version (every array holds that
  version's values), versions never go back, and what is left next to it is
  bounded. What a killed writer leaves: at most its own temp file
  ``.NAME.HOST-PID.XXXXXXXX.tmp.safetensors`` (killed between ``mkstemp`` and the
  rename); the next save to the same path removes it (its pid is dead), so
  leftovers never pile up, and one clean save leaves none.
- **full disk**: ENOSPC part-way through the write (a monkeypatch that writes
  half the file, then fails), ENOSPC from fsync, and a real kernel write failure
  (``RLIMIT_FSIZE`` in a subprocess: EFBIG): the old file stays byte-identical,
  no temp file is left, and the error is one line saying the old file is unchanged.
- **memory**: a header claiming a 2**40-element tensor is refused before any
  allocation, including as a sparse file whose apparent size matches the claim;
  loading a real 50 MB file peaks at <= 3x its size (mlx and process RSS).
"""

from __future__ import annotations

import errno
import os
import random
import re
import signal
import struct
import subprocess
import sys
import textwrap
import time
import tracemalloc
from pathlib import Path

import mlx.core as mx
import pytest
from fork_server import ForkServer

from mlx_chatcache.cache import KVCache
from mlx_chatcache.files.mlxcc_format import load_cache_file, load_prompt_cache, save_prompt_cache
from mlx_chatcache.errors import CacheFileError
from mlx_chatcache.files.atomic import TEMP_SUFFIX, remove_stale_temp_files


KILLS = 24
KILL_SEED = 5

# version v: 4 layers of keys = v, values = -v, with tokens(v) tokens (about 3-4 MB)
WRITER = textwrap.dedent(
    """
    import sys
    import mlx.core as mx
    from mlx_chatcache.cache import KVCache
    from mlx_chatcache.files.mlxcc_format import save_prompt_cache

    def tokens(v):
        return 384 + 64 * (v % 5)

    def cache(v):
        out = []
        for _ in range(4):
            c = KVCache()
            n = tokens(v)
            c.update_and_fetch(mx.full((1, 4, n, 64), float(v)), mx.full((1, 4, n, 64), -float(v)))
            out.append(c)
        return out

    path, v = sys.argv[1], int(sys.argv[2])
    if len(sys.argv) > 3:  # write one version and exit
        save_prompt_cache(path, cache(v), tokens=[v % 1000] * tokens(v), metadata={"version": str(v)})
        print("saved", flush=True)
        sys.exit(0)
    print("ready", flush=True)
    while True:
        v += 1
        save_prompt_cache(path, cache(v), tokens=[v % 1000] * tokens(v), metadata={"version": str(v)})
        print(v, flush=True)
    """
)


def _tokens(v: int) -> int:
    return 384 + 64 * (v % 5)


def _check_version(path: Path) -> int:
    """The file loads and is exactly one version, never a mix; returns it."""
    cache, info = load_cache_file(path)
    v = int(info.metadata["version"])
    assert info.tokens == [v % 1000] * _tokens(v)
    assert len(cache) == 4
    for c in cache:
        k, val = c.state
        assert k.shape == val.shape == (1, 4, _tokens(v), 64)
        assert mx.all(k == v).item() and mx.all(val == -v).item(), f"version {v} holds other values"
    return v


def _temps(path: Path) -> list[Path]:
    return sorted(path.parent.glob(f".{path.name}.*{TEMP_SUFFIX}"))


def test_kill_9_during_saves_never_leaves_a_broken_file(tmp_path):
    path = tmp_path / "cache.safetensors"
    with ForkServer("mlx.core", "mlx_chatcache.cache", "mlx_chatcache.files.mlxcc_format") as server:

        def write_once(v: int) -> None:
            pid, first = server.start(WRITER, path, v, "once")
            assert first == "saved\n" and server.reap(pid) == 0, first

        write_once(1)
        rng = random.Random(KILL_SEED)
        last, seen, max_left, mid_write = _check_version(path), set(), 0, 0
        pattern = re.compile(rf"^\.{re.escape(path.name)}\.[0-9a-f]{{6}}-(\d+)\.[a-z0-9_]{{8}}{re.escape(TEMP_SUFFIX)}$")
        for _ in range(KILLS):
            pid, first = server.start(WRITER, path, last)
            try:
                assert first == "ready\n", first
                time.sleep(rng.uniform(0.0, 0.35))
            finally:
                os.kill(pid, signal.SIGKILL)
                status = server.reap(pid)
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status  # not dead before
            v = _check_version(path)
            assert v >= last, f"the file went back from version {last} to {v}"
            last = v
            seen.add(v)
            left = _temps(path)
            for t in left:  # only temp files of killed writers (dead pids), never anything else
                m = pattern.match(t.name)
                assert m, t.name
                assert int(m.group(1)) == pid or not _alive(int(m.group(1)))
            mid_write += any(pattern.match(t.name).group(1) == str(pid) for t in left)
            max_left = max(max_left, len(left))
            # each save first removes dead writers' temp files, so only the last writer's can be here
            # (2 tolerates a dead writer's pid already reused by another process)
            assert len(left) <= 2, [t.name for t in left]
        print(f"\n{KILLS} kills: {len(seen)} distinct versions seen, last {last}, "
              f"{mid_write} kills mid-write, at most {max_left} temp files left at once")
        assert len(seen) >= 5, "the writer hardly ever finished a save: kills are not spread over the loop"
        assert mid_write >= 1, "no kill landed during a write: the test did not exercise the atomic rename"
        # one clean save (e.g. the next session turn) removes every leftover
        write_once(last + 1)
    assert _temps(path) == []
    assert _check_version(path) == last + 1


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def test_stale_temp_cleanup_is_conservative(tmp_path):
    path = tmp_path / "c.safetensors"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    from mlx_chatcache.files.atomic import _HOST

    keep = {
        "live writer (this process' parent)": f".c.safetensors.{_HOST}-{os.getppid()}.abcdefgh{TEMP_SUFFIX}",
        "other host, dead pid here": f".c.safetensors.000000-{dead.pid}.abcdefgh{TEMP_SUFFIX}",
        "untagged, fresh": f".c.safetensors.abcdefgh{TEMP_SUFFIX}",
        "temp of another file (c.safetensors.x)": f".c.safetensors.x.abcdefgh{TEMP_SUFFIX}",
        "not a temp file": "c.safetensors.bak",
        "similar name": f"c.safetensors.{_HOST}-{dead.pid}.abcdefgh{TEMP_SUFFIX}",
    }
    remove = {
        "dead writer on this host": f".c.safetensors.{_HOST}-{dead.pid}.abcdefgh{TEMP_SUFFIX}",
        "untagged, untouched for 2 hours": f".c.safetensors.a1b2c3d4{TEMP_SUFFIX}",
    }
    for name in [*keep.values(), *remove.values()]:
        (tmp_path / name).write_bytes(b"x")
    old = time.time() - 7200
    os.utime(tmp_path / remove["untagged, untouched for 2 hours"], (old, old))
    (tmp_path / "sub").mkdir()
    link = tmp_path / f".c.safetensors.zzzzzzzz{TEMP_SUFFIX}"
    os.symlink(tmp_path / "sub", link)  # old, but a link (to a folder): never followed nor removed
    os.utime(link, (old, old), follow_symlinks=False)
    save_prompt_cache(path, [KVCache()])
    left = {p.name for p in tmp_path.iterdir()}
    for what, name in keep.items():
        assert name in left, what
    for what, name in remove.items():
        assert name not in left, what
    assert (tmp_path / "sub").is_dir() and f".c.safetensors.zzzzzzzz{TEMP_SUFFIX}" in left
    assert remove_stale_temp_files(path) == []


# ---------------------------------------------------------------------- full disk
def _small_cache(v: float):
    c = KVCache()
    c.update_and_fetch(mx.full((1, 2, 64, 32), v), mx.full((1, 2, 64, 32), -v))
    return [c]


@pytest.fixture
def old_file(tmp_path):
    p = tmp_path / "cache.safetensors"
    save_prompt_cache(p, _small_cache(1.0), tokens=list(range(64)))
    return p


def _assert_full_disk_error(err: CacheFileError, path: Path) -> None:
    msg = str(err)
    assert "\n" not in msg and msg.startswith(f"could not write {path}"), msg
    assert "unchanged" in msg, msg


def test_enospc_part_way_through_the_write_keeps_the_old_file(old_file, monkeypatch):
    before = old_file.read_bytes()
    real_save = mx.save_safetensors

    def half_then_enospc(tmp, arrays, metadata=None):
        real_save(tmp, arrays, metadata or {})
        data = Path(tmp).read_bytes()
        Path(tmp).write_bytes(data[: len(data) // 2])  # the disk filled up half-way
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(mx, "save_safetensors", half_then_enospc)
    with pytest.raises(CacheFileError) as e:
        save_prompt_cache(old_file, _small_cache(2.0) * 3, tokens=list(range(64)))
    _assert_full_disk_error(e.value, old_file)
    assert "No space left on device" in str(e.value)
    assert old_file.read_bytes() == before
    assert [p.name for p in old_file.parent.iterdir()] == [old_file.name]
    monkeypatch.undo()
    assert mx.all(load_prompt_cache(old_file)[0].state[0] == 1.0).item()


def test_enospc_at_fsync_keeps_the_old_file(old_file, monkeypatch):
    before = old_file.read_bytes()

    def fsync(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # delayed allocation fails at fsync

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(CacheFileError) as e:
        save_prompt_cache(old_file, _small_cache(2.0), tokens=list(range(64)))
    _assert_full_disk_error(e.value, old_file)
    assert old_file.read_bytes() == before
    assert [p.name for p in old_file.parent.iterdir()] == [old_file.name]


@pytest.mark.parametrize("fmt", ["mlxcc", "mlx-lm"])
def test_real_write_failure_keeps_the_old_file(old_file, fmt):
    """A real kernel error mid-write: the file size limit (RLIMIT_FSIZE -> EFBIG)
    is hit part-way through writing a file larger than the old one (in both
    formats we write)."""
    before = old_file.read_bytes()
    code = textwrap.dedent(
        f"""
        import resource, signal, sys
        import mlx.core as mx
        from mlx_chatcache.cache import KVCache
        from mlx_chatcache.files.mlxcc_format import save_prompt_cache
        from mlx_chatcache.errors import CacheFileError
        c = KVCache()
        c.update_and_fetch(mx.full((1, 8, 1024, 64), 2.0), mx.full((1, 8, 1024, 64), -2.0))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, ({len(before) + 4096}, {len(before) + 4096}))
        try:
            save_prompt_cache({str(old_file)!r}, [c], format={fmt!r})
        except CacheFileError as e:
            print(e)
            sys.exit(3)
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, r.stderr
    assert len(r.stdout.splitlines()) == 1 and "unchanged" in r.stdout, r.stdout
    assert old_file.read_bytes() == before
    assert [p.name for p in old_file.parent.iterdir()] == [old_file.name]


# ---------------------------------------------------------------------- memory
def _huge_claim_header() -> bytes:
    import json

    n = 2**40  # elements: [2**20, 2**20] F32 = 4 TiB
    header = {
        "__metadata__": {
            "mlxcc.format": "mlx_chatcache", "mlxcc.format_version": "1", "mlxcc.num_layers": "1",
            "mlxcc.layer.0.class": "ArraysCache", "mlxcc.layer.0.meta": '["0", "1"]', "mlxcc.layer.0.arrays": "1",
        },
        "layer.0.0": {"dtype": "F32", "shape": [2**20, 2**20], "data_offsets": [0, 4 * n]},
    }
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw


def test_huge_tensor_claim_refused_before_allocation(tmp_path):
    p = tmp_path / "claim.safetensors"
    p.write_bytes(_huge_claim_header() + b"\0" * 64)
    active = mx.get_active_memory()
    mx.reset_peak_memory()
    tracemalloc.start()
    try:
        with pytest.raises(CacheFileError, match="byte range"):
            load_prompt_cache(p)
        py_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert mx.get_peak_memory() - active < 1 << 16
    assert py_peak < 1 << 20


def test_sparse_file_matching_a_huge_claim_is_refused_before_allocation(tmp_path):
    """The header's claim fits the file's apparent size (a sparse file), so only
    the memory check stands between it and a 4 TiB allocation. Run in a
    subprocess with an address-space limit, so a regression fails instead of
    taking the machine down."""
    p = tmp_path / "sparse.safetensors"
    head = _huge_claim_header()
    with open(p, "wb") as f:
        f.write(head)
        try:
            f.truncate(len(head) + 4 * 2**40)
        except OSError as e:
            pytest.skip(f"this filesystem has no sparse files: {e}")
    code = textwrap.dedent(
        f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))
        import mlx.core as mx
        from mlx_chatcache.files.mlxcc_format import load_prompt_cache
        from mlx_chatcache.errors import CacheFileError
        try:
            load_prompt_cache({str(p)!r})
        except CacheFileError as e:
            print(mx.get_peak_memory(), e)
            sys.exit(3)
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 3, r.stdout + r.stderr
    peak, msg = r.stdout.split(" ", 1)
    assert int(peak) < 1 << 20 and "memory" in msg


# VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec, so a child of a big
# pytest process would report the parent's RSS
MEASURE = textwrap.dedent(
    """
    import sys
    import mlx.core as mx
    from mlx_chatcache.files.mlxcc_format import load_prompt_cache

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

    mx.eval(mx.ones(4) + 1)  # initialise mlx before the baseline
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
    except OSError:
        pass
    if status("VmHWM") != status("VmRSS"):
        sys.exit(4)  # cannot reset the peak: the measure would be meaningless
    base_rss, base_mx = status("VmRSS"), mx.get_active_memory()
    mx.reset_peak_memory()
    cache = load_prompt_cache(sys.argv[1])
    print(status("VmHWM") - base_rss, mx.get_peak_memory() - base_mx)
    """
)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc to measure RSS")
def test_loading_50mb_peaks_below_3x_its_size(tmp_path):
    p = tmp_path / "big.safetensors"
    layers = []
    for i in range(6):  # 6 layers x (keys + values) of 1 x 8 x 2048 x 64 float32 = 50 MB
        c = KVCache()
        c.update_and_fetch(mx.random.normal((1, 8, 2048, 64), key=mx.random.key(i)),
                           mx.random.normal((1, 8, 2048, 64), key=mx.random.key(100 + i)))
        layers.append(c)
    save_prompt_cache(p, layers, tokens=list(range(2048)))
    size = p.stat().st_size
    assert 45e6 < size < 60e6
    script = tmp_path / "measure.py"
    script.write_text(MEASURE)
    r = subprocess.run([sys.executable, str(script), str(p)], capture_output=True, text=True, timeout=120)
    if r.returncode == 4:
        pytest.skip("cannot reset the peak RSS (/proc/self/clear_refs) to measure the load alone")
    assert r.returncode == 0, r.stderr
    rss_growth, mx_peak = map(int, r.stdout.split())
    print(f"\nloading {size / 1e6:.1f} MB: RSS +{rss_growth / 1e6:.1f} MB, mlx peak {mx_peak / 1e6:.1f} MB")
    assert mx_peak <= 3 * size
    assert rss_growth <= 3 * size
