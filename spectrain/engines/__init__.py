"""Real serving engines as components of the pipeline: fetch and build them, start and stop their servers.

Torch-free, so `spectrain engine fetch` answers fast and export / eval can import it from below.
``llama_cpp`` pins, fetches, builds and caches llama.cpp; ``server`` runs a `llama-server` on 127.0.0.1
and talks to it.
"""
