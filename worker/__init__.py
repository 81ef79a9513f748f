"""The worker side: PoolClient, MLX block storage, the pooled mlx-lm KV cache, serving."""
