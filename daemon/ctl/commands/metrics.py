"""Print the pool's metrics in the Prometheus text format.

The pool-wide gauges and counters, read over the admin socket (their names are those the
VeloxQuant block pool exports, so existing dashboards keep working):

  veloxquant_block_pool_blocks_total       blocks the pool manages now (all streams)
  veloxquant_block_pool_blocks_in_use      blocks held by requests now
  veloxquant_block_pool_peak_blocks_in_use the most ever held at once
  veloxquant_block_pool_fragmentation      fraction of the pool's blocks held but not full
  veloxquant_block_pool_allocations_total  blocks handed out since the daemon started
  veloxquant_block_pool_frees_total        blocks given back
  veloxquant_block_pool_reused_total       blocks handed out again after a request gave them back
  veloxquant_block_pool_exhausted_total    allocations refused: not enough free blocks
  veloxquant_block_pool_grown_total        blocks added when the pool grew
  veloxquant_block_pool_retired_total      blocks removed for good by `vqpoolctl shrink`

The full set (per-model and per-stream gauges, session and request counters, request handling
time) is served over HTTP by `vqpoold --metrics-port PORT` at http://127.0.0.1:PORT/metrics.
With --json, a map of sample name to value.

Two name prefixes, on purpose: veloxquant_block_pool_* are the pool counters exactly as the
VeloxQuant block pool names them, kept so that its dashboards and alerts work unchanged on
vqpool; everything vqpool adds (streams, models, budget, sessions, requests) is vqpool_*.
Do not rename either set: a renamed series is a new series to Prometheus, and every dashboard
and alert on the old name goes silent.
"""

from __future__ import annotations

import argparse

from vqpool.daemon.ctl.context import Ctl
from vqpool.daemon.ctl.exits import Exit
from vqpool.daemon.ctl.options import add_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_json(parser)


def run(ctl: Ctl, args: argparse.Namespace) -> int:
    text: str = ctl.call("metrics")
    if ctl.as_json:
        # Imported here: prometheus_client takes ~30 ms to import, which every other command
        # (and --help) would pay at start-up.
        from prometheus_client.parser import text_string_to_metric_families

        ctl.print_json(
            {
                sample.name: sample.value
                for family in text_string_to_metric_families(text)
                for sample in family.samples
            }
        )
        return Exit.OK
    ctl.out.write(text)
    return Exit.OK
