"""vLLM KV-event wire codec: releases, payload decoder/encoder, ZeroMQ framing (all pure)."""

from bridge.vllm.decoder import DecodeError, decode_batch, decode_event
from bridge.vllm.encoder import HashMode, encode_batch, normal_hash, wire_hash
from bridge.vllm.framing import (
    END_SEQ,
    REPLAY_END,
    FrameError,
    LiveMessage,
    ReplayBatch,
    ReplayEnd,
    live_frames,
    parse_live,
    parse_replay_reply,
    parse_replay_request,
    replay_end_frames,
    replay_reply_frames,
    replay_request,
)
from bridge.vllm.releases import MAX_RELEASE, MIN_RELEASE, SUPPORTED_RELEASES, Release

__all__ = [
    "END_SEQ",
    "MAX_RELEASE",
    "MIN_RELEASE",
    "REPLAY_END",
    "SUPPORTED_RELEASES",
    "DecodeError",
    "FrameError",
    "HashMode",
    "LiveMessage",
    "Release",
    "ReplayBatch",
    "ReplayEnd",
    "decode_batch",
    "decode_event",
    "encode_batch",
    "live_frames",
    "normal_hash",
    "parse_live",
    "parse_replay_reply",
    "parse_replay_request",
    "replay_end_frames",
    "replay_reply_frames",
    "replay_request",
    "wire_hash",
]
