"""DFlash block drafters: the model and its training (model.py), decoding (decode.py), the recipe section here."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DFlashConfig:
    """``drafter.dflash`` in a recipe."""

    num_layers: int = 1  # decoder layers of the target's width
    block_size: int = 8  # B: one forward drafts B - 1 tokens (k <= B - 1 at decode time)
    aux_layers: list[int] = field(default_factory=list)  # target layers whose inputs feed fc ([] = EAGLE's 3)
    mask_token_id: int = -1  # the token whose embedding marks slots to draft (-1: pad / unk / the last id)
    anchors_per_row: int = 8  # random block anchors per training row, inside the assistant's text
    decay: float = 0.8  # loss weight decay ** (i - 1) of block slot i

    def validate(self) -> None:
        for name, low in (("num_layers", 1), ("block_size", 2), ("anchors_per_row", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"drafter.dflash.{name} must be >= {low}, got {getattr(self, name)}")
        if not 0 < self.decay <= 1:
            raise ValueError(f"drafter.dflash.decay must be in (0, 1], got {self.decay}")
        if any(i < 0 for i in self.aux_layers):
            raise ValueError(f"drafter.dflash.aux_layers must be layer ids >= 0, got {self.aux_layers}")


def check_recipe(recipe) -> None:
    """The registry's ``train.validate`` hook: the section's own checks, run with recipe validation."""
    recipe.drafter.sections["dflash"].validate()
