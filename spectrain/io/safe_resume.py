"""Resuming from a checkpoint that may come from anywhere: nothing in it is unpickled as objects.

Before accelerate reads a checkpoint, ``check_files`` verifies its SHA256SUMS, refuses a pickle spectrain
did not write (naming it) and reads the pickles it did write (accelerate's RNG states) as plain data only;
``load_engine_state`` then runs ``accelerator.load_state`` with every ``torch.load`` forced to
``weights_only=True`` (torch's TORCH_FORCE_WEIGHTS_ONLY_LOAD), allowing by name only the plain objects
DeepSpeed keeps in its optimizer state. SPECTRAIN_TRUST_CHECKPOINT=1 lifts the forcing, for a checkpoint
of your own whose engine stores some other object.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from spectrain.io import integrity

_ENGINE_PICKLES = ("random_states_",)  # accelerate's RNG states (numpy arrays, read with weights_only=True)
LEGACY_SCHEDULER = "custom_checkpoint_0.pkl"  # an older spectrain's LR schedule, through accelerate


def check_files(ckpt: Path, legacy: bool) -> None:
    """Integrity (SHA256SUMS) and no pickle spectrain did not write, before anything is loaded."""
    integrity.verify(ckpt, "checkpoint", fix="resume from another checkpoint of the run (training.resume_from="
                     "<run>/step-N) or start a fresh run; do not train on from damaged files", required=True)
    engine = ckpt / "accelerate"
    extra = integrity.untrusted_pickles(engine, _ENGINE_PICKLES + ((LEGACY_SCHEDULER,) if legacy else ()))
    if extra:
        raise integrity.IntegrityError(f"checkpoint {ckpt} holds {extra[0]}, a pickle spectrain did not write "
                                       "(it may run code when loaded): refusing to resume from it; remove the "
                                       "file only if you know where it came from, or use another checkpoint")
    from accelerate.utils.other import load as plain_load  # weights_only=True + numpy arrays allowed

    for f in sorted(engine.glob("*.pkl")):  # the allowed ones: RNG states (+ a legacy schedule)
        try:  # accelerate would swallow a failure on the RNG states and resume without them
            plain_load(f)
        except Exception as e:
            raise integrity.IntegrityError(f"checkpoint file {f} is not plain data ({type(e).__name__}): refusing "
                                           "to unpickle it (it could run code); use another checkpoint") from None


TRUST_ENV = "SPECTRAIN_TRUST_CHECKPOINT"


def trust_checkpoints() -> bool:
    """SPECTRAIN_TRUST_CHECKPOINT=1: let the engines unpickle what they wrote (for a checkpoint of your own
    whose engine stores an object the plain-data loader does not know). Never for a downloaded one."""
    return os.environ.get(TRUST_ENV, "") == "1"


def _engine_safe_globals() -> list:
    """Plain objects DeepSpeed keeps in its own optimizer state (ZeRO stage, loss scalers): allowed by name."""
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address  # ZeRO-2's param slices: (numel, start)
    except Exception:  # no DeepSpeed (or another layout): nothing to allow
        return []
    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


def _load_failure(e: Exception) -> str:
    text = " ".join(str(e).split())
    if "weights only" not in text.lower():
        return f"{type(e).__name__}: {text[:300]}; resume from another checkpoint or start a fresh run"
    what = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
    return (f"a file in it holds a pickled object{f' ({what.group(1)})' if what else ''}, not plain data, and is "
            f"not unpickled (it could run code); use another checkpoint, or, only for a checkpoint you wrote "
            f"yourself, rerun with {TRUST_ENV}=1")


def load_engine_state(accelerator, engine_dir: Path, legacy_scheduler=None) -> None:
    """``accelerator.load_state(engine_dir)`` with every torch.load forced to weights_only=True.
    ``legacy_scheduler``: the LR scheduler of an older checkpoint, registered for this one load only."""
    import torch

    if legacy_scheduler is not None:
        accelerator.register_for_checkpointing(legacy_scheduler)
    before = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    if not trust_checkpoints():
        os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals(_engine_safe_globals()):
            accelerator.load_state(str(engine_dir))
    except Exception as e:
        raise ValueError(f"cannot restore checkpoint {engine_dir}: {_load_failure(e)}") from e
    finally:
        if legacy_scheduler is not None:
            accelerator._custom_objects.remove(legacy_scheduler)  # saves write scheduler.json from now on
        if before is None:
            os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = before
