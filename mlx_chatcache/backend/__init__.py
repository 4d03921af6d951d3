"""How MLX's backend is set up before MLX loads: on Linux with the CPU wheel,
:mod:`.blas` switches MLX's float matmuls to OpenBLAS. Standard library only
(plus :mod:`mlx_chatcache.config`); the top-level package runs it first. May
import ``config`` and ``errors`` only."""
