"""Build the bundled reference target (assets/reference-target/) from the shipped data, from scratch.

    python scripts/build_reference_target.py                      # the committed build (CPU, ~45 min, 2 cores)
    python scripts/build_reference_target.py --steps 20 --out /tmp/ref-smoke   # a smoke build
    python scripts/build_reference_target.py --trial 10          # measure tokens/s, write nothing

Steps: train a byte-level BPE tokenizer (8192 tokens) on the training split of data/, build a
Llama (8 layers, hidden 256) and train it on chat conversations rendered with the chat template
(so it learns the turn format and to stop with ``<|end|>``) plus Shakespeare and C4 prose. The step
count is fixed (not a time limit), so the result is reproducible from ``--seed``; a CUDA device is
used when present, with the same steps. Held-out conversations follow the rule the data pipeline
uses (sha1 of the record id), so held-out prompts are unseen by the target as well.
Output: a plain HF model directory (config, safetensors, tokenizer, generation config) plus
README.md and build_info.json with the measured numbers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data"
CHAT_FILE = DATA / "train" / "chat_mix_messages.jsonl"
SHAKESPEARE_FILE = DATA / "pretrain" / "tinyshakespeare.txt"
C4_FILE = DATA / "pretrain" / "c4_demo.jsonl"

BOS, EOS_DOC, PAD, SYSTEM, USER, ASSISTANT, END = (
    "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
SPECIAL_TOKENS = [PAD, BOS, EOS_DOC, SYSTEM, USER, ASSISTANT, END]  # ids 0..6, in this order

# `{% generation %}` marks the assistant tokens so `return_assistant_tokens_mask` works in HF.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '<|system|>\n' + message['content'] + '<|end|>\n' }}"
    "{% elif message['role'] == 'user' %}{{ '<|user|>\n' + message['content'] + '<|end|>\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>\n' }}"
    "{% generation %}{{ message['content'] + '<|end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ raise_exception('unknown role ' + message['role'] + '; use system, user or assistant') }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

SAMPLE_PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a Python function that returns the factorial of a number."}],
    [{"role": "user", "content": "Give me three tips for staying healthy."}],
    [{"role": "system", "content": "You are a pirate. Answer in character."},
     {"role": "user", "content": "Where is the treasure?"}],
]


def is_heldout(row_id: str) -> bool:
    """The project-wide held-out rule (spectrain/data/chat.py uses the same): ~5% of ids, by sha1."""
    return int(hashlib.sha1(row_id.encode()).hexdigest()[:8], 16) / 2**32 < 0.05


def load_chat(path: Path = CHAT_FILE) -> tuple[list[dict], list[dict]]:
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; copy it from ../shared/data/train (see data/README.md)")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    train = [r for r in rows if not is_heldout(r["id"])]
    heldout = [r for r in rows if is_heldout(r["id"])]
    return train, heldout


def load_prose() -> list[str]:
    """Shakespeare in ~2000-character chunks cut at blank lines, plus the C4 documents."""
    docs, chunk = [], ""
    for para in SHAKESPEARE_FILE.read_text(encoding="utf-8").split("\n\n"):
        chunk = f"{chunk}\n\n{para}" if chunk else para
        if len(chunk) > 2000:
            docs.append(chunk)
            chunk = ""
    if chunk:
        docs.append(chunk)
    with C4_FILE.open(encoding="utf-8") as f:
        docs += [json.loads(line)["text"] for line in f if line.strip()]
    return docs


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE via `tokenizers`, wrapped so AutoTokenizer loads it with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    # eos = end of turn: generation must stop at <|end|>, not at a document separator.
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=END, pad_token=PAD,
                                   additional_special_tokens=[EOS_DOC, SYSTEM, USER, ASSISTANT],
                                   chat_template=CHAT_TEMPLATE, model_max_length=2048, clean_up_tokenization_spaces=False)


def portable_tokenizer_config(out: Path) -> None:
    """Keep the chat template inside tokenizer_config.json and use class/key names that transformers 4.x
    also reads (5.x writes a separate chat_template.jinja, `TokenizersBackend` and a list-valued
    `extra_special_tokens`, which 4.x cannot load)."""
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text(encoding="utf-8"))
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    if isinstance(cfg.get("extra_special_tokens"), list):
        cfg["additional_special_tokens"] = cfg.pop("extra_special_tokens")
    jinja = out / "chat_template.jinja"
    cfg["chat_template"] = jinja.read_text(encoding="utf-8") if jinja.exists() else CHAT_TEMPLATE
    jinja.unlink(missing_ok=True)
    path.write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")


def render(tokenizer, messages: list[dict], **kw) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)
    return list(out["input_ids"])


def token_stream(tokenizer, chats: list[dict], prose: list[str]) -> tuple[torch.Tensor, dict]:
    """Every conversation (chat template) and prose document (<s> text </s>) in one shuffled stream."""
    docs = [render(tokenizer, r["messages"]) for r in chats]
    n_chat = sum(map(len, docs))
    bos, eos = tokenizer.convert_tokens_to_ids([BOS, EOS_DOC])
    prose_docs = [[bos, *tokenizer(t, add_special_tokens=False)["input_ids"], eos] for t in prose]
    docs += prose_docs
    random.Random(0).shuffle(docs)
    stream = torch.tensor([t for d in docs for t in d], dtype=torch.long)
    return stream, {"chat_tokens": n_chat, "prose_tokens": len(stream) - n_chat}


def build_model(vocab_size: int, tokenizer, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    ids = dict(zip(["bos", "eos", "pad"], tokenizer.convert_tokens_to_ids([BOS, END, PAD])))
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=256, intermediate_size=704, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
                      bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"])
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))  # cosine down to 10%


def train(model, stream: torch.Tensor, args, device: torch.device) -> dict:
    """Packed next-token training over non-overlapping windows, reshuffled every epoch."""
    L, B = args.seq_len, args.batch_size
    n_win = (len(stream) - 1) // L
    gen = torch.Generator().manual_seed(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=False)
    warmup = max(1, int(0.05 * args.steps))
    model.to(device).train()
    order, pos, epoch, t0, losses = torch.randperm(n_win, generator=gen), 0, 0, time.time(), []
    for step in range(args.steps):
        if pos + B > n_win:
            order, pos, epoch = torch.randperm(n_win, generator=gen), 0, epoch + 1
        starts = order[pos:pos + B] * L
        pos += B
        batch = torch.stack([stream[s:s + L + 1] for s in starts.tolist()]).to(device)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, warmup)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                 batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % args.log_every == 0 or step == args.steps - 1:
            el = time.time() - t0
            tps = (step + 1) * B * L / el
            eta = (args.steps - step - 1) * el / (step + 1)
            print(f"step {step:5d}/{args.steps} epoch {epoch} loss {sum(losses[-args.log_every:]) / len(losses[-args.log_every:]):.4f} "
                  f"lr {lr_at(step, args.steps, args.lr, warmup):.2e} tok/s {tps:.0f} eta {eta / 60:.1f} min", flush=True)
    el = time.time() - t0
    return {"train_seconds": round(el, 1), "tokens_seen": args.steps * B * L, "epochs": round(args.steps * B / n_win, 2),
            "tokens_per_second": round(args.steps * B * L / el), "final_train_loss": round(sum(losses[-50:]) / len(losses[-50:]), 4)}


@torch.no_grad()
def heldout_loss(model, tokenizer, rows: list[dict], device: torch.device, max_len: int) -> dict:
    """Per-token loss over whole held-out conversations, and over assistant tokens only."""
    model.eval()
    tot, n, a_tot, a_n = 0.0, 0, 0.0, 0
    for r in rows:
        enc = tokenizer.apply_chat_template(r["messages"], tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        ids = torch.tensor(enc["input_ids"][:max_len], device=device)[None]
        mask = torch.tensor(enc["assistant_masks"][:max_len], device=device)[1:].bool()
        logits = model(input_ids=ids).logits[0, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")
        tot, n = tot + nll.sum().item(), n + nll.numel()
        a_tot, a_n = a_tot + nll[mask].sum().item(), a_n + int(mask.sum())
    return {"heldout_conversations": len(rows), "heldout_tokens": n, "heldout_loss": round(tot / n, 4),
            "heldout_ppl": round(math.exp(tot / n), 2), "heldout_assistant_tokens": a_n,
            "heldout_assistant_loss": round(a_tot / a_n, 4), "heldout_assistant_ppl": round(math.exp(a_tot / a_n), 2)}


@torch.no_grad()
def samples(model, tokenizer, prompts: list[list[dict]], device: torch.device, max_new: int = 96) -> list[dict]:
    model.eval()
    out = []
    for messages in prompts:
        ids = torch.tensor([render(tokenizer, messages, add_generation_prompt=True)], device=device)
        gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             do_sample=False)[0, ids.shape[1]:]
        stopped = bool(len(gen) and gen[-1].item() == tokenizer.eos_token_id)
        out.append({"messages": messages, "completion": tokenizer.decode(gen, skip_special_tokens=True),
                    "new_tokens": len(gen), "stopped_at_end_of_turn": stopped})
    return out


def write_readme(out: Path, info: dict) -> None:
    n = info
    lines = [
        "# reference-target", "",
        "A small Llama-architecture chat model trained from scratch on CPU by "
        "`scripts/build_reference_target.py`. It is the frozen target that the tiny recipes, tests and demos "
        "use; it is not a useful assistant, but it follows the chat format and stops at `<|end|>`.", "",
        "Load it with plain transformers, no network: `AutoModelForCausalLM.from_pretrained(path)`, "
        "`AutoTokenizer.from_pretrained(path)`.", "",
        "## Model", "",
        f"- LlamaForCausalLM: {n['num_layers']} layers, hidden {n['hidden_size']}, {n['num_heads']} heads, "
        f"intermediate {n['intermediate_size']}, vocab {n['vocab_size']}, max positions 2048, tied embeddings",
        f"- parameters: {n['parameters']:,} ({n['weights_mb']} MB fp32 safetensors)",
        "- EAGLE-3 default aux layers (inputs of layers 2, N//2, N-3) = 2, 4, 5",
        f"- tokenizer: byte-level BPE, {n['vocab_size']} tokens, trained with `tokenizers` on the training split; "
        "special tokens `<pad>` `<s>` `</s>` `<|system|>` `<|user|>` `<|assistant|>` `<|end|>`",
        "- chat template (in tokenizer_config.json): `<s><|user|>\\n{content}<|end|>\\n<|assistant|>\\n{content}<|end|>\\n`, "
        "system turns as `<|system|>\\n{content}<|end|>\\n`; `add_generation_prompt` appends `<|assistant|>\\n`; "
        "assistant spans are wrapped in `{% generation %}` so `return_assistant_tokens_mask` works",
        "- eos (tokenizer, config, generation_config) = `<|end|>`; pad = `<pad>`", "",
        "## Data (all in `data/`, see data/README.md for origin and licenses)", "",
        f"- `data/train/chat_mix_messages.jsonl` (MIT / Apache-2.0 / CC0): {n['train_conversations']} conversations "
        f"rendered with the chat template ({n['chat_tokens']:,} tokens); {n['heldout_conversations']} held out by "
        "`sha1(id)[:8] / 2**32 < 0.05` (the rule spectrain's data pipeline uses) and never trained on",
        f"- `data/pretrain/tinyshakespeare.txt` (public domain) and `data/pretrain/c4_demo.jsonl` (ODC-BY 1.0): "
        f"{n['prose_tokens']:,} tokens", "",
        "## Training", "",
        f"- seed {n['seed']}, {n['steps']} steps x {n['batch_size']} x {n['seq_len']} packed tokens = "
        f"{n['tokens_seen']:,} tokens seen ({n['epochs']} epochs), AdamW (0.9, 0.95, wd 0.1), peak lr {n['lr']}, "
        "5% warmup then cosine to 10%, grad clip 1.0",
        f"- device {n['device']}, {n['threads']} threads; training {n['train_seconds'] / 60:.1f} min "
        f"({n['tokens_per_second']} tokens/s); whole build {n['build_seconds'] / 60:.1f} min",
        f"- final train loss {n['final_train_loss']}",
        f"- reproduce: `python scripts/build_reference_target.py --seed {n['seed']} --steps {n['steps']} "
        f"--batch-size {n['batch_size']} --seq-len {n['seq_len']} --lr {n['lr']}`",
        *([f"- note: {n['note']}"] if n.get("note") else []), "",
        "## Held-out evaluation", "",
        f"- {n['heldout_conversations']} held-out conversations, {n['heldout_tokens']:,} tokens: "
        f"loss {n['heldout_loss']}, perplexity {n['heldout_ppl']}",
        f"- assistant tokens only ({n['heldout_assistant_tokens']:,}): loss {n['heldout_assistant_loss']}, "
        f"perplexity {n['heldout_assistant_ppl']}", "",
        "## Sample greedy generations (chat template, stop at `<|end|>`)", "",
    ]
    for s in n["samples"]:
        prompt = " / ".join(f"{m['role']}: {m['content']}" for m in s["messages"])
        lines += [f"**{prompt}**", "", "```text", s["completion"].strip(), "```",
                  f"({s['new_tokens']} tokens, stopped at <|end|>: {s['stopped_at_end_of_turn']})", ""]
    (out / "README.md").write_text("\n".join(lines), encoding="utf-8")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "assets" / "reference-target")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 autocast for the forward pass (weights and optimizer stay fp32); default: on "
                        "for CUDA, off on CPU (CPU bf16 autocast measured ~3x slower than fp32 here)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--trial", type=int, default=0, help="time N training steps, print tokens/s, write nothing")
    p.add_argument("--readme-only", action="store_true", help="rewrite OUT/README.md from OUT/build_info.json")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.readme_only:
        write_readme(args.out, json.loads((args.out / "build_info.json").read_text(encoding="utf-8")))
        return
    t_start = time.time()
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.bf16 is None:
        args.bf16 = device.type == "cuda"
    train_rows, heldout_rows = load_chat()
    prose = load_prose()
    print(f"chat: {len(train_rows)} train / {len(heldout_rows)} held-out conversations; prose docs {len(prose)}", flush=True)
    tok_texts = [m["content"] for r in train_rows for m in r["messages"]] + prose
    tokenizer = train_tokenizer(tok_texts, args.vocab_size)
    print(f"tokenizer trained: {len(tokenizer)} tokens ({time.time() - t_start:.0f}s)", flush=True)
    stream, counts = token_stream(tokenizer, train_rows, prose)
    print(f"stream: {len(stream):,} tokens ({counts}) ({time.time() - t_start:.0f}s)", flush=True)
    model = build_model(len(tokenizer), tokenizer, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters, device {device}", flush=True)
    if args.trial:
        args.steps = args.trial
        stats = train(model, stream, args, device)
        print(f"TRIAL {stats}", flush=True)
        return
    stats = train(model, stream, args, device)
    model = model.to("cpu").float()
    args.out.mkdir(parents=True, exist_ok=True)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.save_pretrained(args.out)  # saved before evaluation so a late failure loses no training
    tokenizer.save_pretrained(args.out)
    portable_tokenizer_config(args.out)
    evals = heldout_loss(model, tokenizer, heldout_rows, torch.device("cpu"), max_len=2048)
    print(f"held-out: {evals}", flush=True)
    prompts = SAMPLE_PROMPTS + [[r["messages"][0]] for r in heldout_rows[:2]]
    gens = samples(model, tokenizer, prompts, torch.device("cpu"))
    for g in gens:
        print(f"--- {g['messages'][-1]['content'][:80]!r}\n{g['completion']}", flush=True)
    cfg = model.config
    info = {"seed": args.seed, "steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
            "lr": args.lr, "bf16_autocast": args.bf16, "device": str(device), "threads": args.threads,
            "parameters": n_params, "num_layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size,
            "num_heads": cfg.num_attention_heads, "intermediate_size": cfg.intermediate_size,
            "vocab_size": cfg.vocab_size, "train_conversations": len(train_rows),
            **counts, **stats, **evals, "torch": torch.__version__, "samples": gens}
    info["weights_mb"] = round(sum(f.stat().st_size for f in args.out.glob("*.safetensors")) / 2**20, 1)
    info["build_seconds"] = round(time.time() - t_start, 1)
    (args.out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    write_readme(args.out, info)
    print(f"done in {info['build_seconds'] / 60:.1f} min -> {args.out}", flush=True)


if __name__ == "__main__":
    main()
