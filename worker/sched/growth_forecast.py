"""How far ahead the running rows' growth must be backed before another request starts.

With ``--reserve on-demand`` a request starts with its prompt and a block and grows a slot per
decode step. Starting one more while the pool is nearly full sets up a preemption a few steps
later: the rows outgrow the pool, and one of them throws its KV away to be recomputed. So the
scheduler starts a request beside running rows only once those rows are backed for their next
growth (:meth:`ContinuousBatch.back_ahead
<vqpool.worker.sched.continuous_batch.ContinuousBatch.back_ahead>` grows them ahead, a
look-ahead in the manner of vLLM's watermark, but sized from what this worker measured):

* **The horizon** is the measured number of decode steps between two rows ending (an
  exponential moving average): until a row ends nothing of this worker's is freed, and every
  row grows a slot per step meanwhile, so the rows need about that many slots each. Until two
  rows ended it is the most, :data:`MOST_LOOK_AHEAD_BLOCKS` blocks (nothing measured yet: be
  careful), and never more.
* **Recent refusals double it**: a growth refused (a preemption) or a reclaim ask within the
  last horizon means the pool is tight for this model (another model wants its share back): a
  model above its share is not started again at once only to give way again.
* **A refused look-ahead holds admissions** (:meth:`GrowthForecast.hold`) until a running row
  ends, none runs, or a block's worth of steps passed (memory another model frees is seen then).

It also measures how much of their ``max_tokens`` requests use (:attr:`GrowthForecast.used`, a
moving average over requests that ended by EOS, a stop string or ``max_tokens``): with
``--reserve auto`` a worker whose requests use nearly all of it reserves them whole, since
growth would save nothing of what they hold at their end and costs a round trip to vqpoold per
growth on the generation thread, and preemptions.

Generation-thread only.
"""

from __future__ import annotations

import math

MOST_LOOK_AHEAD_BLOCKS = 4
"""The most blocks per row the look-ahead asks for (a long-running lone row would else hold a
large part of the pool ahead of need)."""

SMOOTHING = 0.2
"""Weight of the newest gap between two row endings in the moving average."""

USED_SMOOTHING = 0.1
"""Weight of the newest request in the moving average of the share of ``max_tokens`` used."""


class GrowthForecast:
    """The look-ahead of one scheduler (see the module docstring).

    Args:
        block_size: Token slots per pool block.
    """

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"GrowthForecast: block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._steps = 0
        self._steps_between_ends: float | None = None  # not measured yet
        self._last_end: int | None = None
        self._refused_at: int | None = None
        self._held: tuple[int, int] | None = None  # (running then, step it expires at)
        self._used: float | None = None  # not measured yet

    @property
    def steps_between_ends(self) -> float | None:
        """The measured decode steps between two rows ending (moving average; None before
        two rows ended)."""
        return self._steps_between_ends

    @property
    def used(self) -> float | None:
        """The share of their ``max_tokens`` that ended requests generated (moving average;
        None before one ended)."""
        return self._used

    def request_ended(self, generated: int, max_tokens: int) -> None:
        """A request ended by EOS, a stop string or ``max_tokens`` after ``generated`` tokens."""
        share = min(1.0, generated / max_tokens) if max_tokens > 0 else 1.0
        if self._used is None:
            self._used = share
        else:
            self._used += USED_SMOOTHING * (share - self._used)

    def stepped(self) -> None:
        """A decode step of the batch ran."""
        self._steps += 1

    def row_ended(self) -> None:
        """A running row ended (not preempted): its memory is back."""
        if self._last_end is not None:
            gap = self._steps - self._last_end
            if self._steps_between_ends is None:
                self._steps_between_ends = float(gap)
            else:
                self._steps_between_ends += SMOOTHING * (gap - self._steps_between_ends)
        self._last_end = self._steps

    def refused(self) -> None:
        """A growth of this worker was refused, or the daemon asked bytes back."""
        self._refused_at = self._steps

    def look_ahead_slots(self) -> int:
        """Slots each running row must be able to grow by before another request starts."""
        most = MOST_LOOK_AHEAD_BLOCKS * self.block_size
        horizon = self._steps_between_ends
        if horizon is None:
            return most
        if self._refused_at is not None and self._steps - self._refused_at <= horizon:
            horizon *= 2
        return max(1, min(most, math.ceil(horizon)))

    def hold(self, running: int) -> None:
        """The look-ahead was refused with ``running`` requests running: hold admissions."""
        self._held = (running, self._steps + self.block_size)

    def holds(self, running: int) -> bool:
        """Whether admissions are held with ``running`` requests running (module docstring)."""
        if self._held is None:
            return False
        ran, until = self._held
        if running == 0 or running < ran or self._steps >= until:
            self._held = None
            return False
        return True
