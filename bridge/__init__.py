"""kvbridge: vLLM KV-cache events from ZeroMQ into a durable Kafka log, as Avro.

Two pipelines, one subpackage per stage (docs/architecture.md): engines → log is
``vllm`` (the wire protocol) → ``ingest`` (sockets, sequencing, the event loop) → ``log``
(records, Avro, the Kafka sink); log → state is ``log`` → ``consume`` (reader, cache state,
checker, state topic and server). ``ops`` holds what both run on, ``cli`` every command,
``simulator`` the vLLM pods used as a test peer.
"""

from bridge import _moved

__version__ = "0.1.0"

_moved.install()  # the module paths of earlier releases (bridge.consumer, bridge.state, ...)
