"""Simulated vLLM pods for tests and demos (`kvbridge simulate`).

``model``: a pure prefix-cache model producing each engine step's events.
``spec``: what a pod is (release, hash mode, ports, rate, faults).
``publisher``: one DP rank's publisher thread (PUB + replay ROUTER), with fault injection,
and the sent-log of every batch.
``pod``: pods and fleets, binding the sockets of every rank.
"""

from bridge.simulator.model import (
    ModelConfig,
    PrefixCacheModel,
    Prompt,
    apply_events,
    chain_hash,
    residency,
)
from bridge.simulator.pod import SimulatedFleet, SimulatedPod
from bridge.simulator.publisher import SentLog
from bridge.simulator.spec import PodSpec, RankEndpoints, default_hash_mode, resolve_hash_mode

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
