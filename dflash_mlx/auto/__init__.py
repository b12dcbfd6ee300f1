"""``block_size="auto"``: the block size chosen as decoding goes
(chooser.py), remembered across processes (memory.py)."""

from .chooser import forget

__all__ = ["forget"]
