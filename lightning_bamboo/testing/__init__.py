"""Tools for tests and benchmarks that run the real runtime: fault injection (``faults``)."""

from lightning_bamboo.testing import faults

__all__ = ["faults"]
