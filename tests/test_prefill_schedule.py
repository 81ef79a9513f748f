"""When a newcomer's prefill runs between the batch's decode steps (``ContinuousBatch.step``): one
chunk per step, the running rows get a token every step, and a newcomer joins in the step of its
last chunk (its last prompt token goes with that chunk), so its first token comes one step
later. A separate step for the last prompt token cost the running rows one more decode step per
newcomer, at small batch sizes while a burst of requests was being prefilled."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
from mlx_lm.generate import batch_generate
from vqpool.shared.allocator import BlockPoolAllocator, PoolConfig
from vqpool.worker.kv.cache_source import CacheSource, PooledCacheSource, StockCacheSource
from vqpool.worker.models.loading import load_model
from vqpool.worker.sched.continuous_batch import ContinuousBatch, StepOutcome
from vqpool.worker.sched.scheduler import GenerationJob

MODEL = load_model("builtin:llama").model
CHUNK = 4


class NoTokenizer:
    eos_token_ids: tuple[int, ...] = ()

    def decode(self, tokens: list[int]) -> str:
        return ""


def make_pooled() -> CacheSource:
    return PooledCacheSource(
        MODEL, BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=512, separate_kv=True))
    )


SOURCES: dict[str, Callable[[], CacheSource]] = {
    "stock": lambda: StockCacheSource(MODEL),
    "pooled": make_pooled,
}


def start(
    batch: ContinuousBatch, source: CacheSource, prompt: list[int], rank: int
) -> GenerationJob:
    job = GenerationJob(prompt, 40, owner=f"job-{rank}", admission=rank)
    job.cache = source.open(f"job-{rank}")
    source.reserve(job.cache, len(prompt) + job.max_tokens)
    batch.start(job)
    return job


def tokens_of(outcome: StepOutcome, job: GenerationJob) -> list[int]:
    return [token for j, token, _ in outcome.tokens if j is job]


@pytest.mark.parametrize("source_kind", SOURCES)
@pytest.mark.parametrize("prompt_length", [1, 3, 5, 9, 13])
def test_a_newcomer_joins_in_the_step_of_its_last_chunk(
    source_kind: str, prompt_length: int
) -> None:
    source = SOURCES[source_kind]()
    batch = ContinuousBatch(MODEL, source, eos_token_ids=frozenset(), prefill_step_size=CHUNK)
    running_prompt = [5, 9, 2]
    running = start(batch, source, running_prompt, 1)
    batch.step()  # its prefill and join: its first token comes with the next decode step
    got = {running: tokens_of(batch.step(), running)}
    assert len(got[running]) == 1

    prompt = [1 + (i * 7) % 200 for i in range(prompt_length)]
    newcomer = start(batch, source, prompt, 2)
    got[newcomer] = []
    # Prefilled: every prompt token but the last, CHUNK per step; the last chunk carries the
    # last prompt token, so the newcomer is in the batch after that many steps (one at least).
    prefill_steps = max(1, math.ceil((prompt_length - 1) / CHUNK))
    steps = 0
    while not got[newcomer]:
        outcome = batch.step()
        steps += 1
        assert not (outcome.failed or outcome.preempted or outcome.evicted)
        # The running row is never held up by more than the one chunk of a step.
        assert len(tokens_of(outcome, running)) == 1
        got[running] += tokens_of(outcome, running)
        got[newcomer] += tokens_of(outcome, newcomer)
    assert steps == prefill_steps + 1

    while len(got[newcomer]) < 6:
        outcome = batch.step()
        got[running] += tokens_of(outcome, running)
        got[newcomer] += tokens_of(outcome, newcomer)
    # Joining one step sooner changes no token.
    reference = batch_generate(
        MODEL, NoTokenizer(), [running_prompt, prompt], max_tokens=40, return_token_ids=True
    ).token_ids
    for job in (running, newcomer):
        assert got[job] == reference[job.admission - 1][: len(got[job])]
        batch.leave(job)
        source.release(job.cache)
