"""Generation: running a model on a prompt cache. ``prompt`` (prefix reuse and trimming of a
``PromptCache``, the value ``files.prompt_cache`` holds), ``feed`` (the one prompt feeder), ``run`` (a
generate call's setup), ``loop`` (``generate_step``), ``speculative`` and ``drafts`` (speculative
decoding and its draft sources), ``text`` (``stream_generate``/``generate``: text in, text out),
``batch`` (decoding several caches in one model call) and ``batch_api`` (mlx-lm's ``BatchGenerator``
and ``batch_generate`` over it), ``device`` (the generation stream, the wired limit), ``model_call``
(the one door every model call goes through), ``sample`` (samplers and logits processors),
``constrain`` (grammar-constrained decoding: a JSON schema or Lark grammar as a logits processor),
``pacing`` (calls short enough for Ctrl-C), ``token_ids`` (the ids a model can take), ``arguments``
(mlx-lm's keywords), ``templates`` (chat messages or raw text to token ids), ``checkout`` (the scope
of a model and cache shape; a prompt's longest cached prefix from the store or a named file, and put
back into both), ``untokenized`` (cache files that list no token ids). May import ``store``,
``files``, ``cache``, ``models``, ``errors`` and ``config``, never ``chat`` or ``cli``. Named
``generation`` so that ``mlx_chatcache.generate`` stays the function; importing this package is
cheap (the submodules are not imported here).
"""
