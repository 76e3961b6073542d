"""The prompts the SmolLM2 recipes regenerate: first user turns of the shipped chat mix, a fixed sample.

    python scripts/real_target_prompts.py --n 960 --out data/train/smollm2_prompts.jsonl

Single-turn (the first user message; its original answer is kept only as a placeholder the
regeneration replaces), drawn in a seeded order from every source except the red-teaming
`hh_rlhf_harmless_test_chosen` rows, with the source mix of the file. Ids are kept, so the held-out
split (an id hash, spectrain/data/chat.py) selects the same conversations as it does in the full mix.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SKIP = {"hh_rlhf_harmless_test_chosen"}


def sample(src: Path, n: int, seed: int, max_chars: int) -> list[dict]:
    rows = [json.loads(line) for line in src.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["source"] not in SKIP and len(r["messages"][0]["content"]) <= max_chars]
    random.Random(seed).shuffle(rows)
    return [{"id": r["id"], "source": r["source"], "messages": r["messages"][:2]} for r in rows[:n]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--src", default="data/train/chat_mix_messages.jsonl")
    p.add_argument("--n", type=int, default=960)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-chars", type=int, default=1500, help="skip prompts longer than this (long pastes)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    rows = sample(Path(a.src), a.n, a.seed, a.max_chars)
    Path(a.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} prompts -> {a.out}")


if __name__ == "__main__":
    main()
