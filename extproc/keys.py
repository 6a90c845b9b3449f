"""Route keys: chained block hashes over the normalised prompt, scoped by model + tenant + salt.

Character blocks (``block_chars`` each) approximate the token blocks a pod caches without needing
its tokenizer; token-id prompts are hashed per ``block_chars / chars_per_token`` ids (≈ the same
span of text).
Only full blocks get keys: a pod never caches a partial block either.
"""

from __future__ import annotations

from extproc.hashing import chain_chars, chain_spans, chain_tokens, seed_key
from extproc.request import InferenceRequest

CHARS_PER_TOKEN = 4.0  # English with Llama-3/GPT tokenizers; routing.chars_per_token defaults to it


_SEEDS: dict[tuple[str, str, str], int] = {}  # request_seed's answers: few models x tenants x salts recur
_SEEDS_MAX = 4096  # clients name them: a bound, started over when reached


def request_seed(req: InferenceRequest) -> int:
    scope = (req.model or "", req.tenant, req.cache_salt or "")
    seed = _SEEDS.get(scope)
    if seed is None:
        if len(_SEEDS) >= _SEEDS_MAX:
            _SEEDS.clear()
        seed = _SEEDS[scope] = seed_key(*scope)
    return seed


def char_block_keys(text: str, seed: int, block_chars: int, max_blocks: int) -> list[int]:
    n = min(len(text) // block_chars, max_blocks)
    if n <= 0:
        return []
    if text.isascii():  # one character, one byte: encode once, the same bytes per block
        return chain_spans(seed, text[: n * block_chars].encode("ascii"), block_chars)
    return chain_chars(seed, text, block_chars, n)


def route_keys(
    req: InferenceRequest, block_chars: int, max_blocks: int, chars_per_token: float = CHARS_PER_TOKEN
) -> list[int]:
    seed = request_seed(req)
    if req.prompt_token_ids is not None:
        return chain_tokens(seed, req.prompt_token_ids, max(1, int(block_chars / chars_per_token)), max_blocks)
    return char_block_keys(req.prompt_text, seed, block_chars, max_blocks)


def route_id_key(req: InferenceRequest) -> int | None:
    """An explicit route/session id pins a conversation: its key is scoped by model and tenant too."""
    if not req.route_id:
        return None
    return seed_key("route", req.model or "", req.tenant, req.route_id)


def estimated_tokens(req: InferenceRequest, chars_per_token: float = CHARS_PER_TOKEN) -> int:
    if req.prompt_token_ids is not None:
        return len(req.prompt_token_ids)
    return int(len(req.prompt_text) / chars_per_token)
