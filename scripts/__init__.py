"""Scripts of a checkout (not shipped in the wheel). Studies are modules of ``scripts.studies``, run from the
repository root as ``python -m scripts.studies.NAME``; the rest run as ``python scripts/NAME.py``."""
