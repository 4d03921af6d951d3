"""A tiered prompt-cache store: memory, local disk, Redis (shared by replicas).

Layers: :mod:`.trie` (longest shared token prefix), :mod:`.index` (entries,
byte budget, LRU, the eviction rule), :mod:`.blocks` and :mod:`.chain`
(K/V shared in blocks of tokens), :mod:`.tiers` (the interface and
``MemoryTier``), :mod:`.disk` (``DiskTier``; :mod:`.disk_folder`, its
folder), :mod:`.redis_tier` (``RedisTier``, the same interface over Redis;
:mod:`.redis_layout`, :mod:`.redis_link`, :mod:`.redis_writer`),
:mod:`.named_file` (``CacheFileTier``: one cache file
the user named, strict, carrying its messages/text and metadata),
:mod:`.store` (``PromptStore``: lookup across tiers, put into all).
Its users: ``mlxcc serve``'s generation worker (memory, disk, Redis),
``mlxcc generate`` (``--prompt-cache-file``/``--save-prompt-cache`` as a file
tier, ``--cache-dir`` as the disk tier) and chat sessions (the session file
as a file tier, ``mlxcc chat --cache-dir``), through
:mod:`mlx_chatcache.generation.checkout`. The store sits between generation and cache
files: it hands out caches and their token ids, and keeps caches it is given;
feeding and sampling stay in :mod:`mlx_chatcache.generation`. May import
``files``, ``cache``, ``models``, ``errors`` and ``config``. ``build_store``
(in :mod:`.store`) makes the tiers a server's flags ask for.
"""
