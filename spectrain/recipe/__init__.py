"""Recipes: flat YAML files mapped onto typed dataclasses (``schema``), strictly validated (``load``).

``load_recipe(path, overrides)`` is the one entry point; ``deploy`` holds the serving engines' layout limits
that validation checks before any training.
"""

from spectrain.recipe.load import load_recipe

__all__ = ["load_recipe"]
