"""``block_size="auto"``: the chooser and its memory across processes."""

from .chooser import forget

__all__ = ["forget"]
