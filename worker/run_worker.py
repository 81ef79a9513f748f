"""Run one ``vqpool-worker`` whose options :mod:`vqpool.worker.serve` has checked: bind the port,
load the model, open the pool session, wire the parts (cache source, prompt cache, scheduler,
HTTP app) and serve until the stop event is set; then stop them in order.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from vqpool.shared.config import resolve_run_dir
from vqpool.shared.errors import DaemonUnavailableError
from vqpool.shared.kv_disk import kv_disk_directory
from vqpool.shared.kv_sequence import SequenceQuantization
from vqpool.shared.model_weights import worker_overhead
from vqpool.shared.pool import DEFAULT_BLOCK_SIZE
from vqpool.shared.protocol import session_label
from vqpool.worker.api.http_api import ServingApp, ServingServer, make_server
from vqpool.worker.api.openai_api import ServedOptions
from vqpool.worker.defaults import DEFAULT_GROWTH_WAIT, DEFAULT_PREFILL_STEP_SIZE
from vqpool.worker.kv.batch_probe import batching_problem
from vqpool.worker.kv.cache_source import CacheSource, PooledCacheSource, StockCacheSource
from vqpool.worker.kv.disk_format import model_fingerprint
from vqpool.worker.kv.disk_store import DiskStore
from vqpool.worker.kv.disk_writer import DiskWriter
from vqpool.worker.kv.draft_kv import DraftCacheSource, PairedLayout, paired_layout
from vqpool.worker.kv.prompt_cache import PromptCache
from vqpool.worker.kv.quantized import KVQuantization, QuantizedKVLayout
from vqpool.worker.kv.storage import KVLayout
from vqpool.worker.models.loading import LoadedModel, load_model
from vqpool.worker.models.memory import MemoryProbe, apply_cache_limit, weights_bytes
from vqpool.worker.pool.client import PoolClient
from vqpool.worker.sched.scheduler import Scheduler

log = logging.getLogger("vqpool.worker")

MAX_OWNER_PREFIX_CHARS = 96
"""Owner ids are ``{model}-{pid}-{n}`` and the daemon takes ids of up to 128 characters."""


def run_worker(args: argparse.Namespace, stop: threading.Event) -> int:
    """Serve as ``args`` say until ``stop`` is set; the exit status (1: the port is taken or the
    daemon does not answer, 2: a model that does not load or that the pooled cache cannot
    serve)."""
    try:
        server = make_server(args.host, args.port)
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", args.host, args.port, exc)
        return 1
    try:
        return _serve(args, server, stop)
    finally:
        server.server_close()
        mx.clear_streams()  # the main thread's too (mlx-lm made its stream here at import)


def _bytes_per_block(layout: KVLayout | PairedLayout | QuantizedKVLayout) -> dict[str, int]:
    return {s: layout.bytes_per_block(s) for s in ("k", "v", "kv")}


def _weights(model: nn.Module, draft_model: nn.Module | None) -> int:
    """Bytes of the parameters the worker holds: its model's and its draft model's."""
    return weights_bytes(model) + (0 if draft_model is None else weights_bytes(draft_model))


def _layout(
    model: nn.Module, draft_model: nn.Module | None, block_size: int
) -> KVLayout | PairedLayout:
    if draft_model is None:
        return KVLayout.from_model(model, block_size)
    return paired_layout(model, draft_model, block_size)


def open_pool(
    run_dir: str | None,
    name: str,
    model: nn.Module,
    timeout: float,
    growth_wait: float = DEFAULT_GROWTH_WAIT,
    draft_model: nn.Module | None = None,
    quantization: KVQuantization | None = None,
    overhead: int | None = None,
    prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE,
) -> tuple[PoolClient, PooledCacheSource]:
    """A daemon session reporting this model's bytes per block (with a draft model: the
    model's and the draft's, which share each block), weights (both models') and
    ``overhead`` (bytes held beyond weights and KV, charged with them; None: not declared),
    and its cache source. With ``quantization`` (``--kv-bits``) the session also declares the
    bytes of a block of each format its sequences hold: full precision before
    ``--quantized-kv-start``, quantized after (``bytes_per_format``); ``prefill_step_size``
    is the scheduler's prefill chunk (the most full-precision slots a quantizing request's first
    pass holds).

    Raises:
        ValueError: A model the pooled cache cannot serve, or cannot quantize so.
    """
    weights = _weights(model, draft_model)
    if quantization is not None and draft_model is not None:
        raise ValueError("--kv-bits with a --draft-model needs --no-pool (see vqpool-worker)")

    def connect(block_size: int) -> PoolClient:
        layout = _layout(model, draft_model, block_size)
        per_block = _bytes_per_block(layout)
        per_format: dict[str, Any] | None = None
        if quantization is not None:
            assert isinstance(layout, KVLayout)
            quantized = quantization.layout(layout)
            per_format = {
                layout.format: per_block,
                quantized.format: _bytes_per_block(quantized),
            }
        return PoolClient(
            run_dir,
            name=name,
            bytes_per_block=per_block,
            bytes_per_format=per_format,
            timeout=timeout,
            weights=weights,
            overhead=overhead,
            quantization=(
                None
                if quantization is None
                else SequenceQuantization.of(quantization.start, prefill_step_size)
            ),
        )

    pool = connect(DEFAULT_BLOCK_SIZE)  # ValueError for a model of another shape
    if pool.config.block_size != DEFAULT_BLOCK_SIZE:
        # Bytes per block depend on the daemon's block size, known only after hello.
        pool.close()
        pool = connect(pool.config.block_size)
    try:
        if draft_model is not None:
            return pool, DraftCacheSource(model, draft_model, pool, growth_wait)
        return pool, PooledCacheSource(
            model, pool, growth_wait, quantization, prefill_step_size=prefill_step_size
        )
    except BaseException:
        pool.close()
        raise


def _serve(args: argparse.Namespace, server: ServingServer, stop: threading.Event) -> int:
    """Load the model, open the pool, serve on ``server`` until ``stop``; the exit status."""
    # Bounded before loading, whose transients would otherwise fill MLX's buffer cache.
    apply_cache_limit(args.mlx_cache_limit)
    try:
        loaded = load_model(args.model, seed=args.seed, adapter_path=args.adapter_path)
        draft = _load_draft(args.draft_model, loaded)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    draft_model = None if draft is None else draft.model
    memory = MemoryProbe(_weights(loaded.model, draft_model))
    served_name = args.served_model_name or loaded.name
    max_concurrent = args.max_concurrent
    batching = None if draft is not None else batching_problem(loaded.model)
    if batching is not None and max_concurrent > 1:
        log.warning("%s: decoding one request at a time (--max-concurrent 1)", batching)
        max_concurrent = 1
    if draft is not None:
        # As mlx_lm.server: a model with a draft model is not batchable.
        log.info("draft model %s: speculative decoding, one request at a time", draft.name)
        max_concurrent = 1
    stock_quantization = _quantization(args) if args.no_pool else None
    if stock_quantization is not None:
        try:  # a head dimension its group does not divide fails here, not in a request
            for quantized_model in (loaded.model, draft_model):
                if quantized_model is not None:
                    layout = KVLayout.from_model(quantized_model, DEFAULT_BLOCK_SIZE)
                    stock_quantization.layout(layout)
        except ValueError as exc:
            log.error("--kv-bits: %s", exc)
            return 2
        # As mlx_lm.server: --kv-bits turns batching off; mlx-lm quantizes each request's
        # stock cache (QuantizedKVCache).
        log.info("--kv-bits over stock caches (--no-pool): one request at a time")
        max_concurrent = 1
    pool: PoolClient | None = None
    source: CacheSource
    describe_pool: Callable[[], dict[str, Any]]
    if args.no_pool:
        source = StockCacheSource(loaded.model, draft_model)

        def describe_pool() -> dict[str, Any]:
            return {"pool": "off"}
    else:
        try:
            pool, source = open_pool(
                args.run_dir,
                served_name,
                loaded.model,
                args.pool_timeout,
                args.growth_wait,
                draft_model,
                _quantization(args),
                worker_overhead(args.mlx_cache_limit) if args.charge_mlx_cache else None,
                args.prefill_step_size,
            )
        except ValueError as exc:
            log.error("%s", exc)
            return 2
        except DaemonUnavailableError as exc:
            log.error("%s", exc)
            return 1
        session = pool
        pool.report_memory(memory.sample)

        def describe_pool() -> dict[str, Any]:
            sid = session.session_id
            described: dict[str, Any] = {
                "pool": "vqpoold",
                "run_dir": str(session.run_dir),
                "session": None if sid is None else session_label(sid),
                "block_size": session.config.block_size,
            }
            problem = session.session_problem()
            if problem is not None:
                described["pool_error"] = problem
            return described

    # Logged once the model is known to be servable: a refusal stays the one line it says.
    log.info(
        "%s loaded: %d bytes of weights; MLX buffer cache limited to %d bytes",
        loaded.name,
        memory.weights,
        args.mlx_cache_limit,
    )
    owner_prefix = f"{served_name[:MAX_OWNER_PREFIX_CHARS]}-{os.getpid()}"
    prompt_cache: PromptCache | None = None
    # The prompt cache keeps the model's KV only; a draft's requests would miss the draft's.
    if (
        pool is not None
        and isinstance(source, PooledCacheSource)
        and draft is None
        and args.prompt_cache_bytes
    ):
        pooled, client = source, pool
        try:
            disk = open_disk_tier(args, served_name, loaded.model, source.layout, pool)
        except OSError as exc:  # the directory cannot be made or read: say so in one line
            log.error("--kv-disk-dir: %s", exc)
            pool.close()
            return 2

        def report_cache(counters: dict[str, int]) -> None:
            client.report_prompt_cache(counters)
            # Entries may go on another thread (the daemon's advice): /v1/stats follows.
            scheduler.stats.set_memory(pooled.n_blocks(), pooled.nbytes())

        prompt_cache = source.attach_prompt_cache(
            owner_prefix=owner_prefix,
            max_bytes=args.prompt_cache_bytes,
            report=report_cache,
            lost_owners=pool.lost_owners,
            disk=disk,
        )
        pool.on_advice = prompt_cache.follow_advice
    elif args.kv_disk_bytes:
        log.warning(
            "--kv-disk-bytes ignored: the disk tier keeps prompt-cache entries and this worker "
            "has no prompt cache (--prompt-cache-bytes 0, --no-pool or --draft-model)"
        )
    scheduler = Scheduler(
        loaded.model,
        source,
        owner_prefix=owner_prefix,
        eos_token_ids=loaded.tokenizer.eos_token_ids,
        max_concurrent=max_concurrent,
        max_queue=args.max_queue,
        queue_timeout=args.queue_timeout,
        reserve=args.reserve,
        headroom_slots=1 if pool is None else pool.config.block_size,
        lost_owners=None if pool is None else pool.lost_owners,
        prefill_step_size=args.prefill_step_size,
        prompt_cache=prompt_cache,
        block_size=DEFAULT_BLOCK_SIZE if pool is None else pool.config.block_size,
        draft_model=draft_model,
        stock_quantization=stock_quantization,
    )
    if prompt_cache is not None:
        prompt_cache.report()
    if pool is not None:
        # Reclaim asks from the daemon: the prompt cache, then requests preempted at the next
        # step boundary, give the bytes back.
        pool.set_reclaim_handler(scheduler.give_back)
    app = ServingApp(
        loaded,
        scheduler,
        args.max_tokens,
        args.max_tokens_limit,
        describe_pool,
        served_name,
        allowed_origins=args.allowed_origins,
        options=ServedOptions(
            draft_names=_names(args.draft_model),
            num_draft_tokens=args.num_draft_tokens,
            adapter_names=_names(args.adapter_path),
        ),
    )
    if pool is not None:
        app.pool_unavailable = pool.daemon_unavailable
    server.serve(app)
    scheduler.start()
    serving = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="vqpool-http"
    )
    serving.start()
    host, port = str(server.server_address[0]), int(server.server_address[1])
    mode = "stock mlx-lm caches (--no-pool)" if pool is None else f"pool at {pool.run_dir}"
    # The ready line, on stdout whatever --log-level says: scripts wait for it (and learn the
    # port it chose with --port 0).
    print(f"vqpool-worker: serving {served_name} on http://{host}:{port} ({mode})", flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        log.info("stopping")
        server.shutdown()
        serving.join()
        scheduler.stop()
        if prompt_cache is not None:  # writes the entries its disk tier lacks
            prompt_cache.close()
        if pool is not None:  # its goodbye frees the prompt cache's blocks too
            pool.close()
    return 0


def _quantization(args: argparse.Namespace) -> KVQuantization | None:
    """``--kv-bits`` / ``--kv-group-size`` / ``--quantized-kv-start`` (checked by
    :mod:`vqpool.worker.serve`); None without ``--kv-bits``."""
    if args.kv_bits is None:
        return None
    return KVQuantization(args.kv_bits, args.kv_group_size, args.quantized_kv_start)


def open_disk_tier(
    args: argparse.Namespace, served_name: str, model: nn.Module, layout: KVLayout, pool: PoolClient
) -> DiskWriter | None:
    """The prompt cache's disk tier (``--kv-disk-bytes``, ``--kv-disk-dir``), or None."""
    if not args.kv_disk_bytes:
        return None
    directory = kv_disk_directory(resolve_run_dir(args.run_dir), served_name, args.kv_disk_dir)
    quantization = _quantization(args)
    fingerprint = model_fingerprint(
        model,
        layout,
        pool.config.separate_kv,
        None if quantization is None else quantization.format,
    )
    store = DiskStore(directory, args.kv_disk_bytes, fingerprint, layout.block_size)
    log.info(
        "prompt cache on disk: up to %d bytes in %s (model fingerprint %s)",
        args.kv_disk_bytes,
        directory,
        fingerprint[:16],
    )
    return DiskWriter(store)


def _load_draft(spec: str | None, loaded: LoadedModel) -> LoadedModel | None:
    """The draft model, checked against the model: mlx_lm.server only warns when the
    vocabularies differ, but a draft token the model does not have would fail its rounds."""
    if spec is None:
        return None
    draft = load_model(spec, option="--draft-model")
    if draft.vocab_size != loaded.vocab_size:
        raise ValueError(
            f"--draft-model {spec}: its vocabulary has {draft.vocab_size} tokens and the "
            f"model's {loaded.vocab_size}; a draft model needs the model's tokenizer"
        )
    return draft


def _names(spec: str | None) -> tuple[str, ...]:
    """The names a request may give ``spec`` (a path as typed, and resolved); () for none."""
    if spec is None:
        return ()
    resolved = os.path.abspath(os.path.expanduser(spec))
    return (spec, resolved) if resolved != spec and os.path.exists(resolved) else (spec,)
