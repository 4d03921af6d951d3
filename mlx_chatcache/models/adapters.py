"""LoRA/DoRA (or full fine-tune) adapters applied to a loaded model, as mlx-lm does it.

An adapter folder holds ``adapter_config.json`` and ``adapters.safetensors``
(what ``mlx_lm.lora`` writes). :func:`apply_adapters` loads it onto a model
with mlx-lm's own ``load_adapters`` (one :class:`ModelLoadError` line for a
bad folder). :func:`with_adapter` folds the adapter files into the model
fingerprint's weights hash, so a cache made with the base model never pairs
with the adapted one (nor with another adapter) and the other way round.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..errors import ModelLoadError, one_line
from .fingerprint import ModelFingerprint, hash_files

ADAPTER_FILES = ("adapter_config.json", "adapters.safetensors")


def check_adapter_dir(adapter_path: str) -> Path:
    folder = Path(adapter_path).expanduser()
    missing = [n for n in ADAPTER_FILES if not (folder / n).is_file()]
    if missing:
        raise ModelLoadError(
            f"not an adapter folder: {adapter_path} has no {' or '.join(missing)}; pass the folder "
            "mlx_lm.lora wrote (--adapter-path)"
        )
    return folder


def apply_adapters(model, adapter_path: str):
    """``model`` with the adapters in ``adapter_path`` applied (mlx-lm's loader), in eval mode."""
    from mlx_lm.tuner.utils import load_adapters

    folder = check_adapter_dir(adapter_path)
    try:
        model = load_adapters(model, str(folder))
    except Exception as e:  # bad config, shapes that do not fit the model, ...
        detail = one_line(f"{type(e).__name__}: {e}", 300)
        raise ModelLoadError(f"could not apply the adapters in {adapter_path} ({detail}); "
                             "were they trained for this model?") from e  # fmt: skip
    model.eval()
    return model


def with_adapter(fp: ModelFingerprint, adapter_path: str) -> ModelFingerprint:
    """``fp`` of the base model changed to identify the base model plus this adapter."""
    folder = check_adapter_dir(adapter_path)
    adapter_hash = hash_files([folder / n for n in ADAPTER_FILES])
    combined = hash_files([], extra=f"{fp.weights_hash}+adapter:{adapter_hash}".encode())
    return replace(fp, model_id=f"{fp.model_id} + adapter {adapter_path}", weights_hash=combined)


__all__ = ["apply_adapters", "with_adapter", "check_adapter_dir"]
