"""Print the pool's metrics in the Prometheus text format.

These are the seed's veloxquant_block_pool_* metrics, read over the admin socket. The full set
(per-model and per-stream gauges, session and request counters, request handling time) is
served over HTTP by `vqpoold --metrics-port PORT` at http://127.0.0.1:PORT/metrics. With
--json, a map of sample name to value.
"""

from __future__ import annotations

import argparse

from prometheus_client.parser import text_string_to_metric_families
from vqpool.daemon.ctl.context import Ctl
from vqpool.daemon.ctl.exits import Exit
from vqpool.daemon.ctl.options import add_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_json(parser)


def run(ctl: Ctl, args: argparse.Namespace) -> int:
    text: str = ctl.call("metrics")
    if ctl.as_json:
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
