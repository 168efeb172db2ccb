"""The log: what a kv-events record is (envelope, markers, Avro, parts) and how it gets to Kafka.

Shared by both pipelines: ingest writes records with it, consume reads them back. May import
``bridge.vllm`` and ``bridge.ops`` only.
"""
