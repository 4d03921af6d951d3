"""A tiered prompt-cache store of content-addressed values: memory, local disk,
Redis (shared by replicas, standalone or a cluster).

Modules: :mod:`.chain` (the keys: a hash chain over blocks of token ids),
:mod:`.values` (a value: one checksummed cache file as bytes; a cache cut into
block values and put together again), :mod:`.tiers` (the tier interface and
``MemoryTier``), :mod:`.disk` (``DiskTier``: a folder of value files),
:mod:`.redis_tier` (``RedisTier``; :mod:`.redis_link`, its connection),
:mod:`.store` (``PromptStore``: checkout across tiers, put into all; ``Scope``;
``build_store``, the tiers a server's flags ask for). Each tier evicts by itself.
Its users: ``mlxcc serve``'s generation worker (memory, disk, Redis), and
``mlxcc generate``/``mlxcc chat`` with ``--cache-dir`` (the disk tier), through
:mod:`mlx_chatcache.generation.checkout`. The store hands out caches and their
token ids and keeps caches it is given; feeding and sampling stay in
:mod:`mlx_chatcache.generation`. May import ``files``, ``cache``, ``models``,
``errors`` and ``config``.
"""
