"""The frozen target: any Hugging Face causal LM, used as a feature extractor and verifier.

We never fork modelling code. Features come from forward hooks on the model's own modules:
- "input of decoder layer L" (the EAGLE / vLLM aux-layer convention) = a pre-hook on layers[L];
- the last layer's *pre-norm* output = a pre-hook on the final norm (``hidden_states[-1]`` in
  current transformers is already normed, so it cannot be used for that);
- the final normed hidden state = a hook on the final norm's output.

A 16-bit target's logits are fp32 wherever they decide a token (the fp32 head's argmax, exactly) and the model's
own 16-bit head elsewhere: spectrain/targets/logits.py says why and how.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from spectrain.recipe.deploy import eagle_default_aux
from spectrain.targets.auto_dtype import DtypeChoice, auto_cpu_dtype
from spectrain.targets.gguf import gguf_info, resolve_target_path
from spectrain.targets.logits import TargetHead, check_mode

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device = "cpu") -> torch.dtype:
    """The dtype to load in. 'auto': bf16 on CUDA, fp32 elsewhere; on a CPU `load_target` may then switch the
    loaded model to bf16 where the CPU computes it natively and it measures faster (targets/auto_dtype.py)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(sorted(DTYPES))}")
    return DTYPES[dtype]


@dataclass
class TargetOutput:
    logits: torch.Tensor | None
    aux_hidden: list[torch.Tensor] = field(default_factory=list)  # inputs of the requested layers
    last_hidden: torch.Tensor | None = None  # last decoder layer output, BEFORE the final norm
    final_hidden: torch.Tensor | None = None  # after the final norm (what lm_head sees)
    cache: object | None = None


class FrozenTarget:
    """A frozen, eval-mode HF causal LM with its tokenizer and hook-based feature taps."""

    def __init__(self, model: nn.Module, tokenizer=None, name_or_path: str | None = None, fp32_logits: bool = True,
                 logits: str = "screened"):
        model.eval()
        model.requires_grad_(False)
        self.model = model
        self.tokenizer = tokenizer
        self.config = model.config
        self.name_or_path = name_or_path or getattr(model.config, "_name_or_path", "")
        self.layers = _decoder_layers(model)
        self.norm = _final_norm(model)
        self.lm_head = model.get_output_embeddings()
        self.embed_tokens = model.get_input_embeddings()
        if self.lm_head is None or self.embed_tokens is None:
            raise ValueError(f"{type(model).__name__} has no input/output embeddings; not a causal LM?")
        # transformers >= 5.2x renamed `past_key_values` to `cache`; accept both.
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keeps_logits = "logits_to_keep" in params
        check_mode(logits)
        self.fp32_logits = fp32_logits  # 16-bit targets: fp32 logits where they decide a token (module doc)
        self.logits_mode = logits if fp32_logits else "native"
        self._head: TargetHead | None = None
        self.dtype_choice = DtypeChoice(str(self.dtype).replace("torch.", ""), "as loaded")

    # ---- facts -------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return _full_shape(self.embed_tokens.weight)[1]

    @property
    def vocab_size(self) -> int:
        return _full_shape(self.lm_head.weight)[0]

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def max_positions(self) -> int | None:
        return getattr(self.config, "max_position_embeddings", None)

    def default_aux_layers(self) -> list[int]:
        """EAGLE/vLLM convention: inputs of layers [2, N//2, N-3]."""
        n = self.num_layers
        ids = eagle_default_aux(n)
        if n < 6 or len(set(ids)) < 3:
            # Tiny targets: spread three distinct layers as evenly as the depth allows.
            ids = sorted({min(max(1, n // 4), n - 1), n // 2, max(n - 2, 1)})
        return ids

    def validate_aux_layers(self, ids) -> list[int]:
        n = self.num_layers
        ids = [int(i) for i in ids]
        for i in ids:
            if i >= n:
                raise ValueError(
                    f"aux layer id {i} is out of range for a target with {n} layers: ids are *inputs* of "
                    f"decoder layers, valid 0..{n - 1}; id {n} would be the final layer's output, which is "
                    f"the teacher signal and must not be an aux layer. Default: {self.default_aux_layers()}"
                )
            if i < 0:
                raise ValueError(f"aux layer id {i} is negative; use explicit ids in 0..{n - 1}")
        if len(set(ids)) != len(ids):
            raise ValueError(f"aux layer ids {ids} contain duplicates")
        return ids

    # ---- compute -----------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def logits_from_last_hidden(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """Rebuild teacher logits from the pre-norm last hidden state with the frozen norm + lm_head."""
        return self.lm_head(self.norm(last_hidden.to(self.dtype)))

    def upcasts_logits(self) -> bool:
        # ZeRO-3 shards cannot be copied whole; such targets keep their own head
        return self.logits_mode != "native" and self.dtype in (torch.bfloat16, torch.float16) and not hasattr(
            self.lm_head.weight, "ds_shape")

    def fp32_head_logits(self, last_hidden: torch.Tensor, mode: str | None = None) -> torch.Tensor:
        """fp32 logits from the pre-norm last hidden state in ``mode`` (default: the target's ``logits_mode``;
        "fp32": the full fp32 head, which the greedy check's margins use)."""
        if self._head is None:
            self._head = TargetHead(self.norm, self.lm_head)
        return self._head.logits(last_hidden, mode or self.logits_mode)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache=None,
        aux_layers=(),
        want_last_hidden: bool = False,
        want_final_hidden: bool = False,
        want_logits: bool = True,
        use_cache: bool | None = None,
        logits_mode: str | None = None,
        logits_from: int = 0,
    ) -> TargetOutput:
        """``logits_from``: logits only for positions >= it (a prompt riding on a verify pass needs none of its own)."""
        captured: dict = {}
        handles = []
        upcast = want_logits and self.upcasts_logits()
        for li in aux_layers:
            handles.append(self.layers[li].register_forward_pre_hook(_capture_input(captured, li), with_kwargs=True))
        if want_last_hidden or upcast:
            handles.append(self.norm.register_forward_pre_hook(_capture_input(captured, "last"), with_kwargs=True))
        if want_final_hidden or not want_logits:
            handles.append(self.norm.register_forward_hook(_capture_output(captured, "final")))
        try:
            kwargs = dict(attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=cache is not None if use_cache is None else use_cache)
            if cache is not None:
                kwargs[self._cache_kw] = cache
            if want_logits and not upcast:
                keep = input_ids.shape[1] - logits_from
                if logits_from and self._keeps_logits:
                    kwargs["logits_to_keep"] = keep
                out = self.model(input_ids, **kwargs)
                logits = out.logits[:, -keep:]
            else:  # skip the model's own (16-bit or unwanted) vocab projection
                out = self.model.get_decoder()(input_ids, **kwargs)
                logits = None
        finally:
            for h in handles:
                h.remove()
        if upcast:  # after the taps are gone: the fp32 copies must not inherit them
            logits = self.fp32_head_logits(captured["last"][:, logits_from:], logits_mode)
        new_cache = getattr(out, self._cache_kw, None)
        dev = self.device  # with a device_map the taps sit on different GPUs; callers get one device

        def here(x):
            return None if x is None else x.to(dev)

        return TargetOutput(
            logits=here(logits),
            aux_hidden=[here(captured[li]) for li in aux_layers],
            last_hidden=here(captured.get("last")) if want_last_hidden else None,
            final_hidden=here(captured.get("final")),
            cache=new_cache if new_cache is not None else cache,
        )

    __call__ = forward


def _full_shape(w: torch.Tensor) -> tuple:
    # DeepSpeed ZeRO-3 partitions weights to shape (0,) and keeps the real one in ds_shape.
    return tuple(getattr(w, "ds_shape", w.shape))


def gathered(params) -> contextlib.AbstractContextManager:
    """Inside the block, ZeRO-3-partitioned parameters hold their full values (collective: every rank must
    enter). A no-op for ordinary parameters."""
    # Only the ones not already whole: DeepSpeed refuses nested gathers of the same parameter.
    params = [p for p in params if hasattr(p, "ds_shape") and p.data.numel() != p.ds_numel]
    if params:
        import deepspeed

        return deepspeed.zero.GatheredParameters(params)
    return contextlib.nullcontext()


def _capture_input(store: dict, key):
    def hook(module, args, kwargs):
        h = args[0] if args else kwargs["hidden_states"]
        store[key] = h.detach()

    return hook


def _capture_output(store: dict, key):
    def hook(module, args, output):
        store[key] = (output[0] if isinstance(output, tuple) else output).detach()

    return hook


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    for name in ("layers", "h", "blocks"):
        layers = getattr(decoder, name, None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise ValueError(
        f"cannot find the decoder layers of {type(model).__name__} (looked for .layers/.h/.blocks on its "
        "decoder); spectrain supports decoder-only HF causal LMs"
    )


def _final_norm(model: nn.Module) -> nn.Module:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    for name in ("norm", "final_layernorm", "ln_f"):
        norm = getattr(decoder, name, None)
        if isinstance(norm, nn.Module):
            return norm
    raise ValueError(f"cannot find the final norm of {type(model).__name__} (looked for norm/final_layernorm/ln_f)")


def looks_local(src: str) -> bool:
    """A path rather than a hub id (``org/name``): a missing one is "not found", not a hub lookup."""
    return src.startswith((".", "/", "~")) or src.count("/") > 1 or ("/" in src and Path(src.split("/")[0]).is_dir())


def _check_source(name_or_path, device) -> None:
    """Fail with the cause before transformers does (its errors for these are long and indirect)."""
    if not isinstance(name_or_path, (str, os.PathLike)) or not str(name_or_path).strip():
        raise ValueError(f"load_target: name_or_path must be a non-empty hub id or model directory, got "
                         f"{name_or_path!r}")
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise ValueError(f"device {str(device)!r} is not a torch device: use cpu, cuda, cuda:1, mps ...") from None
    if kind != "cpu" and not getattr(getattr(torch, kind, None), "is_available", lambda: True)():
        raise ValueError(f"device {str(device)!r} is not available in this torch build/machine (torch "
                         f"{torch.__version__}, {kind} available: no); use --device cpu or install a {kind} build")
    p = Path(str(name_or_path)).expanduser()
    if not p.exists() and looks_local(str(name_or_path)):
        raise FileNotFoundError(f"target model dir not found: {name_or_path} (relative to {Path.cwd()}); build or "
                                "download it, or give an HF hub id")
    if p.is_dir() and not (p / "config.json").is_file():
        raise FileNotFoundError(f"target {str(name_or_path)!r} is a directory without config.json: not an HF model "
                                "directory; give the model's own directory or a hub id")
    if p.is_file():
        raise ValueError(f"target {str(name_or_path)!r} is a file: give an HF model directory, a .gguf file or a "
                         "hub id")


def load_target(
    name_or_path: str,
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device | None = None,
    device_map=None,
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
    gguf_file: str = "",
    fp32_logits: bool = True,
    verify_tokens: int = 6,
    logits: str = "screened",
) -> FrozenTarget:
    """Load any HF causal LM (hub id or local dir) frozen, in eval mode, with its tokenizer. A GGUF file
    (a ``.gguf`` path, or a dir / hub repo plus ``gguf_file``) loads its cached dequantized checkpoint
    (spectrain/targets/gguf.py), made on first use. ``logits`` (16-bit targets; spectrain/targets/logits.py):
    "screened" = the fp32 head's argmax at the 16-bit head's cost, "fp32" = the full fp32 head, "native" = the
    model's own 16-bit logits; ``fp32_logits=False`` is "native". ``verify_tokens``: the pass width (k + 1) that ``dtype="auto"`` times on a CPU.
    ``target.dtype_choice`` says which dtype was used and why."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    shown, name_or_path = str(name_or_path), resolve_target_path(str(name_or_path), gguf_file)
    _check_source(name_or_path, device)
    torch_dtype = resolve_dtype(dtype, device)
    kwargs = dict(dtype=torch_dtype, trust_remote_code=trust_remote_code)
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if device_map is not None:
        kwargs["device_map"] = device_map
    try:
        model = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
    except OSError as e:
        raise OSError(
            f"could not load target {name_or_path!r}: {e}\nGive a local HF model directory or a hub id "
            "(hub access needs network; the bundled reference target is assets/reference-target)."
        ) from e
    if device_map is None:
        model.to(device)
    check_mode(logits)  # before any weights load
    logits = logits if fp32_logits else "native"
    choice = _dtype_choice(model, dtype, device, device_map, name_or_path, verify_tokens, logits)
    if choice.torch_dtype != torch_dtype:  # `auto` measured bf16 faster on this CPU
        model.to(choice.torch_dtype)
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    target = FrozenTarget(model, tokenizer, name_or_path=shown, logits=logits)
    target.dtype_choice = choice
    target.load_path = name_or_path  # what transformers loaded (the dequantized checkpoint for a GGUF)
    target.gguf = gguf_info(name_or_path) if Path(name_or_path).is_dir() else None
    return target


def _dtype_choice(model, dtype, device, device_map, path: str, verify_tokens: int, logits: str) -> DtypeChoice:
    """Why the target runs in its dtype (eval reports print this)."""
    name = str(resolve_dtype(dtype, device)).replace("torch.", "")
    if dtype not in (None, "auto"):
        return DtypeChoice(name, f"{name}: asked for (dtype={str(dtype).replace('torch.', '')})")
    if device_map is not None or torch.device(device).type != "cpu":
        return DtypeChoice(name, f"{name}: auto on {torch.device(device).type}")
    key = str(Path(path).resolve()) if Path(path).exists() else path

    def wrap(m):
        return FrozenTarget(m, logits=logits)

    return auto_cpu_dtype(model, wrap, f"{key}|logits={logits}", verify_tokens)  # the head's mode changes the timing
