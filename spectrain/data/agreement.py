"""`spectrain agreement RECIPE FILE`: does the recipe's target pick the tokens a server wrote?

    spectrain agreement smollm2-135m/eagle3 data/train/smollm2_engine_regen_0.jsonl --n 200

Data regenerated through a serving engine (``spectrain regenerate --server``) was written by the engine's
arithmetic (llama.cpp on Q4_1 weights in integer kernels), while training and evaluation use the recipe's target
(the same weights dequantized, in PyTorch). This measures how far apart they are on the data itself: the target is
teacher-forced on each greedy answer (one forward pass per row) and its argmax is compared with the token the server
wrote at every position. Reported: the per-token agreement, the first-token agreement, the rows where every token
agrees, and the target's own top-1 minus chosen-token logit margin at the disagreements (a disagreement at a margin
near zero is a near-tie that either arithmetic may break; a large one means another model or another template).

Only greedy rows are used: a row with ``"temperature": 0`` (a ``--temperature 0,1`` mix records it per row), or
every row when no row records a temperature (the file was regenerated at one temperature; pass ``--all`` only if
that was 0). The first assistant turn of each row is checked. Answers are re-tokenized from their text; rows whose
text does not round-trip through the tokenizer are counted and left out.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from spectrain.data.chat import SkipReport, _raw_rows, normalize_row
from spectrain.data.generate import _prompt_ids
from spectrain.io.outputs import check_file_placement, write_text_safe
from spectrain.io.resources import resolve_recipe
from spectrain.recipe.load import load_recipe
from spectrain.targets.model import load_target

NEAR_TIE = (0.1, 0.5, 1.0)  # margin thresholds reported for the disagreements


def greedy_rows(path: str, use_all: bool, limit: int) -> list[dict]:
    """The first `limit` greedy rows of a regenerated file (see the module doc for which rows count as greedy)."""
    raw = list(_raw_rows(path, SkipReport()))
    marked = any(isinstance(r, dict) and "temperature" in r for r in raw)
    if not marked and not use_all:
        raise ValueError(f"{path}: no row records its temperature, so greedy rows cannot be told apart; pass --all "
                         "if the whole file was regenerated at --temperature 0")
    rows = []
    for r in raw:
        if marked and not (isinstance(r, dict) and r.get("temperature") == 0):
            continue
        row, _ = normalize_row(r, "messages")
        if row is not None and any(m["role"] == "assistant" for m in row["messages"]):
            rows.append(row)
        if len(rows) >= limit:
            break
    if not rows:
        raise ValueError(f"{path}: no greedy row with an assistant turn to check")
    return rows


@torch.no_grad()
def row_agreement(target, row: dict, template_kwargs: dict | None = None) -> dict | None:
    """Teacher-force the target on the row's first answer -> {tokens, agree, first, margins}; None when the answer
    text does not round-trip through the tokenizer (its token ids are unknown)."""
    tok, msgs = target.tokenizer, row["messages"]
    turn = next(i for i, m in enumerate(msgs) if m["role"] == "assistant")
    prompt = _prompt_ids(tok, msgs[:turn], template_kwargs)
    answer = tok(msgs[turn]["content"], add_special_tokens=False)["input_ids"]
    if not answer or tok.decode(answer, clean_up_tokenization_spaces=False) != msgs[turn]["content"]:
        return None
    ids = torch.tensor([prompt + answer], device=target.device)
    logits = target.forward(ids).logits[0, len(prompt) - 1:-1].float()
    want = torch.tensor(answer, device=logits.device)
    top = logits.max(-1).values
    margin = top - logits.gather(-1, want[:, None])[:, 0]
    agree = logits.argmax(-1) == want
    return {"tokens": len(answer), "agree": int(agree.sum()), "first": bool(agree[0]),
            "margins": [round(float(m), 4) for m in margin[~agree]]}


def summarize(records: list[dict | None]) -> dict:
    done = [r for r in records if r is not None]
    tokens = sum(r["tokens"] for r in done)
    margins = sorted(m for r in done for m in r["margins"])
    out = {"rows": len(done), "rows_not_round_tripping": len(records) - len(done), "tokens": tokens,
           "token_agreement": sum(r["agree"] for r in done) / tokens if tokens else float("nan"),
           "first_token_agreement": sum(r["first"] for r in done) / len(done) if done else float("nan"),
           "rows_all_agree": sum(r["agree"] == r["tokens"] for r in done), "disagreements": len(margins),
           "median_margin": margins[len(margins) // 2] if margins else None}
    for t in NEAR_TIE:
        out[f"disagreements_margin_le_{t}"] = sum(m <= t for m in margins)
    return out


def lines(s: dict) -> list[str]:
    near = ", ".join(f"<= {t}: {s[f'disagreements_margin_le_{t}']}" for t in NEAR_TIE)
    return [f"agreement: {s['rows']} greedy rows, {s['tokens']} answer tokens "
            f"({s['rows_not_round_tripping']} rows left out: their text does not round-trip through the tokenizer)",
            f"  the target's argmax equals the written token at {s['token_agreement']:.2%} of positions; first token "
            f"{s['first_token_agreement']:.2%}; every token in {s['rows_all_agree']} of {s['rows']} rows",
            f"  {s['disagreements']} disagreements, the target's top-1 minus written-token logit margin there: "
            f"median {s['median_margin']}, {near}"]


def add_agreement_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("file", help="a regenerated .jsonl / .jsonl.gz (spectrain regenerate --out)")
    p.add_argument("--n", type=int, default=200, help="greedy rows to check (default 200, the first ones)")
    p.add_argument("--all", action="store_true", help="treat every row as greedy (a file without temperatures)")
    p.add_argument("--out", default="", help="also write the summary as JSON here")
    return p


def place_summary(out: str, file: str, recipe_arg: str, recipe) -> Path:
    """--out checked before the target loads (spectrain/io/outputs.py): never the file read, the recipe or its data,
    a checkpoint's file, a run's own records, nor through a link; a rerun replaces its own summary."""
    out = Path(out)
    inputs = [("regenerated file", file), ("recipe", resolve_recipe(recipe_arg)[0]),
              *(("data file", f) for f in recipe.data.train_files), ("target", recipe.target.name_or_path)]
    return check_file_placement(out, inputs, [out.with_name(f".{out.name}.tmp{os.getpid()}")], replace=True)


def main(args: argparse.Namespace) -> int:
    if args.n <= 0:
        raise ValueError(f"--n {args.n}: must be > 0")
    if not Path(args.file).is_file():
        raise FileNotFoundError(f"{args.file}: no such file (a `spectrain regenerate --out` file)")
    recipe = load_recipe(args.recipe, args.overrides)
    out = place_summary(args.out, args.file, args.recipe, recipe) if args.out else None
    rows = greedy_rows(args.file, args.all, args.n)
    t = recipe.target
    target = load_target(t.name_or_path, gguf_file=t.gguf_file, dtype=t.dtype, trust_remote_code=t.trust_remote_code)
    s = summarize([row_agreement(target, r, recipe.data.chat_template_kwargs) for r in rows])
    s.update(file=str(args.file), target=t.name_or_path, dtype=str(target.dtype).removeprefix("torch."))
    print("\n".join(lines(s)))
    if out is not None:
        write_text_safe(out, json.dumps(s, indent=1) + "\n")  # temp + rename: a link at --out is never followed
    return 0
