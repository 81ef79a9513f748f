"""The worker side: PoolClient, MLX block storage, the pooled mlx-lm KV cache, serving."""

from vqpool.worker.client import PoolClient

__all__ = ["PoolClient"]
