"""Sequence packing with document masking for the EAGLE-3 training-time-test (TTT) attention.

``pack_rows`` turns a right-padded micro-batch [B, T] (and its target features) into ONE row holding
only the real tokens of every row, back to back, plus ``doc_lengths``. Everything position-wise in
the head (fc, the q/k/v/o and MLP projections, lm_head, the loss) then runs on real tokens only, with
no padding. Attention must not cross documents: ``DocTTTAttention`` computes the causal step-0 part
document by document (a gather into [docs, longest doc] blocks), so its cost is sum over blocks, never
the O(N^2) dense mask of the whole packed row; the TTT "diagonal" keys are per position and need no
mask at all. Per-document positions restart at 0, so RoPE sees what it sees unpacked.

The loss is the same as unpacked: a packed position is trained only when the token it is trained on
lies in the same document (``same_doc``), which is what the padded layout gets from its attention mask.
"""

from __future__ import annotations

import torch


def pack_rows(batch: dict, feats: dict) -> tuple[dict, dict]:
    """Right-padded batch + features -> one packed row [1, N] (+ ``doc_lengths`` [B])."""
    am = batch["attention_mask"].bool()
    lengths = am.sum(1)
    t = am.shape[1]
    if not bool((am == (torch.arange(t, device=am.device)[None] < lengths[:, None])).all()):
        raise ValueError("training.packing needs right-padded rows (attention_mask = 1...1 0...0)")
    keep = am.reshape(-1)
    out = {k: v.reshape(-1, *v.shape[2:])[keep][None] for k, v in batch.items() if torch.is_tensor(v)
           and v.shape[:2] == am.shape}
    out["doc_lengths"] = lengths
    return out, {k: v.reshape(-1, *v.shape[2:])[keep][None] for k, v in feats.items()}


class PackedDocs:
    """Index maps between a packed row of N tokens and [docs, L] blocks (L = the longest document)."""

    def __init__(self, lengths: torch.Tensor):
        lengths = lengths.long()
        dev, n_docs, longest = lengths.device, lengths.numel(), int(lengths.max())
        starts = torch.cumsum(lengths, 0) - lengths
        off = torch.arange(longest, device=dev)
        self.valid = off[None] < lengths[:, None]  # [docs, L]
        self.gather = torch.where(self.valid, starts[:, None] + off[None], 0)  # packed index of each block slot
        self.scatter = self.valid.reshape(-1).nonzero().squeeze(1)  # block slot of each packed token, in order
        self.doc_ids = torch.repeat_interleave(torch.arange(n_docs, device=dev), lengths)[None]  # [1, N]
        self.positions = (torch.arange(int(lengths.sum()), device=dev) - starts[self.doc_ids[0]])[None]  # [1, N]
        causal = off[None, :] <= off[:, None]
        # a padding slot of a block still sees its document's first token, so no softmax row is empty
        self.mask0 = (causal[None] & self.valid[:, None, :])[:, None]  # [docs, 1, L, L]

    def to_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """[1, H, N, ...] -> [docs, H, L, ...]."""
        return x[0][:, self.gather].transpose(0, 1)

    def from_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """[docs, H, L, ...] -> [1, H, N, ...]."""
        x = x.transpose(0, 1)
        return x.reshape(x.shape[0], -1, *x.shape[3:])[:, self.scatter][None]

    def same_doc(self, shift: int) -> torch.Tensor:
        """[1, N] bool: the token `shift` places ahead lies in the same document."""
        d = self.doc_ids
        if shift == 0:
            return torch.ones_like(d, dtype=torch.bool)
        ahead = torch.cat([d[:, shift:], d.new_full((1, min(shift, d.shape[1])), -1)], 1)
        return ahead == d


class DocTTTAttention:
    """The TTT attention of one unroll (see eagle3.TTTAttention) over a packed row: step-0 keys causally
    within the document, the later steps' keys of the same anchor only (the diagonal)."""

    def __init__(self, docs: PackedDocs):
        self.docs, self.k0, self.v0, self.ks, self.vs = docs, None, None, [], []

    def __call__(self, q, k, v):
        d = self.docs
        if self.k0 is None:
            self.k0, self.v0 = d.to_blocks(k), d.to_blocks(v)
        else:
            self.ks.append(k)
            self.vs.append(v)
        scale = q.shape[-1] ** -0.5
        s0 = (d.to_blocks(q) @ self.k0.transpose(-1, -2)).float() * scale
        s0 = s0.masked_fill(~d.mask0, float("-inf"))
        if self.ks:
            diag = torch.stack([(q * kj).sum(-1) for kj in self.ks], -1).float() * scale  # [1, H, N, steps]
            s0 = torch.cat([s0, d.to_blocks(diag)], -1)
        p = s0.softmax(-1).to(v.dtype)
        width = self.k0.shape[2]
        out = d.from_blocks(p[..., :width] @ self.v0)
        if self.ks:
            pd = d.from_blocks(p[..., width:])  # [1, H, N, steps]
            for j, vj in enumerate(self.vs):
                out = out + pd[..., j: j + 1] * vj
        return out
