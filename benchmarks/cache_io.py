"""Cache file benchmark: mlx-lm's save/load_prompt_cache vs mlx_chatcache.files.mlxcc_format.

One command (from the repository root):

    .venv/bin/python benchmarks/cache_io.py                 # prints the table
    .venv/bin/python benchmarks/cache_io.py --write-results # also updates RESULTS.md
    .venv/bin/python benchmarks/cache_io.py --checksums     # only the checksums' cost

For caches of 1k, 4k and 16k tokens of a mid-size model shape (16 layers, 8 KV
heads x 128 dims, float16) filled with random K/V through ``update_and_fetch``
(the same content in an mlx-lm cache and in ours), it measures per file:

- file size, save time (ours is atomic: temp file + fsync + rename; mlx-lm's
  writes in place without fsync, so a column also shows mlx-lm + fsync);
- load time with every array evaluated (``mx.eval``), warm (file in the page
  cache) and cold (page cache dropped before every load via
  ``/proc/sys/vm/drop_caches``; reported as "n/a" when that is not permitted);
- ``cat FILE > /dev/null`` time for the same file, warm and cold: the limit no
  loader can beat;
- for quantized caches (ours and mlx-lm's, 8, 6 and 4 bits, group 64) the relative
  error of the attention output computed from the loaded cache with random
  queries (mlx-lm's own quantized attention) against the float cache;
- with ``--model-check`` (default on), the next-token logit error of the demo
  model (SmolLM2) when its float prompt cache is replaced by a quantized one,
  and how far that real cache compresses losslessly (zlib, lzma).

Every loaded cache is compared with the cache that was saved (bit-exact for
float, same packed arrays for quantized): a fast but wrong loader fails loudly.

This file also holds the helpers the other benchmark scripts share (machine
description, table formatting, RESULTS.md sections, OpenBLAS re-exec).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"

# =================================================================== shared helpers


def maybe_reexec_openblas(argv: list[str], auto: bool = False) -> None:
    """With ``--openblas``, ``MLXCC_BENCH_OPENBLAS=1`` or ``auto``, re-run this process
    with ``LD_PRELOAD`` of Debian's OpenBLAS so MLX's float matmuls use it instead
    of the reference BLAS bundled in the mlx-cpu wheel (every engine gets it)."""
    want = auto or "--openblas" in argv or os.environ.get("MLXCC_BENCH_OPENBLAS") == "1"
    if not want or OPENBLAS in os.environ.get("LD_PRELOAD", ""):
        return
    if not Path(OPENBLAS).exists():
        if auto:
            return
        sys.exit(f"--openblas: {OPENBLAS} not found; run 'apt-get install -y libopenblas0-pthread'")
    env = dict(os.environ, LD_PRELOAD=(OPENBLAS + " " + os.environ.get("LD_PRELOAD", "")).strip())
    if auto:
        env["MLXCC_BENCH_OPENBLAS_AUTO"] = "1"
    os.execve(sys.executable, [sys.executable, *argv], env)


def blas_in_use() -> str:
    """Which BLAS this process has mapped (call after MLX ran a matmul)."""
    import mlx.core as mx

    from mlx_chatcache.backend import blas

    if blas.STATUS.active:  # mlx_chatcache was imported before mlx.core: its OpenBLAS swap
        return blas.describe()

    a = mx.ones((8, 8))
    mx.eval(a @ a)
    libs = set()
    try:
        for line in open("/proc/self/maps"):
            parts = line.split()
            if len(parts) >= 6 and re.search(r"blas", parts[-1], re.I):
                libs.add(parts[-1])
    except OSError:
        return "unknown"
    if any("openblas" in p for p in libs) and OPENBLAS in os.environ.get("LD_PRELOAD", ""):
        return "OpenBLAS 0.3 pthread (LD_PRELOAD over the wheel's reference BLAS)"
    if any("mlx_cpu.libs" in p for p in libs):
        return "reference (netlib) BLAS bundled in the mlx-cpu wheel"
    return ", ".join(sorted(Path(p).name for p in libs)) or "none mapped"


def machine_info(blas: str | None = None) -> dict[str, str]:
    """The machine and software a benchmark ran on; ``blas``: the BLAS that did the
    measured work, when not this process's (:func:`blas_in_use`), e.g. its servers'."""
    import mlx.core as mx

    try:
        import mlx_lm

        lm_version = mlx_lm.__version__
    except Exception:  # pragma: no cover
        lm_version = "not installed"
    cpu = platform.processor() or "unknown"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram = "unknown"
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal"):
                ram = f"{int(line.split()[1]) / 2**20:.1f} GiB"
                break
    except OSError:
        pass
    os_name = platform.system()
    try:
        for line in open("/etc/os-release"):
            if line.startswith("PRETTY_NAME="):
                os_name = line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return {
        "cpu": f"{cpu}, {os.cpu_count()} cores",
        "ram": ram,
        "os": f"{os_name}, Linux {platform.release()}, {platform.machine()}",
        "python": platform.python_version(),
        "mlx": f"{mx.__version__} ({mx.default_device()})",
        "mlx-lm": lm_version,
        "blas": blas or blas_in_use(),
        "load average at start (1/5/15 min)": "%.2f / %.2f / %.2f" % os.getloadavg()
        + " (the 2 cores are shared with other work: engines are interleaved so both see it)",
    }


def command_line() -> str:
    argv = [a for a in sys.argv if a != "--write-results"]
    script = os.path.relpath(argv[0], HERE.parent) if argv else ""
    pre = ""
    if (OPENBLAS in os.environ.get("LD_PRELOAD", "") and "--openblas" not in argv
            and not os.environ.get("MLXCC_BENCH_OPENBLAS_AUTO")):
        pre = "MLXCC_BENCH_OPENBLAS=1 "
    for name in ("MLXCC_BLAS", "MLXCC_BLAS_THREADS"):  # they change what is measured
        if name in os.environ:
            pre += f"{name}={shlex.quote(os.environ[name])} "
    return pre + ".venv/bin/python " + " ".join(shlex.quote(a) for a in [script, *argv[1:]])


def header_block(title: str, blas: str | None = None) -> str:
    """A results section's heading and its date, command and machine lines
    (``blas``: see :func:`machine_info`)."""
    info = machine_info(blas)
    lines = [
        f"### {title}",
        "",
        f"- date: {_dt.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}",
        f"- command: `{command_line()}`",
    ]
    lines += [f"- {k}: {v}" for k, v in info.items()]
    return "\n".join(lines) + "\n"


def md_table(headers: list[str], rows: list[list]) -> str:
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    def line(vals):
        return "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"
    out = [line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in cells]
    return "\n".join(out) + "\n"


def write_results_section(name: str, text: str, path: Path = RESULTS) -> None:
    """Replace (or append) the block between ``<!-- BEGIN name -->`` and
    ``<!-- END name -->`` in ``path``."""
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    block = f"{begin}\n{text.rstrip()}\n{end}"
    old = path.read_text() if path.exists() else "# Benchmark results\n"
    if begin in old and end in old:
        pre, rest = old.split(begin, 1)
        _, post = rest.split(end, 1)
        new = pre + block + post
    else:
        new = old.rstrip() + "\n\n" + block + "\n"
    path.write_text(new)
    print(f"wrote section '{name}' of {path}")


def bench_parser(doc: str, argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, list[str]]:
    """A benchmark's start: its arguments (this process's when None), after re-running
    under OpenBLAS when asked (:func:`maybe_reexec_openblas`), and its parser (described
    by ``doc``'s first paragraph) holding the flags every benchmark takes:
    --write-results, --results and --openblas."""
    argv = sys.argv[1:] if argv is None else argv
    maybe_reexec_openblas([sys.argv[0], *argv])
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--write-results", action="store_true", help="update benchmarks/RESULTS.md")
    ap.add_argument("--results", type=Path, default=RESULTS, help="RESULTS.md to update")
    ap.add_argument("--openblas", action="store_true", help="LD_PRELOAD Debian's OpenBLAS")
    return ap, argv


def finish(name: str, out: str, args, t_start: float) -> int:
    """A benchmark's end: print its section ``out`` with the time since ``t_start``; with
    --write-results, put it in RESULTS.md (``args.results``) as section ``name``. Returns 0."""
    out += f"\n(total {time.perf_counter() - t_start:.0f} s)\n"
    print(out)
    if args.write_results:
        write_results_section(name, out, args.results)
    return 0


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def fmt_ms(s: float | None) -> str:
    if s is None or s != s:
        return "n/a"
    return f"{s * 1e3:.1f}" if s < 10 else f"{s * 1e3:.0f}"


def drop_page_cache() -> bool:
    """Drop Linux's page cache (needs root and a writable /proc/sys); True on success."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


# =================================================================== the benchmark

L_LAYERS, KV_HEADS, HEAD_DIM = 16, 8, 128
GROUP = 64


def _fill(n_tokens: int, seed: int):
    """Our KVCache list and mlx-lm's, holding the same random float16 K/V."""
    import mlx.core as mx
    from mlx_lm.models import cache as lmc

    from mlx_chatcache import cache as cc

    mx.random.seed(seed)
    shape = (1, KV_HEADS, n_tokens, HEAD_DIM)
    base_k = mx.random.normal(shape, dtype=mx.float16)
    base_v = mx.random.normal(shape, dtype=mx.float16)
    ours, theirs = [], []
    for i in range(L_LAYERS):
        # distinct per layer, cheaper than fresh normals: rolled along the sequence and rescaled
        k = mx.roll(base_k, 37 * i, axis=2) * (1 + 0.05 * i)
        v = mx.roll(base_v, 53 * i, axis=2) * (1 - 0.02 * i)
        a, b = cc.KVCache(), lmc.KVCache()
        a.update_and_fetch(k, v)
        b.update_and_fetch(k, v)
        mx.eval(a.eval_arrays(), b.keys, b.values)
        ours.append(a)
        theirs.append(b)
    return ours, theirs


def _arrays_of(cache) -> list:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    return [a for _, a in tree_flatten([c.state for c in cache]) if isinstance(a, mx.array)]


def _stored_slots(path) -> int:
    """Token slots the file stores per K/V array (live tokens + any room)."""
    from mlx_chatcache.files.safetensors_file import read_header

    return max(t.shape[2] for t in read_header(path).tensors.values() if len(t.shape) == 4)


def _live_kv(c):
    """(keys, values) holding exactly the live tokens, for either library's cache."""
    from mlx.utils import tree_map

    k, v = c.keys, c.values
    return tree_map(lambda x: x[..., : c.offset, :], (k if not isinstance(k, list) else tuple(k),
                                                      v if not isinstance(v, list) else tuple(v)))


def _same_content(a, b) -> bool:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    for x, y in zip(a, b):
        fx = [t for _, t in tree_flatten(_live_kv(x))]
        fy = [t for _, t in tree_flatten(_live_kv(y))]
        if x.offset != y.offset or len(fx) != len(fy):
            return False
        if not all(p.shape == q.shape and mx.array_equal(p, q).item() for p, q in zip(fx, fy)):
            return False
    return len(a) == len(b)


def _attention_error(float_cache, quant_cache, seed: int = 1) -> float:
    """Max over layers of ||o_q - o_f|| / ||o_f|| for a random query (4 q heads per
    KV head, like a GQA model), o_q computed from the dequantized K/V (MLX's CPU
    quantized matmul is far too slow at 16k tokens; the stored values are the same)."""
    import mlx.core as mx

    mx.random.seed(seed)
    scale = HEAD_DIM**-0.5
    worst = 0.0
    for f, q in zip(float_cache, quant_cache):
        kf, vf = _live_kv(f)
        kq, vq = (mx.dequantize(*x, group_size=q.group_size, bits=q.bits).astype(mx.float16)
                  for x in _live_kv(q))
        queries = mx.random.normal((1, 4 * KV_HEADS, 1, HEAD_DIM)).astype(mx.float16)
        of = mx.fast.scaled_dot_product_attention(queries, kf, vf, scale=scale, mask=None)
        oq = mx.fast.scaled_dot_product_attention(queries, kq, vq, scale=scale, mask=None)
        of, oq = of.astype(mx.float32), oq.astype(mx.float32)
        worst = max(worst, (mx.linalg.norm(oq - of) / mx.linalg.norm(of)).item())
    return worst


def _cat_time(path: Path, cold: bool) -> float | None:
    if cold and not drop_page_cache():
        return None
    t0 = time.perf_counter()
    with open(path, "rb") as src, open(os.devnull, "wb") as dst:
        subprocess.run(["cat"], stdin=src, stdout=dst, check=True)
    return time.perf_counter() - t0


def _load_for(engine: str, path):
    """Load ``path`` as ``engine`` does, every array evaluated."""
    import mlx.core as mx
    from mlx_lm.models import cache as lmc

    from mlx_chatcache.files import mlxcc_format

    if engine == "mlx-lm":
        c = lmc.load_prompt_cache(str(path))
        mx.eval(_arrays_of(c))
    else:
        c = mlxcc_format.load_prompt_cache(path)
        mx.eval([x.eval_arrays() for x in c])
    return c


def _append_one(cache) -> None:
    import mlx.core as mx

    one = mx.ones((1, KV_HEADS, 1, HEAD_DIM), dtype=mx.float16)
    mx.eval([x.update_and_fetch(one, one) for x in cache])


def fresh_job(engine: str, path: str) -> int:
    """Worker (a new process): load, then append one token; print both times."""
    import json

    import mlx.core as mx
    from mlx_lm.models import cache as _lmc  # noqa: F401  (imports outside the clock)

    from mlx_chatcache.files import mlxcc_format as _io  # noqa: F401

    mx.eval(mx.zeros(4) + 1)  # MLX initialised before the clock starts
    t0 = time.perf_counter()
    c = _load_for(engine, path)
    t1 = time.perf_counter()
    _append_one(c)
    print(json.dumps({"load": t1 - t0, "append": time.perf_counter() - t1, "peak": mx.get_peak_memory()}))
    return 0


def fresh_process_time(engine: str, path: Path) -> tuple[float, float, int]:
    """(load, load + one appended token) timed inside a new process (no warm
    allocator: what resuming a saved chat pays), and that process's MLX peak memory."""
    import json

    out = subprocess.run([sys.executable, __file__, "--fresh-job", engine, str(path)],
                         capture_output=True, text=True, check=True)
    j = json.loads(out.stdout.strip().splitlines()[-1])
    return j["load"], j["load"] + j["append"], j["peak"]


def bench_size(n_tokens: int, folder: Path, repeats: int, cold_repeats: int, bits_list,
               fresh_repeats: int = 0):
    import mlx.core as mx
    from mlx_lm.models import cache as lmc

    from mlx_chatcache import cache as cc
    from mlx_chatcache.files import mlxcc_format

    ours, theirs = _fill(n_tokens, seed=n_tokens)
    variants = [("f16", ours, theirs)]
    for bits in bits_list:
        oq = cc.quantize_prompt_cache(cc.copy_prompt_cache(ours), GROUP, bits)
        tq = [c.to_quantized(group_size=GROUP, bits=bits) for c in theirs]
        mx.eval([c.eval_arrays() for c in oq], _arrays_of(tq))
        variants.append((f"q{bits}", oq, tq))

    def lm_save_fsync(p, c):
        lmc.save_prompt_cache(str(p), c)
        with open(p, "rb+") as f:
            os.fsync(f.fileno())

    engines = {
        "mlx-lm": (lambda p, c: lmc.save_prompt_cache(str(p), c), lambda p: _load_for("mlx-lm", p)),
        "mlxcc": (lambda p, c: mlxcc_format.save_prompt_cache(p, c), lambda p: _load_for("mlxcc", p)),
    }
    rows = []
    for tag, ours_c, theirs_c in variants:
        caches = {"mlx-lm": theirs_c, "mlxcc": ours_c}
        paths = {e: folder / f"{e}-{tag}-{n_tokens}.safetensors" for e in engines}
        t = {e: {k: [] for k in ("save", "fsync", "warm", "fresh_load", "fresh", "peak", "cold", "cat_w", "cat_c")}
             for e in engines}
        loaded = {}
        # interleaved: both engines run under the same (shared, noisy) machine load,
        # the order alternating between repeats
        for r in range(max(repeats, cold_repeats)):
            order = list(engines) if r % 2 == 0 else list(engines)[::-1]
            if r < repeats:
                for e in order:
                    save = engines[e][0]
                    t0 = time.perf_counter()
                    save(paths[e], caches[e])
                    t[e]["save"].append(time.perf_counter() - t0)
                    if e == "mlx-lm":
                        t0 = time.perf_counter()
                        lm_save_fsync(paths[e], caches[e])
                        t[e]["fsync"].append(time.perf_counter() - t0)
                os.sync()  # both files fully written back before any load is timed
                for e in order:
                    load = engines[e][1]
                    loaded[e] = None  # as in a fresh load: the previous result is not kept alive
                    load(paths[e])  # page cache warm, allocator warm
                    t0 = time.perf_counter()
                    loaded[e] = load(paths[e])
                    t[e]["warm"].append(time.perf_counter() - t0)
                    t[e]["cat_w"].append(_cat_time(paths[e], cold=False))
            for e in order:
                if r < cold_repeats and drop_page_cache():
                    t0 = time.perf_counter()
                    engines[e][1](paths[e])
                    t[e]["cold"].append(time.perf_counter() - t0)
                    if r == 0:  # the disk does not get faster: once per file
                        t[e]["cat_c"].append(_cat_time(paths[e], cold=True))
        for r in range(fresh_repeats):
            for e in list(engines) if r % 2 == 0 else list(engines)[::-1]:
                load_s, total_s, peak = fresh_process_time(e, paths[e])
                t[e]["fresh_load"].append(load_s)
                t[e]["fresh"].append(total_s)
                t[e]["peak"].append(peak)
        res = {}
        for e in engines:
            if not _same_content(caches[e], loaded[e]):
                raise SystemExit(f"{e} {tag} {n_tokens}: the loaded cache differs from the saved one")
            res[e] = {k: (median(v) if v else None) for k, v in t[e].items()}
            res[e].update(size=paths[e].stat().st_size, stored=_stored_slots(paths[e]),
                          err=_attention_error(ours, loaded[e]) if tag != "f16" else 0.0)
            paths[e].unlink()
        lm = res["mlx-lm"]
        for e in engines:
            r = res[e]
            rows.append(dict(tokens=n_tokens, tag=tag, engine=e, **r,
                             size_vs_lm=r["size"] / lm["size"],
                             warm_speed=lm["warm"] / r["warm"],
                             fresh_load_speed=(lm["fresh_load"] / r["fresh_load"]) if r["fresh"] else None,
                             fresh_speed=(lm["fresh"] / r["fresh"]) if r["fresh"] else None,
                             cold_speed=(lm["cold"] / r["cold"]) if r["cold"] and lm["cold"] else None))
    return rows


def checksum_cost(sizes, folder: Path, repeats: int) -> str:
    """What the files' CRC32 checksums cost: our float16 file loaded (every array
    evaluated) with its checksums verified vs a copy without them (the same bytes,
    the two keys stripped, as a version 3 file: nothing to verify), saved with and
    without them, and zlib.crc32's own speed over the file's bytes."""
    import json
    import struct
    import zlib

    from mlx_chatcache.files import atomic, mlxcc_format
    from mlx_chatcache.files.checksum import HEADER_KEY, TENSORS_KEY

    def stripped(data: bytes) -> bytes:
        (n,) = struct.unpack("<Q", data[:8])
        h = json.loads(data[8 : 8 + n])
        for k in (HEADER_KEY, TENSORS_KEY):
            h["__metadata__"].pop(k)
        h["__metadata__"]["mlxcc.format_version"] = "3"
        new = json.dumps(h, separators=(",", ":")).encode()
        return struct.pack("<Q", len(new)) + new + data[8 + n :]

    def save_without(path, cache):
        saved = atomic.checksummed, atomic.seal_file
        atomic.checksummed, atomic.seal_file = (lambda arrays, meta: meta), (lambda tmp: None)
        try:
            mlxcc_format.save_prompt_cache(path, cache)
        finally:
            atomic.checksummed, atomic.seal_file = saved

    rows = []
    for n in sizes:
        ours, _ = _fill(n, seed=n)
        on, off = folder / f"sums-{n}.safetensors", folder / f"nosums-{n}.safetensors"
        t = {k: [] for k in ("save_on", "save_off", "on", "off", "crc")}
        saves = (("save_on", mlxcc_format.save_prompt_cache), ("save_off", save_without))
        for r in range(repeats):
            for key, save in saves[:: 1 - 2 * (r % 2)]:
                t0 = time.perf_counter()
                save(on if key == "save_on" else off, ours)
                t[key].append(time.perf_counter() - t0)
        data = on.read_bytes()
        off.write_bytes(stripped(data))
        os.sync()
        for r in range(repeats):
            for key, path in ((("on", on), ("off", off))[:: 1 - 2 * (r % 2)]):
                _load_for("mlxcc", path)  # page cache and allocator warm
                t0 = time.perf_counter()
                c = _load_for("mlxcc", path)
                t[key].append(time.perf_counter() - t0)
                if not _same_content(ours, c):
                    raise SystemExit(f"checksums {n}: the loaded cache differs from the saved one")
                del c
            t0 = time.perf_counter()
            zlib.crc32(data)
            t["crc"].append(time.perf_counter() - t0)
        m = {k: median(v) for k, v in t.items()}
        mb = len(data) / 1e6
        rows.append([n, f"{mb:.1f}", fmt_ms(m["save_off"]), fmt_ms(m["save_on"]), fmt_ms(m["off"]), fmt_ms(m["on"]),
                     f"{(m['on'] - m['off']) * 1e3:+.1f} ({(m['on'] / m['off'] - 1) * 100:+.0f} %)",
                     f"{mb / m['off']:.0f}", f"{mb / m['on']:.0f}", f"{mb / m['crc']:.0f}"])
        on.unlink()
        off.unlink()
    out = header_block("Cache files: cost of the CRC32 checksums") + "\n"
    out += (f"Our float16 file ({L_LAYERS} layers x {KV_HEADS} KV heads x {HEAD_DIM} dims); medians of {repeats} "
            "interleaved in-process runs. 'without': the same file with the checksum keys stripped (a version 3 "
            "file: nothing to verify) and saved with the checksum step switched off; loads evaluate every array, "
            "warm page cache. 'crc32 MB/s': zlib.crc32 over the file's bytes alone.\n\n")
    out += md_table(["tokens", "file MB", "save ms without", "save ms with", "load ms without", "load ms with",
                     "load cost ms", "load MB/s without", "load MB/s with", "crc32 MB/s"], rows)
    return out


def lossless_ratios(arrays) -> dict[str, float]:
    """Compressed / raw size of ``arrays`` as float16 bytes, as stored, and with the
    two bytes of every element split into two planes (exponent bytes together),
    under zlib level 9 and lzma preset 6: what a lossless cache file could save."""
    import lzma
    import zlib

    import mlx.core as mx
    import numpy as np

    raw = b"".join(np.array(a.astype(mx.float16)).tobytes() for a in arrays)
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 2).T.tobytes()
    out = {}
    for layout, data in (("as stored", raw), ("byte planes", planes)):
        out[f"zlib-9, {layout}"] = len(zlib.compress(data, 9)) / len(raw)
        out[f"lzma-6, {layout}"] = len(lzma.compress(data, preset=6)) / len(raw)
    return out


def model_check(prompt_tokens: int, bits_list) -> tuple[list[list], dict[str, float]]:
    """Next-token logits of the demo model with a quantized vs float prompt cache,
    and how far its float16 K/V compress losslessly."""
    import mlx.core as mx

    from mlx_chatcache import cache as cc
    from mlx_chatcache.models.loading import demo_model_path, load

    path = demo_model_path()
    if path is None:
        return [], {}
    model, tok = load(str(path), weights="loaded")  # the GGUF as loaded, as recorded before the weight policy
    text = (
        "The history of computing is a story of machines that remember. Early computers "
        "stored programs on punched cards, then on magnetic drums and core memory. "
    ) * 40
    ids = tok.encode(text)[:prompt_tokens]
    cache = cc.make_prompt_cache(model)
    mx.eval(model(mx.array([ids[:-1]]), cache=cache))
    ref = model(mx.array([ids[-1:]]), cache=cc.copy_prompt_cache(cache))[0, -1].astype(mx.float32)
    ref_p = mx.softmax(ref)
    rows = []
    for bits in bits_list:
        q = cc.quantize_prompt_cache(cc.copy_prompt_cache(cache), GROUP, bits)
        out = model(mx.array([ids[-1:]]), cache=q)[0, -1].astype(mx.float32)
        p = mx.softmax(out)
        kl = mx.sum(ref_p * (mx.log(ref_p + 1e-30) - mx.log(p + 1e-30))).item()
        rel = (mx.linalg.norm(out - ref) / mx.linalg.norm(ref)).item()
        top1 = int(mx.argmax(out).item() == mx.argmax(ref).item())
        rows.append([f"q{bits} (group {GROUP})", len(ids), f"{rel:.2e}",
                     f"{mx.max(mx.abs(out - ref)).item():.3f}", f"{kl:.2e}", "yes" if top1 else "NO"])
    return rows, lossless_ratios([a for c in cache for a in c.flat_state()])


def repeats_for(n: int, args) -> tuple[int, int]:
    warm = args.repeats if args.repeats is not None else 5
    cold = args.cold_repeats if args.cold_repeats is not None else 3
    return warm, cold


def main(argv=None) -> int:
    ap, argv = bench_parser(__doc__, argv)
    ap.add_argument("--tokens", default="1000,4000,16000",
                    help="comma-separated cache sizes (default 1000,4000,16000)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="warm timings per measurement (median; default 5)")
    ap.add_argument("--cold-repeats", type=int, default=None,
                    help="cold-cache timings (median; default 3)")
    ap.add_argument("--bits", default="8,6,4", help="quantized variants (default 8,6,4)")
    ap.add_argument("--model-check", action=argparse.BooleanOptionalAction, default=True,
                    help="measure the demo model's logit error with a quantized cache")
    ap.add_argument("--model-prompt", type=int, default=160, help="prompt tokens for --model-check")
    ap.add_argument("--fresh-repeats", type=int, default=3,
                    help="loads timed in new processes (median; default 3, 0 = skip)")
    ap.add_argument("--checksums", action="store_true",
                    help="only measure what the files' checksums cost (save and load, with and without)")
    ap.add_argument("--fresh-job", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.fresh_job:
        return fresh_job(*args.fresh_job)
    sizes = [int(x) for x in args.tokens.split(",") if x]
    if args.checksums:
        with tempfile.TemporaryDirectory(prefix="mlxcc-bench-", dir=os.environ.get("MLXCC_BENCH_DIR")) as d:
            out = checksum_cost(sizes, Path(d), repeats_for(0, args)[0])
        print(out)
        if args.write_results:
            write_results_section("cache_io_checksums", out, args.results)
        return 0
    bits_list = [int(x) for x in args.bits.split(",") if x]

    # probe (and only then drop the page cache) when cold runs are asked for
    can_drop = any(repeats_for(n, args)[1] > 0 for n in sizes) and drop_page_cache()
    t_start = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="mlxcc-bench-", dir=os.environ.get("MLXCC_BENCH_DIR")) as d:
        for n in sizes:
            warm_n, cold_n = repeats_for(n, args)
            rows += bench_size(n, Path(d), warm_n, cold_n if can_drop else 0, bits_list, args.fresh_repeats)
            print(f"[cache_io] {n} tokens done ({time.perf_counter() - t_start:.0f} s)", file=sys.stderr)

    headers = ["tokens", "cache", "engine", "tokens stored", "file MB", "size / mlx-lm",
               "save ms", "mlx-lm save+fsync ms", "load ms warm", "load ms cold",
               "load speed / mlx-lm (warm, cold)", "new process: load ms", "speed / mlx-lm",
               "new process: load + 1 token ms", "speed / mlx-lm",
               "cat ms warm", "cat ms cold", "attn rel err"]
    table = []
    for r in rows:
        table.append([
            r["tokens"], r["tag"], r["engine"], r["stored"], f"{r['size'] / 1e6:.2f}",
            f"{r['size_vs_lm']:.3f}", fmt_ms(r["save"]), fmt_ms(r["fsync"]) if r["fsync"] else "",
            fmt_ms(r["warm"]), fmt_ms(r["cold"]),
            f"{r['warm_speed']:.2f}x, " + (f"{r['cold_speed']:.2f}x" if r["cold_speed"] else "n/a"),
            fmt_ms(r["fresh_load"]) if r["fresh"] else "", f"{r['fresh_load_speed']:.2f}x" if r["fresh"] else "",
            fmt_ms(r["fresh"]) if r["fresh"] else "", f"{r['fresh_speed']:.2f}x" if r["fresh"] else "",
            fmt_ms(r["cat_w"]), fmt_ms(r["cat_c"]),
            "-" if r["tag"] == "f16" else f"{r['err']:.2e}",
        ])
    out = header_block("Cache files: save / load / size") + "\n"
    out += (f"Shape: {L_LAYERS} layers x {KV_HEADS} KV heads x {HEAD_DIM} dims, float16 "
            f"(quantized: affine, group {GROUP}); medians of "
            + ", ".join(f"{n}: {repeats_for(n, args)[0]} warm / {repeats_for(n, args)[1] if can_drop else 0} cold"
                        for n in sizes)
            + " runs (cold cat: 1 run), engines interleaved; "
            + ("cold = page cache dropped before each run (`echo 3 > /proc/sys/vm/drop_caches`)."
               if can_drop else "no cold-cache runs: none asked, or dropping the page cache is not "
               "permitted here (warm-cache numbers only).")
            + " 'size / mlx-lm' and 'load speed / mlx-lm' compare with mlx-lm's file of the same "
            "cache at the same precision (speed > 1: ours faster). attn rel err: max over layers of "
            "the relative L2 error of the attention output (random GQA query, dequantized K/V) vs "
            "the float cache. 'new process': timed inside a fresh Python process per run (imports "
            "done first; no warm allocator: what resuming a saved chat pays); 'load + 1 token' "
            "adds one token appended to every layer, what a resume does before its first forward "
            "(mlx-lm's file carries its buffers' room to the next 256-token step, so it is written "
            "in place; ours holds exactly the tokens, 'tokens stored', and our loader reads them "
            "into buffers with that room, so it is written in place too). In-process warm loads depend on which buffers the allocator has kept from "
            "earlier runs (we saw either loader take 20 or 80 ms for the same 4k file depending on "
            "what ran before it), so the new-process columns are the ones to compare.\n\n")
    out += md_table(headers, table)
    f16 = {(r["tokens"], r["engine"]): r for r in rows if r["tag"] == "f16"}
    q_rows = {(r["tokens"], r["tag"]): r for r in rows if r["engine"] == "mlxcc" and r["tag"] != "f16"}
    summary = []
    for n in sizes:
        lm = f16[(n, "mlx-lm")]
        parts = [f"{n} tokens: our f16 file {f16[(n, 'mlxcc')]['size'] / lm['size']:.3f}x mlx-lm's"]
        for b in bits_list:
            parts.append(f"q{b} {q_rows[(n, f'q{b}')]['size'] / lm['size']:.3f}x")
        ours = f16[(n, "mlxcc")]
        parts.append(f"our f16 load speed {ours['warm_speed']:.2f}x warm, "
                     + (f"{ours['cold_speed']:.2f}x cold, " if ours["cold_speed"] else "")
                     + (f"{ours['fresh_load_speed']:.2f}x in a new process (load + 1 token "
                        f"{ours['fresh_speed']:.2f}x; MLX peak memory {ours['peak'] / 1e6:.0f} MB, "
                        f"mlx-lm {lm['peak'] / 1e6:.0f} MB)" if ours["fresh"] else ""))
        summary.append("- " + "; ".join(parts))
    out += "\nvs mlx-lm's float16 file of the same cache:\n" + "\n".join(summary) + "\n"
    if args.model_check:
        mrows, lossless = model_check(args.model_prompt, bits_list)
        if mrows:
            out += ("\nDemo model (SmolLM2-135M-Instruct Q4_1 GGUF, 30 layers x 3 KV heads x 64 dims) "
                    "next-token logits with a quantized vs float prompt cache:\n\n")
            out += md_table(["cache", "prompt tokens", "logits rel L2 err", "max |dlogit|",
                             "KL(float||quant)", "same top-1"], mrows)
            out += ("\nThe same real cache as float16, compressed losslessly (compressed / raw size; "
                    "a lossless file cannot go below these): "
                    + ", ".join(f"{k} {v:.3f}" for k, v in lossless.items()) + "\n")
    return finish("cache_io", out, args, t_start)


if __name__ == "__main__":
    sys.exit(main())
