"""Models: turning a model reference (hub id, folder, GGUF file, or the offline demo model) into an
mlx-lm model and tokenizer (``loading``, ``gguf``, ``adapters``), the model's identity
(``fingerprint``: id plus hashes of weights and tokenizer) that every cache file records, how it
holds its weights on the CPU (``weights``) and how many tokens it attends to (``context``). Imports
only ``errors``/``config`` and third-party libraries; importing this package is cheap (the
submodules are not imported here).
"""
