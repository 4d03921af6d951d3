"""How a loaded model holds its weights on the CPU backend (the weight policy).

``apply_weight_policy(model, policy) -> WeightReport`` changes ``model`` in
place, once, right after loading. Policies:

- ``"float32"``: every quantized layer is dequantized to a float32
  ``nn.Linear``/``nn.Embedding`` (the same values MLX's quantized kernels
  use) and every float array becomes float32. Fastest on CPUs (one optimized
  BLAS GEMM/GEMV per layer), at 4 bytes per weight.
- ``"q"``: quantized layers stay quantized. On the CPU backend their scales
  and biases, and the model's other float arrays, become float32 (activations
  float32: MLX's float16/bfloat16 CPU kernels are slow), and each quantized
  layer dequantizes its weight on the fly for calls of at least
  :data:`~mlx_chatcache.config.PREFILL_DEQUANT_ROWS` rows (prompt chunks: one
  float32 GEMM), using MLX's quantized kernel for fewer rows (decode). A
  model without quantized layers, and every model on another backend, is left
  as loaded.
- ``"auto"``: on the CPU backend ``float32`` when the float32 weights take
  at most :data:`~mlx_chatcache.config.FLOAT32_MAX_BYTES` and a quarter of
  the machine's RAM, else ``q``; on other backends (Apple GPUs) the model is
  left as loaded.
- ``"loaded"`` (library only, for comparisons): leave the model as loaded.

The policy changes arithmetic only within float32 rounding of the same
weight values (see tests/test_weights.py for the tolerances), never the
model's fingerprint. The report is kept as ``model.weight_report``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from ..config import FLOAT32_MAX_BYTES, PREFILL_DEQUANT_ROWS
from ..errors import UsageError

POLICIES = ("q", "float32", "auto")
LIBRARY_POLICIES = (*POLICIES, "loaded")


@dataclass(frozen=True)
class WeightReport:
    requested: str  # the policy asked for
    policy: str  # what was applied: "float32", "q" or "loaded"
    reason: str
    bytes_before: int  # parameter bytes as loaded
    bytes_after: int

    def describe(self) -> str:
        def gb(n):
            return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"

        size = gb(self.bytes_after)
        if self.bytes_after != self.bytes_before:
            size += f", {self.bytes_after / max(self.bytes_before, 1):.1f}x the {gb(self.bytes_before)} as loaded"
        return f"{self.policy} ({self.reason}; weights {size})"


def parameter_bytes(model) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def _quantized_modules(model) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]


def float32_bytes(model) -> int:
    """Parameter bytes the model would take with every weight in float32."""
    quantized = dict(_quantized_modules(model))
    total = 0
    for name, value in tree_flatten(model.parameters()):
        module, _, leaf = name.rpartition(".")
        if module in quantized:
            if leaf == "weight":
                q = quantized[module]
                total += value.shape[0] * value.shape[-1] * 32 // q.bits * 4
            elif leaf == "bias":
                total += value.size * 4
        else:
            total += value.size * 4 if mx.issubdtype(value.dtype, mx.floating) else value.nbytes
    return total


def ram_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def on_cpu() -> bool:
    return mx.default_device() == mx.cpu


def choose(model, policy: str) -> tuple[str, str]:
    """``(policy to apply, why)`` for ``policy`` on this backend."""
    if policy not in LIBRARY_POLICIES:
        raise UsageError(f"unknown weight policy '{policy}'; use one of {', '.join(POLICIES)}")
    has_q = bool(_quantized_modules(model))
    if policy == "loaded":
        return "loaded", "as requested"
    if policy == "float32":
        return "float32", "as requested"
    if not on_cpu():
        return "loaded", f"{policy} on the {mx.default_device()} backend: weights as loaded"
    if policy == "q":
        return ("q", "as requested") if has_q else ("loaded", "q: the model has no quantized layers")
    need = float32_bytes(model)
    cap = min(FLOAT32_MAX_BYTES, (ram_bytes() or 4 * FLOAT32_MAX_BYTES) // 4)
    if need <= cap:
        return "float32", f"auto: float32 weights take {need / 1e6:.0f} MB <= {cap / 1e6:.0f} MB"
    if has_q:
        return "q", f"auto: float32 weights would take {need / 1e9:.1f} GB > {cap / 1e9:.1f} GB"
    return "loaded", f"auto: float32 weights would take {need / 1e9:.1f} GB > {cap / 1e9:.1f} GB"


def apply_weight_policy(model, policy: str) -> WeightReport:
    """Apply ``policy`` (see module doc) to ``model`` in place; return the report."""
    before = parameter_bytes(model)
    applied, reason = choose(model, policy)
    if applied == "float32":
        _dequantize_all(model)
        _float_arrays_to_float32(model)
    elif applied == "q":
        _float_arrays_to_float32(model)
        for _, module in _quantized_modules(model):
            prefill_class = _PREFILL_CLASSES.get(type(module))
            if prefill_class is not None:  # same state, prefill-aware __call__
                module.__class__ = prefill_class
    mx.eval(model.parameters())
    report = WeightReport(policy, applied, reason, before, parameter_bytes(model))
    model.weight_report = report
    return report


def _dequantized(module) -> mx.array:
    """The float32 weight ``(out, in)`` (or ``(vocab, dims)``) of a quantized module."""
    f32 = (lambda a: None if a is None else a.astype(mx.float32))
    return mx.dequantize(
        module["weight"], f32(module["scales"]), f32(module.get("biases")),
        module.group_size, module.bits, mode=getattr(module, "mode", "affine"),
    )  # fmt: skip


def _dequantize_all(model) -> None:
    replaced = []
    for name, module in _quantized_modules(model):
        if isinstance(module, nn.QuantizedEmbedding):
            new = nn.Embedding(1, 1)
        else:
            new = nn.Linear(1, 1, bias="bias" in module)
            if "bias" in module:
                new.bias = module["bias"].astype(mx.float32)
        new.weight = _dequantized(module)
        replaced.append((name, new))
    if replaced:
        model.update_modules(tree_unflatten(replaced))


def _float_arrays_to_float32(model) -> None:
    def cast(a):
        return a.astype(mx.float32) if mx.issubdtype(a.dtype, mx.floating) else a

    model.update(tree_map(cast, model.parameters()))


def _rows(x: mx.array) -> int:
    return x.size // x.shape[-1] if x.ndim else 0


class PrefillQuantizedLinear(nn.QuantizedLinear):
    """A quantized linear layer that multiplies prompt chunks in float32 (module doc)."""

    def __call__(self, x):  # x: (..., in) -> (..., out)
        if _rows(x) < PREFILL_DEQUANT_ROWS:
            return super().__call__(x)
        y = x @ _dequantized(self).T
        return y + self["bias"] if "bias" in self else y


class PrefillQuantizedEmbedding(nn.QuantizedEmbedding):
    """A quantized embedding whose ``as_linear`` (a tied output layer) does the same."""

    def as_linear(self, x):  # x: (..., dims) -> (..., vocab)
        if _rows(x) < PREFILL_DEQUANT_ROWS:
            return super().as_linear(x)
        return x @ _dequantized(self).T


_PREFILL_CLASSES = {
    nn.QuantizedLinear: PrefillQuantizedLinear,
    nn.QuantizedEmbedding: PrefillQuantizedEmbedding,
    PrefillQuantizedLinear: PrefillQuantizedLinear,
    PrefillQuantizedEmbedding: PrefillQuantizedEmbedding,
}
