"""Defaults and limits of the worker's options, shared by the command line and the modules that
use them.

A module of constants that imports nothing heavy: ``vqpool-worker`` builds its parser and checks its
options from here before it imports mlx-lm (seconds), so ``--help`` and a bad option answer at
once.
"""

from __future__ import annotations

# The daemon and the front door price a quantizing model's first pass with it too.
from vqpool.shared.kv_sequence import DEFAULT_PREFILL_STEP_SIZE as DEFAULT_PREFILL_STEP_SIZE

DEFAULT_GROWTH_WAIT = 0.1
"""Seconds a step's growths may wait at the daemon for bytes (a few decode steps): long enough
for the budget's fair queue to count the demand and for fair-share reclaim to take bytes back
from a model above its share (an ask is answered at the victim's next step boundary, a few ms),
short enough that a refused growth still preempts promptly: the whole batch waits with it (the
tier-1 simulator's steady overload made 1,586 tok/s with 0.1 s, 1,512 with 0.15 s)."""

MAX_GROWTH_WAIT = 5.0
"""The longest ``--growth-wait`` accepted: the generation thread blocks up to this per step."""

DEFAULT_PROMPT_CACHE_BYTES = 1 << 30
"""``--prompt-cache-bytes`` when not given: 1 GiB per worker."""

DEFAULT_MLX_CACHE_LIMIT = 64 << 20
"""``--mlx-cache-limit`` when not given: 64 MiB of freed buffers MLX may keep for reuse.

The buffer cache is memory no ledger charges (the budget counts weights and KV blocks), and
MLX's own default lets it grow to the memory limit, so an idle worker could keep gigabytes of a
long prefill's transients. 64 MiB holds a decode step's transients many times over (they are
reused every step) and is half the daemon's smallest drift margin (128 MiB, docs/budget.md), so
a full cache alone never reads as drift. Larger transients (a long prefill's attention scores)
are allocated afresh each chunk: one allocation against a chunk's seconds of compute."""

RESERVE_MODES = ("on-demand", "auto", "prompt", "full")
"""What a job reserves at admission (see :mod:`vqpool.worker.sched.scheduler`)."""

DEFAULT_RESERVE = "auto"
"""``--reserve`` when not given: per request, whole reservations while the worker's requests are
measured to run to their ``max_tokens``, growth on demand while they stop early. Neither fixed
mode is the better one on every load (docs/serving.md, "Growth on demand or whole
reservations"): where every request runs to ``max_tokens`` on-demand made 0.92x the tokens of
full (rounds' ratios), auto 0.98x; where requests stop early on-demand made 1.06x, auto 1.17x."""

DEFAULT_NUM_DRAFT_TOKENS = 3
"""``--num-draft-tokens`` when not given: tokens the draft model proposes per round
(``mlx_lm.server``'s default)."""

MAX_NUM_DRAFT_TOKENS = 64
"""The most draft tokens per round a request or ``--num-draft-tokens`` may ask for
(``mlx_lm.server`` sets no bound): the model verifies them all in one forward pass, and past a
few the draft's misses make longer rounds only slower."""
