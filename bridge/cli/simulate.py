"""`kvbridge simulate`: run simulated vLLM pods on real ZeroMQ sockets."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from contextlib import ExitStack
from types import FrameType
from typing import Any, TextIO

from bridge.simulator.model import ModelConfig
from bridge.simulator.pod import PodSpec, SimulatedFleet
from bridge.vllm.releases import MAX_RELEASE, MIN_RELEASE, Release

DESCRIPTION = f"""\
Run simulated vLLM pods that speak the KV-cache event protocol exactly like the chosen
vLLM releases ({MIN_RELEASE} to {MAX_RELEASE}): a PUB socket sending [topic, seq, msgpack
batch] and a replay ROUTER per data-parallel rank, fed by a small prefix-cache model
(shared prompt templates, chunked prefill, LRU eviction, optional cache resets and CPU
offload events). Faults can be injected: PUB drops (recoverable by replay), lost
sequence numbers (permanent gaps), publisher restarts.

Ports: pod i, rank r binds PUB base+i*2*dp+r and ROUTER base+i*2*dp+dp+r, so with one pod
and no DP: 5557 (PUB) and 5558 (replay), as most vLLM deployments.

  kvbridge simulate                                  # one pod, 0.33.0, 10 batches/s
  kvbridge simulate --pods 3 --release 0.9.0,0.23.0,0.33.0 --endpoints-file pods.json
  kvbridge simulate --drop-rate 0.01 --restart-after 500 --sent-log sent.jsonl
  kvbridge simulate --batches 100 --rate 0 --exit-when-done --sent-log -
"""


def _int_set(text: str) -> frozenset[int]:
    try:
        values = frozenset(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected comma-separated sequence numbers such as 3,7,9"
        ) from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: sequence numbers are >= 0")
    return values


def _releases(text: str) -> list[Release]:
    try:
        return [Release.parse(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a probability between 0 and 1")
    return value


def _non_negative(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = -1
        if value < 0:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a number >= 0")
        return value

    return parse


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add the `simulate` options to ``parser``."""
    parser.description = DESCRIPTION
    nn_int, nn_float = _non_negative(int), _non_negative(float)
    g = parser.add_argument_group("pods")
    g.add_argument("--pods", type=int, default=1, metavar="N", help="number of pods (default 1)")
    g.add_argument(
        "--name",
        default="pod",
        help="pod name; with --pods N > 1 a prefix: NAME-0, NAME-1, ... (default pod)",
    )
    g.add_argument(
        "--model", default="demo-model", help="served model name reported (default demo-model)"
    )
    g.add_argument(
        "--release",
        type=_releases,
        default=[Release(0, 33, 0)],
        metavar="X.Y.Z[,X.Y.Z...]",
        help="vLLM release(s) to imitate; a comma list is cycled over the pods, e.g. "
        "0.9.0,0.23.0,0.33.0 (array events before 0.24.0, map events from it; replay "
        "replies carry the topic from 0.26.0) (default 0.33.0)",
    )
    g.add_argument(
        "--dp-size",
        type=int,
        default=1,
        metavar="N",
        help="data-parallel ranks per pod, each with its own PUB/ROUTER on port+rank "
        "and its own sequence numbers (default 1; needs release >= 0.9.1 when > 1)",
    )
    g.add_argument(
        "--hash-mode",
        choices=["int", "signed", "bytes"],
        help="how block hashes go on the wire: 'signed' int64 (vLLM < 0.10.2 builtin hash), "
        "'int' unsigned low 64 bits of the sha256 digest (0.10.2+ default), 'bytes' raw "
        "32-byte digests (0.10.2+, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) "
        "(default: signed before 0.10.2, int from it)",
    )
    g = parser.add_argument_group("sockets")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    g.add_argument(
        "--base-port",
        type=int,
        default=5557,
        metavar="PORT",
        help="first port: pod i rank r binds PUB base+i*2*dp+r and replay base+i*2*dp+dp+r; "
        "0 picks free ports (see --endpoints-file) (default 5557)",
    )
    g.add_argument(
        "--topic", default="kv-events", help="topic frame of every message (default kv-events)"
    )
    g.add_argument(
        "--no-replay",
        action="store_true",
        help="bind no replay ROUTER (vLLM's default when replay_endpoint is unset)",
    )
    g.add_argument(
        "--buffer-steps",
        type=int,
        default=10_000,
        metavar="N",
        help="replay buffer size in batches, as vLLM's buffer_steps (default 10000)",
    )
    g.add_argument(
        "--endpoints-file",
        metavar="FILE",
        help="write a JSON list of {name, model, release, dp_size, pub, replay, topic} per "
        "pod once every socket is bound (rank-0 endpoints; rank r is on port+r)",
    )
    g.add_argument(
        "--state-file",
        metavar="FILE",
        help="at exit, write each pod and rank's simulated cache as JSON: a list of {pod, "
        "dp_rank, tiers: [{medium, group_idx, blocks: [hex hashes]}]} (hashes as a consumer "
        "of the topic sees them), to compare with what `kvbridge replay --json` rebuilds",
    )
    g = parser.add_argument_group("workload")
    g.add_argument(
        "--rate",
        type=nn_float,
        default=10.0,
        metavar="R",
        help="batches per second per rank; 0 = as fast as possible (default 10)",
    )
    g.add_argument(
        "--batches",
        type=nn_int,
        default=0,
        metavar="N",
        help="batches to send per rank, then only serve replays; 0 = forever (default 0)",
    )
    g.add_argument(
        "--capacity",
        type=int,
        default=ModelConfig.capacity,
        metavar="BLOCKS",
        help=f"GPU prefix-cache size in blocks of 16 tokens; smaller means more evictions "
        f"(BlockRemoved) (default {ModelConfig.capacity})",
    )
    g.add_argument(
        "--clear-prob",
        type=_probability,
        default=0.0,
        metavar="P",
        help="probability per engine step of a prefix-cache reset (AllBlocksCleared) (default 0)",
    )
    g.add_argument(
        "--repeat-prob",
        type=_probability,
        default=0.0,
        metavar="P",
        help="probability that a request serves an earlier prompt again, block-aligned: vLLM "
        "recomputes its last block into a second physical copy of that hash (default 0)",
    )
    g.add_argument(
        "--report-full-prob",
        type=_probability,
        default=0.0,
        metavar="P",
        help="share of requests with kv_cache_report_mode=full (releases >= 0.26.0): their "
        "prefix-cache hits are sent again as BlockStored (default 0)",
    )
    g.add_argument(
        "--offload-chunk-blocks",
        type=int,
        default=0,
        metavar="N",
        help="with --cpu-offload-prob: the connector's chunk mode, chunks of N blocks that "
        "overlap by one (a block stored and removed twice); 0 = per block (default 0)",
    )
    g.add_argument(
        "--lora-prob",
        type=_probability,
        default=0.0,
        metavar="P",
        help="share of new conversations on a LoRA adapter (ad-a or ad-b; lora_id, and "
        "lora_name from 0.14.0, in their BlockStored; the name in their hashes) (default 0)",
    )
    g.add_argument(
        "--mm-prob",
        type=_probability,
        default=0.0,
        metavar="P",
        help="share of requests with an image in their suffix: placeholder tokens told apart "
        "by the image's identifier in the blocks' extra keys (default 0)",
    )
    g.add_argument(
        "--salt-prob",
        type=_probability,
        default=0.0,
        metavar="P",
        help="share of new conversations with a cache_salt (an extra key of the first block) "
        "(default 0)",
    )
    g.add_argument(
        "--copy-counts",
        action="store_true",
        help="send remaining_copy_counts on every BlockRemoved (vllm#48933, not released; "
        "releases >= 0.24.0)",
    )
    g.add_argument(
        "--cpu-offload-prob",
        type=_probability,
        default=0.0,
        metavar="P",
        help="probability that newly cached blocks are also offloaded to a CPU tier, sending "
        "connector events with medium CPU (releases >= 0.10.2 only) (default 0)",
    )
    g.add_argument(
        "--seed", type=int, default=0, help="seed of the workload and faults (default 0)"
    )
    g.add_argument(
        "--start-delay",
        type=nn_float,
        default=0.0,
        metavar="S",
        help="seconds to wait before the first batch (default 0)",
    )
    g.add_argument(
        "--wait-for-subscriber",
        action="store_true",
        help="send the first batch only once a subscriber has connected to the PUB "
        "(default: start at once; early batches are lost to slow joiners, as with vLLM)",
    )
    g = parser.add_argument_group("faults")
    g.add_argument(
        "--drop-rate",
        type=_probability,
        default=0.0,
        metavar="P",
        help="probability that a batch is not sent live (still in the replay buffer, as a "
        "PUB high-water-mark drop) (default 0)",
    )
    g.add_argument(
        "--drop-seqs",
        type=_int_set,
        default=frozenset(),
        metavar="3,7,9",
        help="sequence numbers not sent live but kept for replay (every incarnation)",
    )
    g.add_argument(
        "--lose-seqs",
        type=_int_set,
        default=frozenset(),
        metavar="3,7,9",
        help="sequence numbers consumed but neither sent nor buffered: permanent gaps, as "
        "vLLM's encode-failure path (every incarnation)",
    )
    g.add_argument(
        "--restart-after",
        type=nn_int,
        default=0,
        metavar="N",
        help="restart each publisher every N batches: sequence back to 0, empty replay "
        "buffer, empty cache with new hashes; sockets stay bound (default 0 = never)",
    )
    g = parser.add_argument_group("output")
    g.add_argument(
        "--sent-log",
        metavar="FILE",
        help="write one JSON line per batch sent, dropped or lost, with its events "
        "(hashes as the bridge normalizes them); '-' for stdout",
    )
    g.add_argument(
        "--exit-when-done",
        action="store_true",
        help="exit once every rank sent --batches and no replay came for --linger seconds "
        "(default: run until SIGINT/SIGTERM)",
    )
    g.add_argument(
        "--linger",
        type=nn_float,
        default=2.0,
        metavar="S",
        help="idle seconds before --exit-when-done exits (default 2)",
    )


def build_specs(args: argparse.Namespace) -> list[PodSpec]:
    """One PodSpec per pod from parsed options; ValueError with a readable message."""
    if args.pods < 1:
        raise ValueError("--pods must be >= 1")
    if args.dp_size < 1:
        raise ValueError("--dp-size must be >= 1")
    if args.exit_when_done and not args.batches:
        raise ValueError("--exit-when-done needs --batches N (otherwise pods never finish)")
    cache = ModelConfig(
        capacity=args.capacity,
        clear_prob=args.clear_prob,
        cpu_offload_prob=args.cpu_offload_prob,
        repeat_prob=args.repeat_prob,
        report_full_prob=args.report_full_prob,
        offload_chunk_blocks=args.offload_chunk_blocks,
        copy_counts=args.copy_counts,
        lora_names=("ad-a", "ad-b"),
        lora_prob=args.lora_prob,
        mm_prob=args.mm_prob,
        salt_prob=args.salt_prob,
    )
    dp = args.dp_size
    specs = []
    for i in range(args.pods):
        release = args.release[i % len(args.release)]
        name = args.name if args.pods == 1 else f"{args.name}-{i}"
        pub_port = args.base_port + i * 2 * dp if args.base_port else None
        if pub_port is not None and pub_port + 2 * dp - 1 > 65535:
            raise ValueError(f"--base-port {args.base_port}: pod {name} would need port > 65535")
        specs.append(
            PodSpec(
                name=name,
                model=args.model,
                release=release,
                dp_size=dp,
                hash_mode=args.hash_mode,
                host=args.host,
                pub_port=pub_port,
                replay_port=None if pub_port is None else pub_port + dp,
                replay=not args.no_replay,
                topic=args.topic,
                rate=args.rate,
                batches=args.batches,
                buffer_steps=args.buffer_steps,
                drop_rate=args.drop_rate,
                drop_seqs=args.drop_seqs,
                lose_seqs=args.lose_seqs,
                restart_after=args.restart_after,
                seed=args.seed,
                cache=cache,
                start_delay=args.start_delay,
                wait_for_subscriber=args.wait_for_subscriber,
            )
        )
    return specs


def run(args: argparse.Namespace) -> int:
    """Run the pods until done (--exit-when-done) or SIGINT/SIGTERM; 0 on a clean exit."""
    try:
        specs = build_specs(args)
    except ValueError as exc:
        print(f"kvbridge simulate: {exc}", file=sys.stderr)
        return 2
    to_stdout = args.sent_log == "-"
    info: TextIO = sys.stderr if to_stdout else sys.stdout
    stop = threading.Event()
    with ExitStack() as stack:
        sink: TextIO | None = None
        if to_stdout:
            sink = sys.stdout
        elif args.sent_log:
            sink = stack.enter_context(open(args.sent_log, "w", encoding="utf-8"))  # noqa: SIM115
        try:
            fleet = SimulatedFleet(*specs, sent_log=sink, keep_records=False, start=False)
        except (RuntimeError, OSError) as exc:
            print(f"kvbridge simulate: {exc}", file=sys.stderr)
            return 1
        stack.callback(fleet.stop)
        if args.endpoints_file:
            with open(args.endpoints_file, "w", encoding="utf-8") as f:
                json.dump(fleet.endpoints(), f, indent=2)
                f.write("\n")
        for pod in fleet.pods:
            ranks = " ".join(
                f"dp{e.rank}: pub={e.pub} replay={e.replay or '-'}" for e in pod.endpoints
            )
            print(
                f"{pod.name}: vLLM {pod.release}, model {pod.model}, hashes {pod.hash_mode}, "
                f"topic {pod.topic!r}, {ranks}",
                file=info,
                flush=True,
            )
        stack.enter_context(_signals_set(stop))
        fleet.start()
        started = time.monotonic()
        while not stop.wait(0.1):
            fleet.check()
            if (
                args.exit_when_done
                and fleet.done
                and time.monotonic() - fleet.idle_since() >= args.linger
            ):
                break
        fleet.stop()
        elapsed = time.monotonic() - started
        if args.state_file:
            _write_state(fleet, args.state_file)
        print(_summary(fleet, elapsed), file=info, flush=True)
    return 0


def _write_state(fleet: SimulatedFleet, path: str) -> None:
    out = []
    for pod in fleet.pods:
        for rank in range(pod.dp_size):
            tiers = [
                {
                    "medium": medium,
                    "group_idx": group,
                    "blocks": sorted("0x" + h.hex() for h in blocks),
                }
                for (medium, group), blocks in sorted(
                    fleet.resident(pod.name, rank).items(), key=lambda kv: str(kv[0])
                )
            ]
            out.append({"pod": pod.name, "dp_rank": rank, "tiers": tiers})
    with open(path, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)


def _summary(fleet: SimulatedFleet, elapsed: float) -> str:
    s = fleet.stats()
    ranks = sum(p.dp_size for p in fleet.pods)
    return (
        f"simulate: {len(fleet.pods)} pod(s), {ranks} rank(s), {elapsed:.1f}s: "
        f"{s.get('batches', 0)} batches ({s.get('live', 0)} live, {s.get('dropped', 0)} dropped, "
        f"{s.get('lost', 0)} lost), {s.get('restarts', 0)} restarts, {s.get('replays', 0)} "
        f"replays ({s.get('replayed_batches', 0)} batches), {s.get('invalid_requests', 0)} "
        f"invalid replay requests ignored"
    )


class _signals_set:
    """Context manager: SIGINT/SIGTERM set ``stop`` (main thread only), restored on exit."""

    def __init__(self, stop: threading.Event) -> None:
        self._stop = stop
        self._saved: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self._stop.set()

    def __enter__(self) -> _signals_set:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._saved[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
