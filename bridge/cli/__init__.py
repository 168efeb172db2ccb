"""Every ``kvbridge`` command: arguments, settings resolution and the glue to the stages.

The top of the import graph: it may import every subpackage, and nothing imports it.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """``kvbridge``'s entry point (kept here too: ``bridge.cli:main`` before the layout)."""
    from bridge.cli.main import main as run

    return run(argv)
