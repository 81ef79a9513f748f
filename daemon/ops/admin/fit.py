"""The daemon's side of the admin op ``fit``; what it does and takes is declared in
:mod:`vqpool.shared.protocol.admin_ops`."""

from __future__ import annotations

from typing import Any

from vqpool.daemon.budget.sequence_pricing import SequencePricing
from vqpool.daemon.ops.state import DaemonState
from vqpool.daemon.ops.worker.budget import fit_answer, fit_pricing
from vqpool.shared.kv_sequence import SequenceQuantization
from vqpool.shared.protocol import ADMIN_ARGS, FIT

PARAMS = ADMIN_ARGS[FIT]


def run(state: DaemonState, args: dict[str, Any]) -> dict[str, Any]:
    coord = state.coord
    budget = state.budget
    model = budget.resolve(args["model"]) or args["model"]
    priced = [
        s for s in coord.sessions if s.model == model and (s.bytes_per_block or s.bytes_per_format)
    ]
    new_weights = 0
    if priced:
        pricing = fit_pricing(priced[0])
    else:
        # Not loaded: priced as the client says (from the model's config), its weights added.
        block_size = coord.allocator.config.block_size
        per_block = args["bytes_per_block"]
        if per_block is None and args["bytes_per_token"] is not None:
            per_block = args["bytes_per_token"] * block_size
        if per_block is None:
            raise ValueError(
                f"no worker of model {model} is connected; its bytes per block are unknown "
                "(give bytes_per_token or bytes_per_block)"
            )
        pricing = SequencePricing({"all": per_block})
        quantized = args["quantized_bytes_per_token"]
        if quantized is not None:
            if args["bytes_per_token"] is None:
                raise ValueError("fit: quantized_bytes_per_token needs bytes_per_token")
            quantization = SequenceQuantization(
                args["quantized_kv_start"], args["first_pass_slots"]
            )
            pricing = SequencePricing(
                {"all": per_block}, {"all": quantized * block_size}, None, quantization
            )
        new_weights = args["weights"] or 0
    answer = fit_answer(state, model, pricing, args["context"], args["concurrency"], new_weights)
    return {"model": model, **answer, "format": pricing.format}
