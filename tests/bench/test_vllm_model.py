"""bench.vllm_model's sizes: the small model is the tiny one made wider and deeper, with the same
tokenizer, and the real-vLLM pods size their KV cache in blocks whichever one they serve."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bench.vllm_model
from bench.vllm_model import MODEL_CONFIG, SIZES, build
from bench.vllm_pods import BLOCK_SIZE, kv_bytes_per_block


@pytest.fixture(autouse=True)
def few_training_files(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tokenizer trained on a few stdlib files: seconds less per build, the same code path."""
    files = bench.vllm_model.training_files(limit_bytes=200_000)
    monkeypatch.setattr(bench.vllm_model, "training_files", lambda: files)


def test_small_model_is_wider_and_deeper_with_the_same_tokenizer(tmp_path: Path) -> None:
    tiny, small = build(tmp_path / "tiny"), build(tmp_path / "small", size="small")
    t, s = (json.loads((d / "config.json").read_text()) for d in (tiny, small))
    assert t["hidden_size"] == MODEL_CONFIG["hidden_size"]
    assert s["hidden_size"] > t["hidden_size"] and s["num_hidden_layers"] > t["num_hidden_layers"]
    assert s["hidden_size"] // s["num_attention_heads"] == s["head_dim"] == t["head_dim"]  # a size CPU attention takes
    assert (tiny / "tokenizer.json").read_bytes() == (small / "tokenizer.json").read_bytes()
    # The stamp holds the size: asking the tiny directory for the small model rebuilds it.
    assert (tiny / ".built").read_text() != (small / ".built").read_text()
    build(tmp_path / "tiny", size="small")
    assert json.loads((tiny / "config.json").read_text())["hidden_size"] == SIZES["small"]["hidden_size"]


def test_unknown_size_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown model size 'huge': one of tiny, small"):
        build(tmp_path / "m", size="huge")


def test_kv_bytes_per_block_follows_the_model(tmp_path: Path) -> None:
    for size, cfg in SIZES.items():
        (tmp_path / size).mkdir()
        (tmp_path / size / "config.json").write_text(json.dumps(cfg))
    # K+V x layers x KV heads x head_dim x 4 bytes x block
    assert kv_bytes_per_block(str(tmp_path / "tiny")) == 2 * 2 * 2 * 32 * 4 * BLOCK_SIZE == 32 << 10
    assert kv_bytes_per_block(str(tmp_path / "small")) == 2 * 4 * 8 * 32 * 4 * BLOCK_SIZE == 256 << 10
