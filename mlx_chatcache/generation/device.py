"""Where generation runs: mlx-lm's device practice, on whatever device MLX uses.

Contract
--------
- :data:`generation_stream` is a stream of its own on MLX's default device (a thread-local
  one: each thread that generates gets its own, as mlx-lm's ``generation_stream``), so the
  model calls of a generate loop are queued apart from other work on the device. The loops
  (:mod:`.loop`, :mod:`.speculative`, :mod:`.batch`) run their model calls and sampling
  inside ``mx.stream(generation_stream)``; what they return is evaluated there too.
- :func:`wired_limit` ``(model)`` is a context manager: on a Metal GPU it raises MLX's
  wired-memory limit to the device's recommended working set while generating (so the
  weights stay resident) and puts the old limit back after synchronising the stream, as
  mlx-lm's ``wired_limit`` does; with a model larger than 90% of that working set it
  warns once. On other devices (CPU, CUDA) it does nothing.
Nothing here assumes a device: both work wherever MLX runs.
"""

from __future__ import annotations

import contextlib
import logging

import mlx.core as mx

log = logging.getLogger("mlxcc")

generation_stream = mx.new_thread_local_stream(mx.default_device())


def _metal() -> bool:
    metal = getattr(mx, "metal", None)
    return bool(metal is not None and metal.is_available())


def _model_bytes(model) -> int:
    params = model.parameters() if hasattr(model, "parameters") else {}
    from mlx.utils import tree_flatten

    return sum(a.nbytes for _, a in tree_flatten(params) if isinstance(a, mx.array))


@contextlib.contextmanager
def wired_limit(model):
    """MLX's wired-memory limit raised to the recommended working set while the block runs
    (Metal only; see the module docstring)."""
    if not _metal():
        yield
        return
    recommended = mx.device_info()["max_recommended_working_set_size"]
    if _model_bytes(model) > 0.9 * recommended:
        log.warning("the model takes %d MB, close to the GPU's recommended working set of %d MB: "
                    "generation may be slow", _model_bytes(model) >> 20, recommended >> 20)  # fmt: skip
    old = mx.set_wired_limit(recommended)
    try:
        yield
    finally:
        mx.synchronize(generation_stream)
        mx.set_wired_limit(old)


__all__ = ["generation_stream", "wired_limit"]
