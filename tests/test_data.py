"""Chat data: formats, bad-row accounting, loss masks decoded under two chat templates, splits, cache."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from spectrain.data.chat import is_heldout, load_conversations, tokenize_conversation
from spectrain.data.dataset import build_dataset, collate, heldout_prompts, token_frequencies
from spectrain.recipe.schema import DataConfig

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
SPECIALS = ["<pad>", "<|begin_of_text|>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"]
CORPUS = ["Hello there, how are you today?", "I am fine, thanks. The answer is 42.",
          "What is two plus two? Two plus two is four.", "system user assistant", "Be brief and exact."] * 20


def make_tokenizer(template: str, eos: str):
    """A tiny byte-level BPE fast tokenizer built in-process (no hub)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|begin_of_text|>", eos_token=eos,
                                  pad_token="<pad>")
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module", params=["chatml", "llama3"])
def tok_case(request):
    if request.param == "chatml":
        return make_tokenizer(CHATML, "<|im_end|>"), "<|im_end|>"
    return make_tokenizer(LLAMA3, "<|eot_id|>"), "<|eot_id|>"


CONV = [
    {"role": "system", "content": "Be brief and exact."},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "Two plus two is four."},
    {"role": "user", "content": "How are you today?"},
    {"role": "assistant", "content": "I am fine, thanks."},
]


def _masked_runs(tok, ids, mask) -> list[str]:
    """Decode each contiguous run of masked tokens separately."""
    runs, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


def test_loss_mask_decodes_to_assistant_replies(tok_case):
    tok, eot = tok_case
    ids, mask = tokenize_conversation(tok, CONV, max_length=512)
    assert len(ids) == len(mask) and ids == tok(tok.apply_chat_template(CONV, tokenize=False),
                                                add_special_tokens=False)["input_ids"]
    runs = _masked_runs(tok, ids, mask)
    assert runs == ["Two plus two is four." + eot, "I am fine, thanks." + eot]
    # Nothing of the prompt side is trained on.
    unmasked = tok.decode([t for t, m in zip(ids, mask) if not m])
    assert "What is two plus two?" in unmasked and "four" not in unmasked


# Renders the last reply with a "<think></think>" header but earlier replies without it (like
# reasoning templates that strip history), so the prefix property fails for earlier turns.
REWRITING = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' and loop.last %}"
    "<think></think>{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_loss_mask_template_that_rewrites_history():
    tok = make_tokenizer(REWRITING, "<|im_end|>")
    ids, mask = tokenize_conversation(tok, CONV, max_length=512)
    assert _masked_runs(tok, ids, mask) == ["Two plus two is four.<|im_end|>",
                                           "<think></think>I am fine, thanks.<|im_end|>"]
    # Rewriting the *text* of earlier replies cannot be mapped back: a clear error, not a wrong mask.
    upper = CHATML.replace("{{ m['content'] }}", "{% if m['role'] == 'assistant' and not loop.last %}"
                           "{{ m['content'] | upper }}{% else %}{{ m['content'] }}{% endif %}")
    with pytest.raises(ValueError, match="cannot locate an assistant reply"):
        tokenize_conversation(make_tokenizer(upper, "<|im_end|>"), CONV, max_length=512)


# A template with `{% generation %}` markers: HF's own assistant mask is an independent reference.
GENERATION = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_loss_mask_matches_hf_generation_mask():
    tok = make_tokenizer(GENERATION, "<|im_end|>")
    ids, mask = tokenize_conversation(tok, CONV, max_length=512)
    ref = tok.apply_chat_template(CONV, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert ids == list(ref["input_ids"]) and mask == list(ref["assistant_masks"])
    assert sum(mask) > 0


def test_truncation_keeps_prefix(tok_case):
    tok, _ = tok_case
    full_ids, full_mask = tokenize_conversation(tok, CONV, max_length=10_000)
    ids, mask = tokenize_conversation(tok, CONV, max_length=20)
    assert ids == full_ids[:20] and mask == full_mask[:20]


def _write_jsonl(path: Path, rows, gz: bool = False) -> str:
    text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return str(path)


def test_sharegpt_and_messages_formats(tmp_path):
    sg = [{"id": "s1", "conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                                         {"from": "gpt", "value": "Hello!"}]}]
    (tmp_path / "sg.json").write_text(json.dumps(sg))
    msgs = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}]
    f2 = _write_jsonl(tmp_path / "m.jsonl.gz", msgs, gz=True)
    rows, report = load_conversations([str(tmp_path / "sg.json"), f2])
    assert [r["messages"] for r in rows] == [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
    ]
    assert rows[0]["id"] == "s1" and len(rows[1]["id"]) == 16  # content-hash id when the row has none
    assert report.kept == 2 and not report.skipped
    # An explicit format that does not match the rows skips them all -> error naming the reason.
    with pytest.raises(ValueError, match="missing 'messages' field"):
        load_conversations([str(tmp_path / "sg.json")], format="messages")


def test_hf_datasets_dir(tmp_path):
    import datasets

    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"q{i}"},
                                         {"role": "assistant", "content": f"a{i}"}]} for i in range(3)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    got, _ = load_conversations([str(tmp_path / "ds")])
    assert [r["id"] for r in got] == ["r0", "r1", "r2"] and got[2]["messages"][1]["content"] == "a2"


def test_hub_dataset_name(monkeypatch):
    # No hub here: stand in for datasets.load_dataset and check what it is asked for.
    import datasets

    calls = []

    def fake_load_dataset(name, split=None):
        calls.append((name, split))
        if name == "org/missing":
            raise ConnectionError("offline")
        rows = [{"prompt_id": "p1", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}]
        return datasets.Dataset.from_list(rows)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    rows, _ = load_conversations(["org/chat:train_sft"])
    assert calls == [("org/chat", "train_sft")] and rows[0]["id"] == "p1"
    with pytest.raises(FileNotFoundError, match="cannot load 'org/missing' as a hub dataset"):
        load_conversations(["org/missing"])


def test_bad_rows_counted_by_reason(tmp_path, capsys):
    good = {"id": "g", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}
    bad = [
        "{not json",
        {"id": "b1", "messages": [{"role": "user", "content": "Hi"}]},  # no assistant turn
        {"id": "b2", "messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "x"}]},
        {"id": "b3", "messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}]},
        {"id": "b4", "messages": [{"role": "wizard", "content": "a"}, {"role": "assistant", "content": "x"}]},
        {"id": "b5", "messages": [{"role": "user"}]},
        {"id": "b6", "text": "plain"},
    ]
    f = _write_jsonl(tmp_path / "d.jsonl", [good, *bad])
    rows, report = load_conversations([f])
    assert [r["id"] for r in rows] == ["g"]
    assert report.seen == 8 and report.kept == 1
    assert report.skipped == {"malformed JSON line": 1, "no assistant turn": 1, "empty content": 1,
                              "non-string content": 1, "unknown role 'wizard'": 1,
                              "message missing 'role' or 'content'": 1,
                              "no 'messages' or 'conversations' field": 1}
    assert "skipped      1  no assistant turn" in str(report)
    with pytest.raises(ValueError, match="(?s)no usable conversations.*unknown role"):
        load_conversations([_write_jsonl(tmp_path / "bad.jsonl", bad)])
    with pytest.raises(FileNotFoundError, match="data file not found"):
        load_conversations(["./nope.jsonl"])


def test_overlong_rows_skipped(tmp_path, tok_case):
    tok, _ = tok_case
    long_user = " ".join(["Hello there"] * 200)
    rows = [{"id": "short", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]},
            {"id": "long", "messages": [{"role": "user", "content": long_user}, {"role": "assistant", "content": "ok"}]}]
    cfg = DataConfig(train_files=[_write_jsonl(tmp_path / "d.jsonl", rows)], max_length=64,
                     heldout_fraction=0.0, cache_dir=str(tmp_path / "cache"))
    ds = build_dataset(cfg, tok, "train", verbose=False)
    assert ds.ids == ["short"]
    assert ds.report.skipped == {"over-long: no assistant token within max_length=64": 1}
    empty = build_dataset(cfg, tok, "heldout", verbose=False)  # heldout_fraction=0: empty, not an error
    assert len(empty) == 0 and empty.lengths.numel() == 0
    with pytest.raises(ValueError, match="(?s)no usable rows in the train split.*over-long"):
        build_dataset(DataConfig(**{**cfg.__dict__, "max_length": 8}), tok, "train", verbose=False)


def test_is_heldout_rule_and_split_determinism(tmp_path):
    import hashlib

    for rid in ["a", "alpaca_libre/v1/line1", "x" * 50]:
        h = int(hashlib.sha1(rid.encode()).hexdigest()[:8], 16) / 2**32
        assert is_heldout(rid, h + 1e-9) and not is_heldout(rid, h)
    ids = [f"row{i}" for i in range(2000)]
    frac = sum(is_heldout(i, 0.1) for i in ids) / len(ids)
    assert 0.08 < frac < 0.12
    rows = [{"id": i, "messages": [{"role": "user", "content": f"q {i}"}, {"role": "assistant", "content": "a"}]}
            for i in ids[:300]]
    f1 = _write_jsonl(tmp_path / "a.jsonl", rows)
    f2 = _write_jsonl(tmp_path / "b.jsonl", rows[::-1])  # file order must not matter
    cfg1 = DataConfig(train_files=[f1], heldout_fraction=0.1, heldout_rows=0)
    cfg2 = DataConfig(train_files=[f2], heldout_fraction=0.1, heldout_rows=0)
    p1, p2 = heldout_prompts(cfg1, 1000), heldout_prompts(cfg2, 1000)
    assert sorted(map(str, p1)) == sorted(map(str, p2)) and 10 < len(p1) < 60
    assert all(p[-1]["role"] == "user" for p in p1)
    assert len(heldout_prompts(DataConfig(train_files=[f1], heldout_fraction=0.1, heldout_rows=5), 1000)) == 5


def test_build_dataset_splits_cache_collate_freqs(tmp_path, tok_case):
    tok, _ = tok_case
    rows = [{"id": f"c{i}", "messages": [{"role": "user", "content": "What is two plus two?"},
                                         {"role": "assistant", "content": "Two plus two is four." * (1 + i % 3)}]}
            for i in range(60)]
    f = _write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = DataConfig(train_files=[f], heldout_fraction=0.2, heldout_rows=0, cache_dir=str(tmp_path / "cache"))
    train = build_dataset(cfg, tok, "train", verbose=False)
    held = build_dataset(cfg, tok, "heldout", verbose=False)
    assert set(train.ids).isdisjoint(held.ids) and len(train) + len(held) == 60
    assert set(held.ids) == {r["id"] for r in rows if is_heldout(r["id"], 0.2)}
    assert len(list((tmp_path / "cache").glob("*.pt"))) == 2
    # Cache hit: same content back, and it is really read from disk (a poisoned file is returned as is).
    again = build_dataset(cfg, tok, "train", verbose=False)
    assert again.ids == train.ids and torch.equal(again.input_ids, train.input_ids)
    path = next(p for p in (tmp_path / "cache").glob("train-*.pt"))
    st = torch.load(path)
    st["ids"] = ["poisoned"] + st["ids"][1:]
    torch.save(st, path)
    assert build_dataset(cfg, tok, "train", verbose=False).ids[0] == "poisoned"
    # Changing a setting or the data changes the key -> rebuilt.
    cfg_short = DataConfig(**{**cfg.__dict__, "max_length": 40})
    assert build_dataset(cfg_short, tok, "train", verbose=False).ids[0] != "poisoned"
    batch = collate([train[0], train[1], train[2]], pad_id=tok.pad_token_id)
    n = max(len(train[i]["input_ids"]) for i in range(3))
    assert batch["input_ids"].shape == (3, n) and batch["input_ids"].dtype == torch.long
    for i in range(3):
        k = len(train[i]["input_ids"])
        assert batch["attention_mask"][i].sum() == k and (batch["input_ids"][i, k:] == tok.pad_token_id).all()
        assert torch.equal(batch["loss_mask"][i, :k], train[i]["loss_mask"])
    freqs = token_frequencies(train, len(tok))
    freqs_rows = token_frequencies(list(train), len(tok))
    assert torch.equal(freqs, freqs_rows) and freqs.sum() == sum(int(r["loss_mask"].sum()) for r in train)
    four = tok.encode(" four", add_special_tokens=False)
    assert freqs[four[0]] > 0 and freqs[tok.convert_tokens_to_ids("<|im_start|>")] == 0
