"""Simulated vLLM pods for tests and demos (`kvbridge simulate`).

``model``: a pure prefix-cache model producing each engine step's events.
``pod``: real ZeroMQ PUB + replay ROUTER publishers per DP rank, with fault injection.
"""

from bridge.simulator.model import (
    ModelConfig,
    PrefixCacheModel,
    Prompt,
    apply_events,
    chain_hash,
    residency,
)
from bridge.simulator.pod import (
    PodSpec,
    RankEndpoints,
    SentLog,
    SimulatedFleet,
    SimulatedPod,
    default_hash_mode,
    resolve_hash_mode,
)

__all__ = [
    "ModelConfig",
    "PodSpec",
    "PrefixCacheModel",
    "Prompt",
    "RankEndpoints",
    "SentLog",
    "SimulatedFleet",
    "SimulatedPod",
    "apply_events",
    "chain_hash",
    "default_hash_mode",
    "residency",
    "resolve_hash_mode",
]
