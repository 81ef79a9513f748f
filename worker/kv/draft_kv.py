"""The KV of a model and its draft model (speculative decoding) in the same pool blocks.

A worker started with ``--draft-model`` keeps, per request, one pooled sequence whose layer
caches are the model's layers followed by the draft model's (mlx-lm's convention:
``make_prompt_cache(model) + make_prompt_cache(draft_model)``, which ``speculative_generate_step``
splits at ``len(model.layers)``). A block id stands for ``block_size`` token slots of *both*
models: :class:`PairedLayout` adds the two layouts' bytes, and the worker's pool session declares
that sum as its bytes per block, so the daemon's budget charges the draft's KV to the model, in
the blocks the request holds. One session carries one layout; the pair is that layout.

The two models' caches hold the same tokens within one (mlx-lm trims the draft's cache one token
less after a rejection), so the pair wastes no slot. A rejected draft token's slots are trimmed
by mlx-lm's ``trim_prompt_cache``: each layer's offset goes back, and once every layer of both
models is below a block boundary the blocks past what the tokens need (plus the sequence's
growth reserve) go back to the pool (``PooledSequence.settle``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache
from vqpool.shared.allocator import Block, Owner
from vqpool.shared.pool import BlockPool
from vqpool.worker.defaults import DEFAULT_GROWTH_WAIT
from vqpool.worker.kv.cache import PooledKVCache, PooledPromptCache, PooledSequence
from vqpool.worker.kv.cache_source import PooledCacheSource
from vqpool.worker.kv.kv_probe import unpoolable_reason
from vqpool.worker.kv.prompt_cache import PromptCache
from vqpool.worker.kv.storage import KVLayout, MLXBlockStorage, SequenceBuffers
from vqpool.worker.pool.client import PoolClient


@dataclass(frozen=True)
class PairedLayout:
    """One block's slots of the model's layers, then of the draft model's."""

    model: KVLayout
    draft: KVLayout

    def __post_init__(self) -> None:
        if self.model.block_size != self.draft.block_size:
            raise ValueError("PairedLayout: the two layouts' block sizes differ")

    @property
    def block_size(self) -> int:
        return self.model.block_size

    @property
    def n_layers(self) -> int:
        return self.model.n_layers + self.draft.n_layers

    @property
    def k_block_bytes(self) -> int:
        return self.model.k_block_bytes + self.draft.k_block_bytes

    @property
    def v_block_bytes(self) -> int:
        return self.model.v_block_bytes + self.draft.v_block_bytes

    @property
    def format(self) -> str:
        """The model's format tag (the pool's blocks are tagged with one)."""
        return self.model.format

    def layer_layout(self, layer: int) -> KVLayout:
        return self.model if layer < self.model.n_layers else self.draft

    def bytes_per_block(self, stream: str) -> int:
        """Bytes one block of ``stream`` stands for: the model's and the draft's."""
        return self.model.bytes_per_block(stream) + self.draft.bytes_per_block(stream)


def paired_layout(model: nn.Module, draft_model: nn.Module, block_size: int) -> PairedLayout:
    """The pair's layout, each read off its model (``KVLayout.from_model``).

    Raises:
        ValueError: Either model has layers the pooled cache cannot hold.
    """
    return PairedLayout(
        KVLayout.from_model(model, block_size), KVLayout.from_model(draft_model, block_size)
    )


class PairedBlockStorage:
    """A storage (``BlockStorage``) whose block ids each hold slots of two layouts: one
    :class:`MLXBlockStorage` per model under the same ids. A sequence's ``keys``/``values`` are
    the model's layers' buffers, then the draft's (the same arrays: a cache's in-place write
    lands in its model's storage)."""

    def __init__(self, layout: PairedLayout, *, separate_kv: bool = True) -> None:
        self.layout = layout
        self.separate_kv = separate_kv
        self.reclaim: Callable[[int], int] | None = None
        self._model = MLXBlockStorage(layout.model, separate_kv=separate_kv)
        self._draft = MLXBlockStorage(layout.draft, separate_kv=separate_kv)
        self._lock = threading.Lock()
        self._halves: dict[Owner, tuple[SequenceBuffers, SequenceBuffers]] = {}

    def open(self, key: Owner) -> SequenceBuffers:
        model_half = self._model.open(key)
        try:
            draft_half = self._draft.open(key)
        except BaseException:
            self._model.close(model_half)
            raise
        seq = SequenceBuffers(key)
        with self._lock:
            self._halves[key] = (model_half, draft_half)
        self._join(seq, model_half, draft_half)
        return seq

    def extend(
        self, seq: SequenceBuffers, k_block_ids: Sequence[int], v_block_ids: Sequence[int] = ()
    ) -> None:
        model_half, draft_half = self._halves_of(seq)
        kept = model_half.n_blocks
        self._model.extend(model_half, k_block_ids, v_block_ids)
        try:
            self._draft.extend(draft_half, k_block_ids, v_block_ids)
        except BaseException:
            self._model.truncate(model_half, kept)
            raise
        self._join(seq, model_half, draft_half)

    def truncate(self, seq: SequenceBuffers, n_blocks: int) -> tuple[list[int], list[int]]:
        model_half, draft_half = self._halves_of(seq)
        dropped = self._model.truncate(model_half, n_blocks)
        self._draft.truncate(draft_half, n_blocks)
        self._join(seq, model_half, draft_half)
        return dropped

    def close(self, seq: SequenceBuffers) -> None:
        """Release both models' memory of ``seq``; closing twice is a no-op."""
        with self._lock:
            halves = self._halves.pop(seq.key, None)
        if halves is None:
            return
        self._model.close(halves[0])
        self._draft.close(halves[1])
        seq.keys, seq.values = [], []

    def nbytes(self) -> int:
        """Bytes of both models' buffers."""
        return self._model.nbytes + self._draft.nbytes

    def _halves_of(self, seq: SequenceBuffers) -> tuple[SequenceBuffers, SequenceBuffers]:
        with self._lock:
            halves = self._halves.get(seq.key)
        if halves is None:
            raise ValueError(f"PairedBlockStorage: sequence {seq.key!r} is not open here")
        return halves

    @staticmethod
    def _join(
        seq: SequenceBuffers, model_half: SequenceBuffers, draft_half: SequenceBuffers
    ) -> None:
        seq.k_block_ids = model_half.k_block_ids
        seq.v_block_ids = model_half.v_block_ids
        seq.keys = [*model_half.keys, *draft_half.keys]
        seq.values = [*model_half.values, *draft_half.values]


class DraftCacheSource(PooledCacheSource):
    """Pooled caches of a model served with a draft model: each request's cache is one
    :class:`PooledSequence` over a :class:`PairedBlockStorage` (the model's layer caches, then
    the draft's), grown by the sequence itself as the forward passes write (speculative
    decoding serves one request at a time, as mlx_lm.server does, so no batch buffers)."""

    def __init__(
        self,
        model: nn.Module,
        draft_model: nn.Module,
        pool: BlockPool,
        growth_wait: float = DEFAULT_GROWTH_WAIT,
    ) -> None:
        """Raises ValueError for a draft model the pooled cache cannot hold (as the model)."""
        super().__init__(model, pool, growth_wait)
        reason = unpoolable_reason(make_prompt_cache(draft_model))
        if reason is not None:
            raise ValueError(f"--draft-model: {reason}")
        self.draft_model = draft_model
        self.paired = paired_layout(model, draft_model, pool.config.block_size)
        self._storage = PairedBlockStorage(self.paired, separate_kv=pool.config.separate_kv)
        self._sequences: dict[Owner, PooledSequence] = {}

    def attach_prompt_cache(self, **kwargs: Any) -> PromptCache:
        raise ValueError("the prompt cache holds no draft model's KV: not with --draft-model")

    def open(self, owner: str) -> list[Any]:
        sequence = PooledSequence(self.pool, owner, self._storage)
        self._sequences[owner] = sequence
        return PooledPromptCache(
            (PooledKVCache(sequence, i) for i in range(self.paired.n_layers)), sequence
        )

    def reserve(self, cache: list[Any], n_tokens: int) -> None:
        _sequence(cache).reserve(n_tokens)

    def release(self, cache: list[Any]) -> None:
        sequence = _sequence(cache)
        self._sequences.pop(sequence.owner, None)
        sequence.release()

    def n_blocks(self) -> int:
        return sum(len(s.blocks()) for s in self._sequences.values())

    def nbytes(self) -> int:
        return self._storage.nbytes()

    def take(
        self, cache: list[Any], n_tokens: int, wait: float, cancel: threading.Event | None = None
    ) -> Any:
        if cancel is None or not isinstance(self.pool, PoolClient):
            return _sequence(cache).take(n_tokens, wait)
        with self.pool.cancellable(cancel):
            return _sequence(cache).take(n_tokens, wait)

    def adopt(
        self, cache: list[Any], n_tokens: int, taken: tuple[list[Block], list[Block]] | None
    ) -> None:
        _sequence(cache).adopt(n_tokens, taken)


def _sequence(cache: list[Any]) -> PooledSequence:
    assert isinstance(cache, PooledPromptCache), "a draft source's caches come from its open()"
    return cache.sequence
