"""Scheduling on the generation thread: the queue and admission, continuous batching, preemption,
and the serving counters."""
