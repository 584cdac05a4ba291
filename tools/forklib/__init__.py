"""Tooling that keeps the fork as pinned upstream SGLang plus our own work.

The repository never contains upstream's code: the pinned wheel is materialized
under ``python/sglang`` at install time and our edits to upstream files live in
``patches/`` as an ordered series.
"""


class ForkError(Exception):
    """A user-facing failure of the fork tooling (bad hash, patch conflict, ...)."""
