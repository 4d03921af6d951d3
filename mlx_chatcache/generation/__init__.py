"""Generation: a prompt cache plus the exact token ids it holds (``prompt``), longest-common-prefix
reuse, the prefill/decode loop (``loop``: ``generate_step``, ``stream_generate``, ``loop``),
sampling and logits processors (``sample``), and saving/loading a fed prompt with its text or messages
(``templates``), and finding and keeping prompt caches through the store (``checkout``: the
scope of a model and settings, checkout and put, ``--cache-dir``'s tier). May import ``store``,
``files``, ``cache``, ``models``, ``errors`` and ``config``, never ``chat`` or ``cli``. Named ``generation`` so that ``mlx_chatcache.generate`` stays the function; importing this
package is cheap (the submodules are not imported here).
"""
