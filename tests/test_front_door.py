"""vqpool serve through real processes: routing by name, alias and label; the models list;
on-demand loads; a clean stop."""

from __future__ import annotations

import signal

from front_harness import FrontDoor

CONFIG = """
[models."tiny/llama"]
path = "builtin:llama"
aliases = ["default"]

[models."qwen"]
path = "builtin:qwen3"
keep_alive = -1
"""


def test_routes_by_name_alias_and_label_and_stops_cleanly():
    with FrontDoor(config=CONFIG) as front:
        listed = front.get("/v1/models").body["data"]
        assert [m["id"] for m in listed] == ["tiny/llama", "qwen"]
        assert {m["state"] for m in listed} == {"not_loaded"}
        for given in ("tiny/llama", "default", "llama"):
            reply = front.complete(given)
            assert reply.status == 200, reply.body
            assert reply.body["model"] == "tiny/llama"
        assert front.row("tiny/llama")["loads"] == 1
        assert front.row("qwen")["state"] == "not_loaded"
        missing = front.complete("mistral")
        assert missing.status == 404
        assert "tiny/llama" in missing.body["error"]["message"]
        assert "qwen" in missing.body["error"]["message"]
        assert front.stop(signal.SIGTERM) == 0
