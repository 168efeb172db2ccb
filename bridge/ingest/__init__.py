"""Engines → log: per-pod sockets, sequencing and replay, and the event loop that feeds the sink.

May import ``bridge.vllm``, ``bridge.log`` and ``bridge.ops``; never ``bridge.consume`` or
``bridge.cli``. The sequencer is pure (no sockets, no threads); subscriber, listener and runner
are the I/O that drives it.
"""
