"""Multi-process training on CPU (gloo): real process groups, the real loop, the real entry point.

What runs where is checked from inside every process (rank / world size / backend written to a
file), never assumed from the launch line: on these machines `accelerate launch --cpu
--num_processes 2` starts ONE process, and torchrun without ACCELERATE_USE_CPU=1 starts two that
each believe they are alone.

The equivalence tests train the same recipe (tiny random Llama target + tiny BPE tokenizer + tiny
chat data, all built in a temp dir) twice: 1 process with gradient accumulation 2, and 2 processes
(global batch unchanged, accumulation 1). The drafter weights after N optimizer steps must agree
to 1e-5. The worker side of this file (``python tests/test_distributed.py MODE ...``) is what
torchrun / accelerate launch start; it instruments the loop's data source to record which rows
every rank trained on.
"""

from __future__ import annotations

import functools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from spectrain.data.chat import is_heldout

REPO = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve()
TOL = 1e-5

SPECIAL = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ '<|user|>\n' + m['content'] + '<|end|>\n' }}"
    "{% else %}{{ '<|assistant|>\n' + m['content'] + '<|end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
WORDS = "red green blue cat dog sun moon tree river stone one two three four five six".split()


# ---- tiny assets, built in-process -------------------------------------------------------------------


def tiny_conversations(n: int, seed: int = 0) -> list[dict]:
    """Deterministic, learnable chats: the assistant repeats and extends the user's word list."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 9))]
        rows.append({"id": f"c{i}", "messages": [
            {"role": "user", "content": "repeat: " + " ".join(words)},
            {"role": "assistant", "content": " ".join(words + words[: rng.randint(1, 4)]) + " ."}]})
    return rows


def build_tiny_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="<|end|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_assets(root: Path, n_rows: int = 72) -> dict[str, Path]:
    """root/target (tiny random Llama + BPE tokenizer with a chat template), root/chat.jsonl."""
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import make_tiny_model

    rows = tiny_conversations(n_rows)
    data = root / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = build_tiny_tokenizer([m["content"] for r in rows for m in r["messages"]])
    vocab = len(tok)
    model = make_tiny_model("llama", vocab_size=vocab, seed=0)
    model.config.pad_token_id, model.config.bos_token_id = tok.pad_token_id, tok.bos_token_id
    model.config.eos_token_id = tok.eos_token_id
    target = root / "target"
    model.save_pretrained(target)
    tok.save_pretrained(target)
    return {"target": target, "data": data}


def write_recipe(root: Path, assets: dict[str, Path], name: str, **training) -> Path:
    import yaml

    t = {"global_batch_size": 8, "micro_batch_size": 4, "max_steps": 3, "warmup_steps": 1, "lr": 3e-3,
         "precision": "fp32", "eval_every": 0, "checkpoint_every": 0, "grad_clip": 1.0, "seed": 0}
    t.update(training)
    recipe = {
        "target": {"name_or_path": str(assets["target"]), "dtype": "float32"},
        "data": {"train_files": [str(assets["data"])], "max_length": 64, "heldout_fraction": 0.1,
                 "heldout_rows": 8, "cache_dir": str(root / "cache")},
        "drafter": {"kind": "eagle3", "eagle3": {"draft_vocab_size": 64, "ttt_steps": 3}},
        "training": t,
        "tracking": {"report_to": ["jsonl"]},
        "output_dir": str(root / "runs" / name),
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


# ---- launching -----------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@functools.cache
def extensions_dir() -> str:
    """One fresh JIT-build dir per test session (DeepSpeed builds its CPU comm op there): the tests never wait
    on a lock or load a build that an earlier, killed run on this machine left in ~/.cache/torch_extensions."""
    return tempfile.mkdtemp(prefix="spectrain-torch-ext-")


def launch(launcher: str, nproc: int, args: list[str], env: dict | None = None, config: Path | None = None,
           timeout: int = 900) -> subprocess.CompletedProcess:
    """Run this file's worker under `python`, `torchrun` or `accelerate launch`; fail loudly with its output."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
                "TORCH_EXTENSIONS_DIR": extensions_dir(), **(env or {})}
    full_env = {k: v for k, v in full_env.items() if v is not None}  # env={"X": None} removes X
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(k, None)  # never inherit a process group from the test runner
    if launcher == "python":
        cmd = [sys.executable, str(THIS)]
    elif launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(THIS)]
    elif launcher == "accelerate":
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
               "--num_processes", str(nproc), "--main_process_port", str(free_port()), str(THIS)]
    else:
        raise ValueError(f"unknown launcher {launcher!r}")
    return run_group(cmd + args, full_env, timeout)


def run_group(cmd: list[str], env: dict, timeout: int, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """subprocess.run for a launcher: the ranks are its children, so a timeout kills the whole session; else
    orphaned ranks would keep the cores (and any JIT build lock) from the tests that follow."""
    with subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"{' '.join(map(str, cmd[:4]))} ... timed out after {timeout} s:\n{out[-3000:]}\n{err[-6000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def check_ok(proc: subprocess.CompletedProcess) -> None:
    if proc.returncode != 0:
        pytest.fail(f"worker failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def read_records(out: Path) -> list[dict]:
    recs = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    return sorted(recs, key=lambda r: r["rank"])


def load_drafter_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted((run_dir / "last").glob("*.safetensors"))
    assert files, f"no safetensors weights under {run_dir / 'last'}"
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def max_weight_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    assert sorted(a) == sorted(b), f"different tensors: {sorted(set(a) ^ set(b))}"
    diffs = {k: float((a[k].double() - b[k].double()).abs().max()) if a[k].numel() else 0.0 for k in a}
    worst = max(diffs, key=diffs.get)
    return diffs[worst], worst


# ---- fixtures: each run is launched once and shared by the tests below ------------------------------------

N_ROWS = 72
N_TRAIN = sum(not is_heldout(f"c{i}", 0.1) for i in range(N_ROWS))  # the recipe's 10% held-out split
STEPS = N_TRAIN // 8  # one epoch at global batch 8; the trailing partial batch is dropped by design


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    return root, build_tiny_assets(root, N_ROWS)


@pytest.fixture(scope="module")
def recipe(assets):
    root, paths = assets
    return write_recipe(root, paths, "run", max_steps=0, epochs=1, checkpoint_every=4)


def _run(assets, recipe, name: str, launcher: str, nproc: int, extra: list[str] = (), **kw) -> dict:
    root = assets[0]
    out, rec = root / "runs" / name, root / f"records-{name}"
    proc = launch(launcher, nproc, ["train", str(rec), str(recipe), f"output_dir={out}", *extra], **kw)
    check_ok(proc)
    return {"out": out, "records": read_records(rec)}


@pytest.fixture(scope="module")
def reference(assets, recipe):
    """1 process, global batch 8 = 2 micro-batches of 4 accumulated."""
    return _run(assets, recipe, "single", "python", 1)


@pytest.fixture(scope="module")
def ddp(assets, recipe, reference):
    """2 processes through the shipped recipes/accelerate/cpu_ddp.yaml (the user's launch line)."""
    return _run(assets, recipe, "ddp", "accelerate", 2, config=REPO / "recipes/accelerate/cpu_ddp.yaml",
                env={"ACCELERATE_USE_CPU": "1"})


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# ---- tests -------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_torchrun_without_cpu_flag_is_refused(tmp_path):
    """Without ACCELERATE_USE_CPU=1 on a CPU machine each torchrun process would believe it is alone and
    train on all the data; the loop must refuse. (The working launch lines are checked from inside the
    processes by the fixtures: accelerate launch + cpu_ddp.yaml, torchrun in the resume test.)"""
    proc = launch("torchrun", 2, ["ranks", str(tmp_path / "no-cpu-flag")], env={"ACCELERATE_USE_CPU": None})
    assert proc.returncode != 0
    assert "ACCELERATE_USE_CPU=1" in proc.stdout + proc.stderr
    assert not list((tmp_path / "no-cpu-flag").glob("rank*.json"))


@pytest.mark.slow
def test_ranks_see_disjoint_shards_covering_the_data(reference, ddp):
    single, (r0, r1) = reference["records"], ddp["records"]
    assert [r["world"] for r in (r0, r1)] == [2, 2] and [r["rank"] for r in (r0, r1)] == [0, 1]
    assert r0["dist_world_size"] == 2 and r0["backend"] == "gloo"
    one = single[0]["micro_batches"]
    assert len(one) == 2 * STEPS and len(r0["micro_batches"]) == len(r1["micro_batches"]) == STEPS
    for s in range(STEPS):
        a, b = r0["micro_batches"][s], r1["micro_batches"][s]
        assert not set(a) & set(b), f"step {s}: ranks share rows {set(a) & set(b)}"
        # the same global batch, cut the same way: rank r holds the single process's micro-batch r
        assert (a, b) == (one[2 * s], one[2 * s + 1])
    rows = [i for r in (r0, r1) for mb in r["micro_batches"] for i in mb]
    assert len(rows) == len(set(rows)) == 8 * STEPS, "a row was trained twice in one epoch"
    assert set(rows) <= set(range(N_TRAIN)) and N_TRAIN - len(rows) < 8  # only the trailing partial batch


@pytest.mark.slow
def test_ddp_two_processes_match_one_process_with_accumulation(reference, ddp):
    ref, two = load_drafter_weights(reference["out"]), load_drafter_weights(ddp["out"])
    diff, key = max_weight_diff(ref, two)
    assert diff <= TOL, f"{key} differs by {diff:.3g}"
    # the comparison means something only if the steps moved the weights
    from safetensors.torch import load_file

    early = load_file(str(next((reference["out"] / "step-4").glob("*.safetensors"))))
    moved, _ = max_weight_diff(early, ref)
    assert moved > 100 * TOL
    # metrics are reduced across ranks and written once (main process only)
    m1 = [m for m in _metrics(reference["out"]) if "loss" in m and "split" not in m]
    m2 = [m for m in _metrics(ddp["out"]) if "loss" in m and "split" not in m]
    assert [m["step"] for m in m2] == list(range(1, STEPS + 1))
    for a, b in zip(m1, m2):
        assert abs(a["loss"] - b["loss"]) < 1e-6 and a["loss_tokens"] == b["loss_tokens"]
        assert a["tokens"] == b["tokens"]
    info = json.loads((ddp["out"] / "run_info.json").read_text())
    assert info["world_size"] == 2 and info["grad_accum"] == 1
    assert json.loads((reference["out"] / "run_info.json").read_text())["grad_accum"] == 2


@pytest.mark.slow
def test_resume_on_two_processes_from_a_one_process_checkpoint(assets, recipe, reference):
    step4 = reference["out"] / "step-4"
    assert json.loads((step4 / "trainer_state.json").read_text())["world_size"] == 1
    run = _run(assets, recipe, "resumed", "torchrun", 2, [f"training.resume_from={step4}"],
               env={"ACCELERATE_USE_CPU": "1"})
    recs = run["records"]
    assert [r["rank"] for r in recs] == [0, 1]
    assert all(r["world"] == 2 and r["dist_world_size"] == 2 and r["backend"] == "gloo" for r in recs), recs
    assert all(len(r["micro_batches"]) == STEPS - 4 for r in recs)  # only the steps after the checkpoint
    diff, key = max_weight_diff(load_drafter_weights(reference["out"]), load_drafter_weights(run["out"]))
    assert diff <= TOL, f"{key} differs by {diff:.3g}"
    assert json.loads((run["out"] / "run_info.json").read_text())["grad_accum"] == 1


@pytest.fixture(scope="module")
def zero2(assets, recipe):
    """2 processes under recipes/accelerate/zero2.yaml with CPU settings: no DeepSpeed JSON, so the batch sizes
    and clipping DeepSpeed needs come from the loop (filled from the recipe), as on a GPU node."""
    pytest.importorskip("deepspeed")
    import yaml

    root = assets[0]
    cfg = yaml.safe_load((REPO / "recipes/accelerate/zero2.yaml").read_text())
    cfg.update(num_processes=2, use_cpu=True, mixed_precision="no", gpu_ids=None)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (root / "zero2_cpu.yaml").write_text(yaml.safe_dump(cfg))
    # No workaround here: the loop itself names gloo for DeepSpeed on a CPU machine.
    return root / "zero2_cpu.yaml", _run(assets, recipe, "zero2", "accelerate", 2, config=root / "zero2_cpu.yaml")


@pytest.mark.slow
def test_deepspeed_zero2_two_processes_match_one_process(zero2, reference):
    recs = zero2[1]["records"]
    assert [r["rank"] for r in recs] == [0, 1]
    assert all(r["type"] == "DistributedType.DEEPSPEED" and r["world"] == 2 and r["dist_world_size"] == 2
               for r in recs), recs
    diff, key = max_weight_diff(load_drafter_weights(reference["out"]), load_drafter_weights(zero2[1]["out"]))
    assert diff <= TOL, f"{key} differs by {diff:.3g}"


@pytest.mark.slow
def test_deepspeed_zero2_resumes_under_forced_weights_only(assets, recipe, zero2):
    """A ZeRO-2 checkpoint (DeepSpeed's own optimizer files) resumes with every torch.load forced to
    weights_only (safe_resume; SPECTRAIN_TRUST_CHECKPOINT unset) and ends where the uninterrupted run ended."""
    config, full = zero2
    step4 = full["out"] / "step-4"
    assert (step4 / "accelerate").is_dir()
    run = _run(assets, recipe, "zero2-resumed", "accelerate", 2, [f"training.resume_from={step4}"], config=config,
               env={"SPECTRAIN_TRUST_CHECKPOINT": None})
    assert all(len(r["micro_batches"]) == STEPS - 4 for r in run["records"])  # only the steps after step 4
    diff, key = max_weight_diff(load_drafter_weights(full["out"]), load_drafter_weights(run["out"]))
    assert diff <= TOL, f"{key} differs by {diff:.3g}"


def test_a_stale_jit_build_lock_is_named_instead_of_hanging(tmp_path, monkeypatch):
    """A DeepSpeed op build killed mid-way leaves torch's `lock` file; DeepSpeed would wait on it forever (a CI
    run lost 30 minutes to this). The loop names the file before Accelerator() starts DeepSpeed; a fresh lock
    (another rank building right now) is left alone."""
    from spectrain.recipe.load import recipe_from_dict
    from spectrain.train.distributed import STALE_BUILD_LOCK_S, make_accelerator, refuse_stale_build_locks

    lock = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    refuse_stale_build_locks()  # a build in progress: wait for it, as DeepSpeed does
    old = lock.stat().st_mtime - STALE_BUILD_LOCK_S - 1
    os.utime(lock, (old, old))
    with pytest.raises(RuntimeError, match=r"stale build lock.*deepspeed_shm_comm/lock.*Delete them"):
        refuse_stale_build_locks()
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(RuntimeError, match="stale build lock"):
        make_accelerator(recipe_from_dict({"output_dir": str(tmp_path / "run")}))
    lock.unlink()
    refuse_stale_build_locks()
    # a lock that vanishes between the listing and its stat belongs to a build that just finished
    monkeypatch.setattr(Path, "glob", lambda self, pattern: iter([lock]))
    refuse_stale_build_locks()


# ---- worker side (run by the launchers above) ------------------------------------------------------------


def _identity() -> dict:
    import torch.distributed as dist

    return {"pid": os.getpid(), "env_world_size": int(os.environ.get("WORLD_SIZE", "1")),
            "dist_world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "dist_rank": dist.get_rank() if dist.is_initialized() else 0,
            "backend": dist.get_backend() if dist.is_initialized() else None}


def worker_ranks(out: Path) -> int:
    """Form accelerate's group the way the loop does and report what each process really is."""
    from spectrain.recipe.load import recipe_from_dict
    from spectrain.train.loop import make_accelerator

    recipe = recipe_from_dict({"training": {"global_batch_size": 8, "micro_batch_size": 4}, "output_dir": str(out)})
    acc = make_accelerator(recipe)
    rec = {"rank": acc.process_index, "world": acc.num_processes, "type": str(acc.distributed_type),
           "grad_accum": acc.gradient_accumulation_steps, **_identity()}
    (out / f"rank{acc.process_index}.json").write_text(json.dumps(rec))
    return 0


def worker_train(out: Path, recipe_path: str, overrides: list[str]) -> int:
    """Run the real loop (spectrain.train.loop.main) and record, per rank, the rows each micro-batch held."""
    from spectrain.train import loop as T
    from spectrain.train import setup as S  # setup() builds the sources: patch the name it calls

    seen: list[list[int]] = []
    original_get = T.OnlineSource.get

    def recording_get(self, indices):
        if self is getattr(recording_get, "train_src", self):
            seen.append(list(indices))
        return original_get(self, indices)

    original_make_sources = S.make_sources

    identity: dict = {}

    def recording_make_sources(*a, **kw):
        train, held = original_make_sources(*a, **kw)
        recording_get.train_src = train
        identity.update(_identity())  # now, while the process group is alive (end_training tears it down)
        params = list(a[1].model.parameters())  # the frozen target: how much of it does this rank hold?
        identity["target_params_here"] = sum(p.data.numel() for p in params)
        identity["target_params"] = sum(getattr(p, "ds_numel", p.numel()) for p in params)
        return train, held

    T.OnlineSource.get = recording_get
    S.make_sources = recording_make_sources
    code = T.main(recipe_path, overrides)
    from accelerate import PartialState

    state = PartialState()
    rec = {"rank": state.process_index, "world": state.num_processes, "type": str(state.distributed_type),
           "micro_batches": seen, "exit": code, **identity}
    (out / f"rank{state.process_index}.json").write_text(json.dumps(rec))
    return code


def _worker_main(argv: list[str]) -> int:
    sys.path.insert(0, str(REPO))
    torch.set_num_threads(1)
    mode, out = argv[0], Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    if mode == "ranks":
        return worker_ranks(out)
    if mode == "train":
        return worker_train(out, argv[2], argv[3:])
    raise SystemExit(f"unknown worker mode {mode!r}")


if __name__ == "__main__":
    raise SystemExit(_worker_main(sys.argv[1:]))
