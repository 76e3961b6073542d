"""Lossless speculative decoding.

- ``interface``: the small interface every drafter implements (``Drafter``, ``DraftContext``, ``Proposal``);
- ``loop``: ``speculative_generate`` / ``plain_generate``, one row at a time;
- ``batched``: B rows sharing every verification pass;
- ``acceptance``: the exact accept/reject rules; ``sampling``: logit warping and sampling;
- ``masks``: tree and per-layer-type attention masks; ``kv_cache``: every edit of a ``DynamicCache``;
- ``validate``: the Python API's argument checks.
"""
