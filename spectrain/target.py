"""``spectrain.target``, the package's name before it became ``spectrain.targets`` (docs/layout.md): a folder
named ``target/`` matches the common Python gitignore rule, so new modules there were silently left out of
``git add``. This module keeps ``from spectrain.target import load_target`` (../shared/anchors) working."""

from spectrain.targets import FrozenTarget, load_target

__all__ = ["FrozenTarget", "load_target"]
