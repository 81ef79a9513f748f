"""Development helpers for tests, benchmarks and the demo: starting vqpoold and vqpool-worker
processes, writing small model directories, a small HTTP client.

It lives under ``vqpool.worker`` because writing model directories needs the built-in models;
it may import ``vqpool.shared`` and ``vqpool.worker``, and no production module imports it.
"""
