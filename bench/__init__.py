"""kvbridge's benchmark suite: ``python -m bench --help`` (see bench/README.md).

Measurement only: nothing here asserts a speed.
"""
