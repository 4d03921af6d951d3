"""What identifies a model: the key a cache file is paired with.

A :class:`ModelFingerprint` has three parts:

- ``model_id``: how the user named the model (a path, a hub id or a ``.gguf`` file),
  informational only: a model folder may be moved or renamed.
- ``weights_hash``: sha256 over the weight files' names, sizes and their first and
  last MiB (cheap for multi-GB models, still changes when weights change),
  plus the model config.
- ``tokenizer_hash``: sha256 over the tokenizer files and the chat template.

Two fingerprints *match* when both hashes are equal. A cache file whose fingerprint
does not match the loaded model is refused (:class:`ModelMismatchError`).

A model paired with a draft model (speculative decoding,
:class:`~mlx_chatcache.models.draft_pair.DraftPair`) has the target's fingerprint with
``draft``, the draft model's: its caches hold both models' layers, so two fingerprints
match only when their drafts match too (both none, or the same draft model), and a file
saved with a draft model is refused without it (and the reverse), in one line.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable

from ..errors import ModelMismatchError

_SAMPLE = 1 << 20  # bytes hashed from each end of a weight file


@dataclass(frozen=True)
class ModelFingerprint:
    model_id: str
    weights_hash: str
    tokenizer_hash: str
    draft: "ModelFingerprint | None" = None  # the draft model's, when paired with one

    def to_metadata(self, prefix: str = "model") -> dict[str, str]:
        meta = {
            f"{prefix}.id": self.model_id,
            f"{prefix}.weights_hash": self.weights_hash,
            f"{prefix}.tokenizer_hash": self.tokenizer_hash,
        }
        if self.draft is not None:
            meta.update(self.draft.to_metadata(f"{prefix}.draft"))
        return meta

    @classmethod
    def from_metadata(cls, meta: dict[str, str], prefix: str = "model") -> "ModelFingerprint | None":
        """The fingerprint stored in file metadata, or None if the file has none."""
        if f"{prefix}.weights_hash" not in meta:
            return None
        return cls(
            model_id=meta.get(f"{prefix}.id", ""),
            weights_hash=meta[f"{prefix}.weights_hash"],
            tokenizer_hash=meta.get(f"{prefix}.tokenizer_hash", ""),
            draft=cls.from_metadata(meta, f"{prefix}.draft") if prefix == "model" else None,
        )

    def with_draft(self, draft: "ModelFingerprint") -> "ModelFingerprint":
        """This model's fingerprint paired with draft model ``draft``."""
        return replace(self, draft=replace(draft, draft=None))

    def matches(self, other: "ModelFingerprint") -> bool:
        same_draft = (self.draft is None) == (other.draft is None) and \
            (self.draft is None or self.draft.matches(other.draft))  # fmt: skip
        return (
            self.weights_hash == other.weights_hash
            and self.tokenizer_hash == other.tokenizer_hash
            and same_draft
        )

    def check(self, stored: "ModelFingerprint | None", what: str = "cache") -> None:
        """Raise ModelMismatchError unless ``stored`` (from a file) belongs to this model."""
        if stored is None or self.matches(stored):
            return
        if replace(self, draft=None).matches(replace(stored, draft=None)):
            self._check_draft(stored, what)
        part = "weights" if stored.weights_hash != self.weights_hash else "tokenizer"
        raise ModelMismatchError(
            f"this {what} was made with model '{stored.model_id}', which differs from "
            f"the loaded model '{self.model_id}' ({part} differ); use --model "
            f"'{stored.model_id}' or start a new {what}"
        )

    def _check_draft(self, stored: "ModelFingerprint", what: str) -> None:
        """ModelMismatchError for a file of this model saved with another draft model, or none."""
        if stored.draft is None:
            raise ModelMismatchError(
                f"this {what} was saved without a draft model, so it holds no layers for draft model "
                f"'{self.draft.model_id}'; run without --draft-model or start a new {what}"
            )
        if self.draft is None:
            raise ModelMismatchError(
                f"this {what} was saved with draft model '{stored.draft.model_id}' (it holds that model's "
                f"layers too); add --draft-model '{stored.draft.model_id}' or start a new {what}"
            )
        raise ModelMismatchError(
            f"this {what} was saved with draft model '{stored.draft.model_id}', not the loaded "
            f"'{self.draft.model_id}'; use --draft-model '{stored.draft.model_id}' or start a new {what}"
        )


def hash_file_sample(h: "hashlib._Hash", path: Path) -> None:
    """Feed name, size and the first and last MiB of ``path`` into ``h``."""
    size = path.stat().st_size
    h.update(f"{path.name}:{size}:".encode())
    with open(path, "rb") as f:
        h.update(f.read(_SAMPLE))
        if size > 2 * _SAMPLE:
            f.seek(size - _SAMPLE)
            h.update(f.read(_SAMPLE))
        elif size > _SAMPLE:
            h.update(f.read())


def hash_files(paths: Iterable[Path], extra: bytes = b"", sample: bool = True) -> str:
    h = hashlib.sha256(extra)
    for p in sorted(paths, key=lambda p: p.name):
        if sample:
            hash_file_sample(h, p)
        else:
            h.update(f"{p.name}:".encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:32]


def canonical_json(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()


def folder_fingerprint(model_id: str, folder: Path) -> ModelFingerprint:
    """Fingerprint of a Hugging Face-style model folder."""
    config = json.loads((folder / "config.json").read_text())
    weights = sorted(folder.glob("*.safetensors"))
    tok_files = [
        p
        for p in folder.iterdir()
        if p.name.startswith("tokenizer") or p.name.endswith(".jinja")
        or p.name in ("special_tokens_map.json", "chat_template.json", "vocab.json", "merges.txt")
    ]
    return ModelFingerprint(
        model_id=model_id,
        weights_hash=hash_files(weights, extra=canonical_json(config)),
        tokenizer_hash=hash_files(tok_files, sample=False),
    )


def name_for(path: str | os.PathLike) -> str:
    return str(path)
