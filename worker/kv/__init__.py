"""KV memory: block storage, the pooled mlx-lm caches (single, batched, prompt cache), the cache
source the scheduler draws from, and the probes that read a model's cache layout."""
