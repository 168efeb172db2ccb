"""kvbridge: vLLM KV-cache events from ZeroMQ into a durable Kafka log, as Avro."""

__version__ = "0.1.0"
