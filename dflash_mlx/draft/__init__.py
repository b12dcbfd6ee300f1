"""DFlash drafters: the block-diffusion drafter (dflash.py) and DFlash 2's
(dflash2.py), one definition for inference and training."""

from .dflash import DFlashDraft, DraftConfig

__all__ = ["DFlashDraft", "DraftConfig"]
