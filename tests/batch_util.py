"""Batches a vLLM release could send, for the decoder's property tests, and their nodes."""

from __future__ import annotations

from functools import cache
from typing import Any

from bridge.simulator.model import ModelConfig, PrefixCacheModel
from bridge.vllm.encoder import encode_batch
from bridge.vllm.events import EventBatch
from bridge.vllm.releases import Release

# A small, busy cache: every event type and form within a few steps.
CONFIG = ModelConfig(
    block_size=4,
    capacity=24,
    template_tokens=(8, 40),
    suffix_tokens=(1, 12),
    gen_tokens=(1, 12),
    token_budget=64,
    clear_prob=0.05,
    cpu_offload_prob=0.3,  # offloading placeholders: block_size 0, no token ids
    repeat_prob=0.2,  # physical copies: a hash stored and removed more than once
    report_full_prob=0.1,  # 0.26+: re-announced hits
)

Path = tuple[Any, ...]


def hash_modes(release: Release) -> list[str]:
    return ["int", "signed", "bytes"] if release.supports_bytes_hashes else ["int", "signed"]


@cache
def valid_payload(release: Release, mode: str, seed: int, steps: int) -> bytes:
    """A batch vLLM ``release`` could send: the cache model's events after ``steps`` steps."""
    model = PrefixCacheModel(release, mode, seed, CONFIG)
    events: list[Any] = []
    for _ in range(steps):
        events = model.step() or events
    dp_rank = seed % 4 if release.has_dp_rank else None
    return encode_batch(EventBatch(1767225600.0 + seed, events, dp_rank), release, mode)


def paths(node: Any, path: Path = ()) -> list[tuple[Path, Any]]:
    """Every node of an unpacked msgpack value with its path (list indexes, map keys)."""
    out = [(path, node)]
    if type(node) is list:
        for i, child in enumerate(node):
            out += paths(child, (*path, i))
    elif type(node) is dict:
        for key, child in node.items():
            out += paths(child, (*path, key))
    return out
