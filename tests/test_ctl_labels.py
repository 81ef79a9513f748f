"""vqpoolctl's model labels: short, within the column, and never two alike."""

from __future__ import annotations

from vqpool.daemon.ctl.labels import elide, model_labels

LLAMA_3B = "mlx-community/Llama-3.2-3B-Instruct-4bit"
LLAMA_1B = "mlx-community/Llama-3.2-1B-Instruct-4bit"


def test_org_prefix_dropped_when_the_rest_is_distinct() -> None:
    labels = model_labels([LLAMA_3B, LLAMA_1B, "builtin:llama"], 40)
    assert labels == {
        LLAMA_3B: "Llama-3.2-3B-Instruct-4bit",
        LLAMA_1B: "Llama-3.2-1B-Instruct-4bit",
        "builtin:llama": "builtin:llama",
    }


def test_narrow_labels_keep_the_part_that_differs() -> None:
    for width in (24, 16, 12, 8):
        labels = model_labels([LLAMA_3B, LLAMA_1B], width)
        assert len(set(labels.values())) == 2, labels
        assert all(len(label) <= width for label in labels.values()), labels
        assert "3B" in labels[LLAMA_3B] and "1B" in labels[LLAMA_1B], labels
    assert model_labels([LLAMA_3B, LLAMA_1B], 20) == {
        LLAMA_3B: "Llama-3.2-3B…ct-4bit",
        LLAMA_1B: "Llama-3.2-1B…ct-4bit",
    }


def test_same_directory_name_keeps_as_many_parts_as_needed() -> None:
    labels = model_labels(["/models/a/llama", "/models/b/llama", "/x/qwen3"], 30)
    assert labels == {
        "/models/a/llama": "a/llama",
        "/models/b/llama": "b/llama",
        "/x/qwen3": "qwen3",
    }


def test_elide() -> None:
    assert elide("short", 10) == "short"
    assert elide("abcdefghijklmnop", 9) == "abcd…mnop"
    assert elide("abcdefghijklmnop", 9, keep=6) == "abcdefg…p"
    assert elide("abcdefghijklmnop", 9, keep=12) == "…ghijklm…"
