"""vLLM releases and what each one puts on the wire (spec §2–§4, §10).

Only the encoder and the replay-frame builders need a release; decoding is
version-agnostic.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

_VERSION_RE = re.compile(r"v?(\d+)\.(\d+)\.(\d+)(?:\.(\d+))?")


@dataclass(frozen=True, order=True)
class Release:
    """A vLLM release ``major.minor.patch`` (post-releases such as 0.9.0.1 map to 0.9.0)."""

    major: int
    minor: int
    patch: int

    @classmethod
    def parse(cls, text: str) -> Release:
        """Parse ``"0.23.0"`` / ``"v0.33.0"``; ValueError unless in the supported range."""
        m = _VERSION_RE.fullmatch(text.strip()) if isinstance(text, str) else None
        if m is None:
            raise ValueError(
                f"invalid vLLM release {text!r}: expected MAJOR.MINOR.PATCH such as '0.23.0' "
                f"(supported: {MIN_RELEASE} to {MAX_RELEASE})"
            )
        release = cls(int(m[1]), int(m[2]), int(m[3]))
        release.check_supported()
        return release

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}"

    @property
    def is_supported(self) -> bool:
        return MIN_RELEASE <= self <= MAX_RELEASE

    def check_supported(self) -> None:
        """Raise ValueError unless this release is one whose wire format is known."""
        if self < MIN_RELEASE:
            raise ValueError(
                f"vLLM {self} has no KV-cache events (first in {MIN_RELEASE}); "
                f"supported releases: {MIN_RELEASE} to {MAX_RELEASE}"
            )
        if self > MAX_RELEASE:
            raise ValueError(
                f"vLLM {self} is newer than the newest release whose wire format is known "
                f"({MAX_RELEASE}); supported releases: {MIN_RELEASE} to {MAX_RELEASE}. "
                f"Pick the closest known release explicitly if you want to imitate it"
            )

    # --- what this release sends -------------------------------------------------------

    @property
    def has_dp_rank(self) -> bool:
        """The batch envelope has a 3rd element ``data_parallel_rank`` (0.9.1 →)."""
        return self >= _R0_9_1

    @property
    def map_events(self) -> bool:
        """Events are msgpack maps keyed by field name, tag under ``"type"`` (0.24.0 →)."""
        return self >= _R0_24_0

    @property
    def replay_has_topic(self) -> bool:
        """Replay replies carry the topic frame (0.26.0 →)."""
        return self >= _R0_26_0

    @property
    def supports_bytes_hashes(self) -> bool:
        """Hashes may be sent as raw digests (``bin``) (0.10.2 →)."""
        return self >= _R0_10_2

    def replay_sndhwm(self, buffer_steps: int) -> int | None:
        """SNDHWM of the replay ROUTER: None (ZeroMQ default 1000) before 0.33.0."""
        return 2 * (buffer_steps + 1) if self >= _R0_33_0 else None

    @cached_property
    def stored_wire_fields(self) -> tuple[WireField, ...]:
        return tuple(f for f in BLOCK_STORED_FIELDS if f.since <= self)

    @cached_property
    def removed_wire_fields(self) -> tuple[WireField, ...]:
        return tuple(f for f in BLOCK_REMOVED_FIELDS if f.since <= self)

    @property
    def stored_fields(self) -> tuple[str, ...]:
        """BlockStored field names this release sends, in declaration (array) order."""
        return tuple(f.name for f in self.stored_wire_fields)

    @property
    def removed_fields(self) -> tuple[str, ...]:
        """BlockRemoved field names this release sends, in declaration (array) order."""
        return tuple(f.name for f in self.removed_wire_fields)

    def wire_fields(self, tag: str) -> tuple[WireField, ...]:
        """Fields of event ``tag`` ("BlockStored", "BlockRemoved", "AllBlocksCleared")."""
        if tag == "BlockStored":
            return self.stored_wire_fields
        if tag == "BlockRemoved":
            return self.removed_wire_fields
        if tag == "AllBlocksCleared":
            return ()
        raise ValueError(f"unknown vLLM event type {tag!r}")


def as_release(release: Release | str) -> Release:
    """A supported Release from a Release or a version string (ValueError otherwise)."""
    if isinstance(release, Release):
        release.check_supported()
        return release
    return Release.parse(release)


@dataclass(frozen=True, slots=True)
class WireField:
    """One event field: name, first release that sends it, and whether it has a default.

    Fields with a default (None) are left out of map-form events when None;
    fields without one are always written (possibly as nil).
    """

    name: str
    since: Release
    has_default: bool


MIN_RELEASE = Release(0, 9, 0)
MAX_RELEASE = Release(0, 34, 0)
_R0_9_1 = Release(0, 9, 1)
_R0_10_2 = Release(0, 10, 2)
_R0_14_0 = Release(0, 14, 0)
_R0_17_0 = Release(0, 17, 0)
_R0_20_0 = Release(0, 20, 0)
_R0_22_0 = Release(0, 22, 0)
_R0_24_0 = Release(0, 24, 0)
_R0_26_0 = Release(0, 26, 0)
_R0_29_0 = Release(0, 29, 0)
_R0_30_0 = Release(0, 30, 0)
_R0_33_0 = Release(0, 33, 0)

# Spec §4.2, in declaration order (= array position - 1).
BLOCK_STORED_FIELDS: tuple[WireField, ...] = (
    WireField("block_hashes", MIN_RELEASE, False),
    WireField("parent_block_hash", MIN_RELEASE, False),
    WireField("token_ids", MIN_RELEASE, False),
    WireField("block_size", MIN_RELEASE, False),
    WireField("lora_id", MIN_RELEASE, False),
    WireField("medium", _R0_10_2, False),
    WireField("lora_name", _R0_14_0, False),
    WireField("extra_keys", _R0_17_0, True),
    WireField("group_idx", _R0_20_0, True),
    WireField("kv_cache_spec_kind", _R0_22_0, True),
    WireField("kv_cache_spec_sliding_window", _R0_22_0, True),
    WireField("locality", _R0_26_0, True),
    WireField("ownership", _R0_29_0, True),
    WireField("session_id", _R0_30_0, True),
    WireField("lookahead_token_ids", _R0_33_0, True),
)
BLOCK_REMOVED_FIELDS: tuple[WireField, ...] = (
    WireField("block_hashes", MIN_RELEASE, False),
    WireField("medium", _R0_10_2, False),
    WireField("group_idx", _R0_20_0, True),
    WireField("locality", _R0_26_0, True),
    WireField("ownership", _R0_29_0, True),
)

FIELDS_WITH_DEFAULT: frozenset[str] = frozenset(
    f.name for f in BLOCK_STORED_FIELDS + BLOCK_REMOVED_FIELDS if f.has_default
)
"""Field names omitted from map-form events when None (the same for both event types)."""

SUPPORTED_RELEASES: tuple[Release, ...] = (
    MIN_RELEASE,
    _R0_9_1,
    _R0_10_2,
    _R0_14_0,
    _R0_17_0,
    _R0_20_0,
    _R0_22_0,
    Release(0, 23, 0),
    _R0_24_0,
    _R0_26_0,
    _R0_29_0,
    _R0_30_0,
    _R0_33_0,
    MAX_RELEASE,
)
"""One release per wire layout boundary, oldest first (min 0.9.0, max 0.34.0).

Every release between ``MIN_RELEASE`` and ``MAX_RELEASE`` is supported, not only
these: use ``Release.is_supported`` (not ``in``) to check one.
"""


def has_default(field_name: str) -> bool:
    """Whether an event field has a default (is omitted when None in map form)."""
    return field_name in FIELDS_WITH_DEFAULT
