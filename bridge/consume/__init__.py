"""Log → state: reading kv-events, rebuilding each pod's cache, checking the topic, the
kv-state topic, the state server and prompt scoring.

May import ``bridge.vllm``, ``bridge.log`` and ``bridge.ops``; never ``bridge.ingest`` or
``bridge.cli``. The consumer library's public names: :mod:`bridge.consume.reader`
(``TopicReader``, ``StartAt``, ``StopAt``), :mod:`bridge.consume.state` (``CacheState``),
:mod:`bridge.consume.statetopic` (``bootstrap_state``) and :mod:`bridge.consume.score`.
"""
