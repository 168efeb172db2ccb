"""What a simulated vLLM pod is: release, hash mode, ports, rate and faults (:class:`PodSpec`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from bridge.simulator.model import ModelConfig
from bridge.vllm.releases import Release, as_release

_HASH_MODES = ("int", "signed", "bytes")


def default_hash_mode(release: Release) -> str:
    """vLLM's default: signed ``hash()`` ints before 0.10.2, unsigned 64-bit ints from it."""
    return "int" if release.supports_bytes_hashes else "signed"


def resolve_hash_mode(release: Release, hash_mode: str | None) -> str:
    """The hash mode to use for ``release``; ValueError for one that release cannot send."""
    if hash_mode is None:
        return default_hash_mode(release)
    if hash_mode not in _HASH_MODES:
        raise ValueError(f"unknown hash mode {hash_mode!r}: expected one of {_HASH_MODES}")
    if hash_mode == "bytes" and not release.supports_bytes_hashes:
        raise ValueError(
            f"vLLM {release} cannot send byte hashes: raw digests appear in 0.10.2 "
            f"(VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0); use 'signed' (default) or 'int' "
            f"(sha256_cbor_64bit, 0.10.0+)"
        )
    if hash_mode == "signed" and release.supports_bytes_hashes:
        raise ValueError(
            f"vLLM {release} never sends signed hashes: from 0.10.2 integer hashes are the "
            f"unsigned low 64 bits of the digest; use 'int' (default) or 'bytes'"
        )
    return hash_mode


@dataclass(frozen=True)
class PodSpec:
    """One simulated pod. Ports: rank r binds ``pub_port + r`` and ``replay_port + r``."""

    name: str = "pod"
    model: str = "demo-model"
    release: str | Release = "0.33.0"
    dp_size: int = 1
    hash_mode: str | None = None  # None: the release's default
    host: str = "127.0.0.1"
    pub_port: int | None = None  # None: free ports chosen at bind time
    replay_port: int | None = None  # None: pub_port + dp_size
    replay: bool = True  # bind a replay ROUTER (vLLM: replay_endpoint set)
    topic: str = "kv-events"
    rate: float = 10.0  # batches/s per rank; 0 = as fast as possible
    batches: int = 0  # batches per rank (all incarnations); 0 = forever
    buffer_steps: int = 10_000
    hwm: int = 100_000  # PUB SNDHWM/RCVHWM (vLLM's hwm)
    drop_rate: float = 0.0
    drop_seqs: frozenset[int] = frozenset()
    lose_seqs: frozenset[int] = frozenset()
    restart_after: int = 0  # restart each time an incarnation has consumed this many seqs
    restart_at_batches: frozenset[int] = frozenset()  # restart once N batches were consumed
    # Restart when the k-th replay request (1-based, per rank) arrives, before answering it:
    # the reply then comes from the new incarnation (a restart while a replay is in flight).
    restart_on_replay: frozenset[int] = frozenset()
    # Close and rebind the PUB and ROUTER at each restart, as a real engine restart does:
    # subscribers see a disconnect and reconnect (not with connect_pub).
    rebind_on_restart: bool = False
    seed: int = 0
    cache: ModelConfig = field(default_factory=ModelConfig)
    start_delay: float = 0.0  # seconds before the first batch (after wait_for_subscriber)
    # First batch only once a subscriber's subscription arrived. The PUB is then an XPUB:
    # the same socket to a SUB (ZMTP lets SUB talk to either), but it shows the
    # subscription, whereas a handshake alone leaves the first batches to the slow-joiner drop.
    wait_for_subscriber: bool = False
    # vLLM connects its PUB instead of binding when the endpoint has no '*' (llm-d's layout:
    # one bridge SUB bound for the fleet). Rank r connects to this endpoint's port + r.
    connect_pub: str | None = None

    def __post_init__(self) -> None:
        for name in ("drop_seqs", "lose_seqs", "restart_at_batches", "restart_on_replay"):
            object.__setattr__(self, name, frozenset(getattr(self, name)))
        if not self.name:
            raise ValueError("a pod needs a non-empty name")
        try:
            release = as_release(self.release)
            hash_mode = resolve_hash_mode(release, self.hash_mode)
        except ValueError as exc:
            raise ValueError(f"pod {self.name}: {exc}") from None
        object.__setattr__(self, "release", release)
        object.__setattr__(self, "hash_mode", hash_mode)
        if self.dp_size < 1:
            raise ValueError(f"pod {self.name}: dp_size must be >= 1")
        if self.dp_size > 1 and not release.has_dp_rank:
            raise ValueError(
                f"pod {self.name}: vLLM {release} has no data-parallel KV events "
                f"(rank offsets and data_parallel_rank appear in 0.9.1)"
            )
        if self.rate < 0 or self.batches < 0 or self.restart_after < 0 or self.start_delay < 0:
            raise ValueError(
                f"pod {self.name}: rate, batches, restart_after, start_delay must be >= 0"
            )
        if self.buffer_steps < 1 or self.hwm < 0:
            raise ValueError(f"pod {self.name}: buffer_steps must be >= 1, hwm >= 0")
        if not 0.0 <= self.drop_rate <= 1.0:
            raise ValueError(f"pod {self.name}: drop_rate must be within [0, 1]")
        if self.rebind_on_restart and self.connect_pub:
            raise ValueError(f"pod {self.name}: rebind_on_restart needs bound sockets")
        if self.replay_port is not None and self.pub_port is None:
            raise ValueError(f"pod {self.name}: replay_port needs an explicit pub_port")

    @property
    def rel(self) -> Release:
        assert isinstance(self.release, Release)
        return self.release


@dataclass(frozen=True)
class RankEndpoints:
    rank: int
    pub: str
    replay: str | None
