"""EAGLE-3 layer layouts (norm_before_fc, fc_norm, norm_before_residual, norm_output) pinned against a forward
written from scratch here; ascending aux ids; import of public heads and its refusals."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_target
from safetensors.torch import load_file, save_file
from test_eagle3 import feats_of, make_head

from spectrain import export as E
from spectrain.drafters.eagle3.interop import import_eagle3
from spectrain.drafters.eagle3.model import Eagle3Head
from spectrain.recipe.load import recipe_from_dict

torch.set_num_threads(1)
ALL_OFF = {"norm_before_fc": False, "fc_norm": False, "norm_before_residual": False, "norm_output": False}
LAYOUTS = [{}, {"norm_before_fc": True}, {"fc_norm": True}, {"norm_before_residual": True}, {"norm_output": True},
           {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True}]  # last: speculators' default


@pytest.fixture(scope="module")
def target():
    return make_tiny_target("llama")


def layout_head(target, flags: dict, seed: int = 0, **kw) -> Eagle3Head:
    head = make_head(target, seed=seed, **{"draft_vocab_size": 96, "ttt_steps": 2, **flags, **kw})
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # non-trivial norms and weights, so every flag moves the numbers
        for name, p in head.named_parameters():
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g) if "norm" in name else 0.2 * torch.randn(p.shape, generator=g))
    return head.eval()


# ---- the from-scratch forward ------------------------------------------------------------------
def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate(x, pos, theta):
    hd = x.shape[-1]
    ang = pos[:, None].float() * (1.0 / theta ** (torch.arange(0, hd, 2).float() / hd))[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    return x * cos + torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], -1) * sin


def scratch_logits(w: dict, cfg: dict, flags: dict, ids: torch.Tensor, aux: torch.Tensor, emb_table, steps: int = 2):
    """One sequence: per TTT step s, logits at every anchor t (input token x_{t+1+s}, position t+s). Step s sees
    the step-0 keys of anchors 0..t and its own anchor's keys of steps 1..s."""
    eps, nh, nkv, hd = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    theta, n = cfg["rope_parameters"]["rope_theta"], ids.shape[0]
    g = aux
    if flags.get("norm_before_fc"):
        g = rms(g, w["input_norm.weight"], eps)
    if flags.get("fc_norm"):
        g = torch.cat([rms(c, w[f"fc_norm.{i}.weight"], eps) for i, c in enumerate(g.chunk(3, -1))], -1)
    h = g @ w["fc.weight"].T
    pos, keys, out = torch.arange(n), [], []
    for s in range(steps):
        nxt = torch.cat([ids[1 + s:], ids.new_zeros(1 + s)])
        emb = emb_table[nxt]
        hn = rms(h, w["layers.0.hidden_norm.weight"], eps)
        x = torch.cat([rms(emb, w["layers.0.input_layernorm.weight"], eps), hn], -1)
        res = hn if flags.get("norm_before_residual") else h
        p = "layers.0.self_attn."
        q = rotate((x @ w[p + "q_proj.weight"].T).view(n, nh, hd).transpose(0, 1), pos + s, theta)
        k = rotate((x @ w[p + "k_proj.weight"].T).view(n, nkv, hd).transpose(0, 1), pos + s, theta)
        v = (x @ w[p + "v_proj.weight"].T).view(n, nkv, hd).transpose(0, 1)
        k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
        keys.append((k, v))
        k0, v0 = keys[0]
        s0 = (q @ k0.transpose(-1, -2)) / hd ** 0.5
        s0 = s0.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        diag = [((q * kj).sum(-1) / hd ** 0.5)[..., None] for kj, _ in keys[1:]]
        prob = torch.cat([s0, *diag], -1).softmax(-1)
        o = prob[..., :n] @ v0 + sum(prob[..., n + j: n + j + 1] * vj for j, (_, vj) in enumerate(keys[1:]))
        h1 = res + o.transpose(0, 1).reshape(n, nh * hd) @ w[p + "o_proj.weight"].T
        m = rms(h1, w["layers.0.post_attention_layernorm.weight"], eps)
        mp = "layers.0.mlp."
        h2 = h1 + (torch.nn.functional.silu(m @ w[mp + "gate_proj.weight"].T) * (m @ w[mp + "up_proj.weight"].T)) \
            @ w[mp + "down_proj.weight"].T
        normed = rms(h2, w["norm.weight"], eps)
        out.append(normed @ w["lm_head.weight"].T)
        h = normed if flags.get("norm_output") else h2
    return out


@pytest.mark.parametrize("flags", LAYOUTS, ids=lambda f: "+".join(f) or "plain")
def test_layout_matches_from_scratch_forward_and_trains(target, flags):
    head = layout_head(target, flags)
    assert head.layout == {**ALL_OFF, **flags} and all(head.config[k] == v for k, v in flags.items())
    ids = torch.randint(3, target.vocab_size, (1, 14), generator=torch.Generator().manual_seed(2))
    aux = feats_of(target, head, ids)["aux"]
    w = {k: v.detach() for k, v in head.state_dict().items()}
    emb = target.embed_tokens.weight.detach()
    with torch.no_grad():
        mine = head.ttt_logits(ids, torch.ones_like(ids), aux, target, 2)
    want = scratch_logits(w, head.config, flags, ids[0], aux[0], emb)
    for a, b in zip(mine, want):
        torch.testing.assert_close(a[0], b, rtol=0, atol=2e-5)
    if flags:  # the flag matters: the from-scratch forward without it is another function
        other = scratch_logits(w, head.config, {}, ids[0], aux[0], emb)
        assert max(float((a - b).abs().max()) for a, b in zip(want, other)) > 1e-3
    # the TTT training path runs with the layout and reaches its own weights
    head.train()
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    loss, _ = head.train_loss(batch, feats_of(target, head, ids), target)
    loss.backward()
    for name in ("input_norm", "fc_norm"):
        if flags.get({"input_norm": "norm_before_fc", "fc_norm": "fc_norm"}[name]):
            assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in getattr(head, name).parameters())


def test_sliding_window_ttt_matches_decoding_chain_and_tree(target):
    """With a window shorter than the prefix, TTT step i at anchor t == the adapter's i-th drafted distribution
    (chain), and the tree's first-level node equals the chain's first draft."""
    from test_eagle3 import _propose

    from spectrain.decoding.sampling import Sampler

    head = layout_head(target, {"norm_output": True}, sliding_window=4, ttt_steps=3)
    assert head.windows == [4] and head.config["layer_types"] == ["sliding_attention"]
    prefix = torch.randint(3, target.vocab_size, (12,), generator=torch.Generator().manual_seed(4))
    _, greedy = _propose(head, target, prefix, 11, 3, Sampler())
    seq = torch.cat([prefix, greedy.tokens])
    with torch.no_grad():
        lg = head.ttt_logits(seq[None], torch.ones(1, seq.numel()), feats_of(target, head, seq[None])["aux"], target)
    assert [int(head.draft_ids[lg[i][0, 10].argmax()]) for i in range(3)] == greedy.tokens.tolist()
    full = layout_head(target, {"norm_output": True}, ttt_steps=3)  # same weights, no window
    with torch.no_grad():
        lf = full.ttt_logits(seq[None], torch.ones(1, seq.numel()), feats_of(target, full, seq[None])["aux"], target)
    assert float((lf[0] - lg[0]).abs().max()) > 1e-3
    _, tree = _propose(head, target, prefix, 11, 3, Sampler(), tree={"topk": 2, "total_tokens": 6})
    assert int(tree.tokens[0]) == int(greedy.tokens[0])


def test_layout_saved_and_reloaded(target, tmp_path):
    flags = LAYOUTS[-1]
    head = layout_head(target, flags)
    head.save_pretrained(tmp_path / "h")
    cfg = json.loads((tmp_path / "h" / "drafter_config.json").read_text())
    assert {k: cfg[k] for k in ALL_OFF} == {**ALL_OFF, **flags} and "input_norm.weight" in load_file(
        str(tmp_path / "h" / "model.safetensors"))
    back = Eagle3Head.from_pretrained(tmp_path / "h", target)
    assert back.layout == head.layout


def test_recipe_refuses_unsorted_aux_and_both_fc_norms():
    with pytest.raises(ValueError, match=r"aux_layers=\[5, 2, 4\]: give 3 layer ids in ascending order"):
        recipe_from_dict({"drafter": {"eagle3": {"aux_layers": [5, 2, 4]}}})
    with pytest.raises(ValueError, match="norm_before_fc and fc_norm are exclusive"):
        recipe_from_dict({"drafter": {"eagle3": {"norm_before_fc": True, "fc_norm": True}}})


def test_unsorted_checkpoint_sorted_with_fc_blocks(target, tmp_path):
    """A head saved with aux [5, 2, 4] (fc blocks in that order) loads and exports as [2, 4, 5] with fc's input
    blocks permuted: the same function, in the order engines feed fc; never silently."""
    head = layout_head(target, {"norm_before_fc": True})
    head.save_pretrained(tmp_path / "ok")
    state = load_file(str(tmp_path / "ok" / "model.safetensors"))
    order = [2, 0, 1]  # aux [5, 2, 4] = positions 2, 0, 1 of [2, 4, 5]
    for name in ("fc.weight", "input_norm.weight"):
        state[name] = torch.cat([state[name].chunk(3, -1)[i] for i in order], -1).contiguous()
    (tmp_path / "bad").mkdir()
    save_file(state, str(tmp_path / "bad" / "model.safetensors"))
    cfg = json.loads((tmp_path / "ok" / "drafter_config.json").read_text())
    (tmp_path / "bad" / "drafter_config.json").write_text(json.dumps({**cfg, "aux_layers": [5, 2, 4]}))
    from spectrain.io.integrity import seal

    seal(tmp_path / "bad")  # export refuses an unsealed checkpoint
    with pytest.warns(UserWarning, match=r"not ascending; fc's input blocks were reordered to \[2, 4, 5\]"):
        back = Eagle3Head.from_pretrained(tmp_path / "bad", target)
    assert back.aux_layers == [2, 4, 5] and torch.equal(back.fc.weight, head.fc.weight)
    s = E.export(tmp_path / "bad", "vllm-eagle3", tmp_path / "out")
    assert any("reordered" in w for w in s["warnings"]) and s["aux_layer_ids_written"] == [2, 4, 5]
    assert torch.equal(load_file(str(tmp_path / "out" / "model.safetensors"))["fc.weight"], head.fc.weight)


# ---- import: SGLang format, refusals -----------------------------------------------------------
def test_sglang_export_imports_back_with_and_without_vocab_maps(target, tmp_path):
    head = layout_head(target, {}, draft_vocab_size=target.vocab_size)  # full vocab: d2t/t2d optional
    head.save_pretrained(tmp_path / "h")
    E.export(tmp_path / "h", "sglang-eagle3", tmp_path / "s")
    back = import_eagle3(tmp_path / "s", target)
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), back.state_dict().values()))
    state = load_file(str(tmp_path / "s" / "model.safetensors"))
    for k in ("d2t", "t2d"):
        state.pop(k)
    state["embed_tokens.weight"] = target.embed_tokens.weight.detach().clone()  # stored, equal to the target's
    save_file(state, str(tmp_path / "s" / "model.safetensors"))
    back = import_eagle3(tmp_path / "s", target)
    assert torch.equal(back.lm_head.weight, head.lm_head.weight) and back.t2d.all()


def _edit(d, config=None, tensors=None):
    if config:
        c = json.loads((d / "config.json").read_text())
        config(c)
        (d / "config.json").write_text(json.dumps(c))
    if tensors:
        t = load_file(str(d / "model.safetensors"))
        tensors(t)
        save_file(t, str(d / "model.safetensors"))


@pytest.mark.parametrize("config,tensors,match", [
    (lambda c: c["transformer_layer_config"].update(model_type="qwen3"), None, "model_type='qwen3'"),
    (lambda c: c["transformer_layer_config"].update(layer_types=["sliding_attention"], sliding_window=None), None,
     "full and windowed"),
    (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 4, 8]), None, "aux layer ids .* do not fit"),
    (lambda c: c["transformer_layer_config"].update(vocab_size=256), None, "target_vocab_size=256"),
    (None, lambda t: t["embed_tokens.weight"].add_(1.0), "embed_tokens.weight differs"),
    (None, lambda t: (t.pop("d2t"), t.pop("t2d")), "no d2t/t2d mapping"),
    (None, lambda t: t.update({"fc.bias": torch.zeros(32)}), r"tensors \['fc.bias'\] have no counterpart"),
    (lambda c: c.update(norm_output=False, norm_before_fc=False), None, r"tensors \['input_norm.weight'\]"),
])
def test_import_refuses_what_it_cannot_represent(target, tmp_path, config, tensors, match):
    head = layout_head(target, {"norm_before_fc": True})
    head.save_pretrained(tmp_path / "h")
    tdir = tmp_path / "t"
    target.model.save_pretrained(tdir)
    E.export(tmp_path / "h", "vllm-eagle3", tmp_path / "v", target=str(tdir))
    _edit(tmp_path / "v", config, tensors)
    with pytest.raises(ValueError, match=match):
        import_eagle3(tmp_path / "v", target)


def test_packed_ttt_takes_a_window_longer_than_the_row(target):
    """speculators' default 2048 window masks nothing in a short packed row: packing trains that layout; a window
    shorter than the row is refused by name (packed windowed attention is not implemented)."""
    from spectrain.data.packing import PackedDocs

    ids = torch.randint(3, target.vocab_size, (1, 14), generator=torch.Generator().manual_seed(5))
    docs = PackedDocs(torch.tensor([6, 8]))
    wide = layout_head(target, LAYOUTS[-1], sliding_window=2048)
    aux = feats_of(target, wide, ids)["aux"]
    with torch.no_grad():
        packed = wide.ttt_logits(ids, torch.ones_like(ids), aux, target, 2, docs=docs)
        alone = wide.ttt_logits(ids[:, :6], torch.ones(1, 6), aux[:, :6], target, 2)  # document 0 on its own
    torch.testing.assert_close(packed[0][0, :5], alone[0][0, :5], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="sliding_window shorter than the packed row"):
        layout_head(target, {}, sliding_window=4).ttt_logits(ids, torch.ones_like(ids), aux, target, 2, docs=docs)


def test_eagle_original_layout_pytorch_bin_without_eagle_config(target, tmp_path):
    """The EAGLE repository's shape: pytorch_model.bin, no eagle_config (SGLang's default capture layers
    {1, N//2-1, N-4} as outputs = inputs [2, 4, 5] on 8 layers), draft_vocab_size in the config."""
    head = layout_head(target, {})
    head.save_pretrained(tmp_path / "h")
    E.export(tmp_path / "h", "sglang-eagle3", tmp_path / "s")
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    del cfg["eagle_config"]
    (tmp_path / "s" / "config.json").write_text(json.dumps(cfg))
    torch.save(load_file(str(tmp_path / "s" / "model.safetensors")), tmp_path / "s" / "pytorch_model.bin")
    (tmp_path / "s" / "model.safetensors").unlink()
    with pytest.warns(UserWarning, match=r"using SGLang's default layer outputs \[1, 3, 4\]"):
        back = import_eagle3(tmp_path / "s", target)
    assert back.aux_layers == [2, 4, 5] == head.aux_layers
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), back.state_dict().values()))
