#!/usr/bin/env python3
"""Check that spectrain imports a speculators EAGLE-3 checkpoint exactly: the real package records its own
forward on fixed rows (in its own virtual environment), spectrain's import recomputes them here.

    python scripts/check_speculators_import.py --checkpoint RUN/ckpt/0 --target assets/reference-target \
        [--speculators-python /work/spec_venv/bin/python]

Prints, per row and TTT step, max |spectrain - speculators| of the draft logits and the argmax agreement;
exits 1 when any difference exceeds --tol (default 1e-5).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--speculators-python", default=os.environ.get("SPECTRAIN_SPECULATORS_PYTHON",
                                                                   "/work/spec_venv/bin/python"))
    ap.add_argument("--tol", type=float, default=1e-5)
    a = ap.parse_args()
    from spectrain.drafters import load_drafter
    from spectrain.targets.model import load_target

    keep = os.environ.get("SPECTRAIN_KEEP_RECORD")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = keep or tmp
        subprocess.run([a.speculators_python, str(REPO / "scripts" / "make_conformance_fixtures.py"), "--record",
                        a.checkpoint, "--target", a.target, "--out", tmp], check=True)
        target = load_target(a.target, dtype="float32", device="cpu")
        head = load_drafter(a.checkpoint, target).model.eval()
        print(f"imported {a.checkpoint}: layout {head.layout}, windows {head.windows}, aux {head.aux_layers}")
        worst = 0.0
        for f in sorted(Path(tmp).glob("row*.safetensors")):
            rec = load_file(str(f))
            ids, aux, theirs = rec["input_ids"], rec["aux"], rec["logits"]
            n = ids.shape[1]
            with torch.no_grad():
                mine = head.ttt_logits(ids, torch.ones_like(ids), aux, target, theirs.shape[0])
            for i, lg in enumerate(mine):
                a_, b_ = lg[0, : n - 1 - i], theirs[i, : n - 1 - i]
                d = float((a_ - b_).abs().max())
                agree = float((a_.argmax(-1) == b_.argmax(-1)).float().mean())
                worst = max(worst, d)
                print(f"{f.stem} len {n} step {i}: max |diff| {d:.2e}, argmax agreement {agree:.3f}")
    print(f"worst max |diff| {worst:.2e} (tolerance {a.tol:g})")
    return 0 if worst <= a.tol else 1


if __name__ == "__main__":
    sys.exit(main())
