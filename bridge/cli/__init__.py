"""Every ``kvbridge`` command: one module per command, the settings they resolve, and
:mod:`~bridge.cli.commands`, which puts them under one parser.

The top of the import graph: it may import every subpackage, and nothing imports it.
"""

from __future__ import annotations

from bridge.cli.commands import main

__all__ = ["main"]
