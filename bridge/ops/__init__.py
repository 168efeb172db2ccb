"""What every process runs on: settings, metrics, health, logging, pod discovery, sharding,
worker processes and local child processes.

Imports nothing else of ``bridge``: every other subpackage may import it.
"""
