"""The ``layers`` message's model-summary columns: sent only whole, read only well typed."""

from __future__ import annotations

from typing import Any

from tdbg.protocol.messages import layers_message
from tdbg.protocol.messages.run import read_layer_facts


def test_columns_go_out_whole_and_come_back_checked() -> None:
    facts: dict[str, Any] = {
        "types": ["Linear", "Embedding"],
        "dtypes": ["float32", "bfloat16+float32"],
        "devices": ["cuda:0", "cuda:0"],
        "bytes": [64, 128],
        "trainable": [16, 0],
        "optimizer": [0, -1],
        "extra": [1, 2],  # not a summary column: not sent
    }
    message = layers_message(["a", "b"], [16, 48], facts=facts)
    assert "extra" not in message and message["dtypes"] == ["float32", "bfloat16+float32"]
    assert read_layer_facts(message, 2) == {k: v for k, v in facts.items() if k != "extra"}
    # A column of the wrong length is not sent at all.
    assert "bytes" not in layers_message(["a", "b"], [16, 48], facts={"bytes": [1]})

    # From a peer that sends junk: each bad column left out, the good ones kept.
    junk = {
        "types": ["Linear", 3],
        "dtypes": "float32",
        "devices": ["cpu"],
        "bytes": [1, True],
        "trainable": [1.5, 2],
        "optimizer": [0, 1],
    }
    assert read_layer_facts(junk, 2) == {"optimizer": [0, 1]}
    assert read_layer_facts(["not", "a", "dict"], 2) == {}
