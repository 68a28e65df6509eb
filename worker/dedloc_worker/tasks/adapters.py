"""Adapter runs: a LoRA adapter (peft) on a frozen base; only the adapter is trained, averaged and checkpointed.

Every peer builds the same base (the run's seed or pretrained weights) and the same initial adapter (LoRA's A
matrices drawn from the run's seed, its B matrices zero), so the swarm starts from one state as in a full run. The
collaborative optimizer is given the trainable parameters alone (``trainable``): the gradient rounds, the state
rounds, CenteredClip, receipts and checkpoints see the adapter's tensors and nothing of the base.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import List, Optional

import torch

from dedloc_worker.errors import ConfigError

MERGED_FOLDER = "merged"  # in a checkpoint: the base with the adapter merged in, for from_pretrained alone


def apply_adapter(model: torch.nn.Module, options: dict, seed: int) -> torch.nn.Module:
    """``model`` wrapped with the LoRA adapter ``options`` describe (``dedloc_common.tasks.AdapterOptions``), its
    initial weights drawn from ``seed``; ``ConfigError`` in one line when peft cannot adapt this model."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ConfigError("this run trains an adapter: install peft (pip install 'peft>=0.13')") from None
    from transformers.pytorch_utils import Conv1D

    # GPT-2's layers are Conv1D, weights stored transposed: peft must be told (it warns and fixes it otherwise)
    transposed = any(isinstance(module, Conv1D) for module in model.modules())
    config = LoraConfig(r=options["rank"], lora_alpha=options["alpha"], lora_dropout=options["dropout"],
                        target_modules=options.get("target_modules"), fan_in_fan_out=transposed)
    if getattr(model, "is_quantized", False):  # a bitsandbytes base: its norms in float32, inputs that carry grads
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    torch.manual_seed(seed)
    try:
        with warnings.catch_warnings():  # peft 0.21 calls an API transformers 5 deprecates: nothing to act on here
            warnings.filterwarnings("ignore", ".*is_gradient_checkpointing.*is deprecated", FutureWarning)
            return get_peft_model(model, config)
    except ValueError as e:  # no module matched, or a model type peft has no default targets for
        first = str(e).splitlines()[0]
        raise ConfigError(f"task_options.adapter: peft cannot adapt this model ({first}); name target_modules "
                          "that exist in it") from None


def trainable(model: torch.nn.Module) -> List[torch.nn.Parameter]:
    """The parameters a run trains: all of a full run's, an adapter run's adapter alone."""
    return [p for p in model.parameters() if p.requires_grad]


def save_adapter(model: torch.nn.Module, folder: Path, unquantized_base: Optional[torch.nn.Module] = None) -> None:
    """The adapter (``PeftModel.from_pretrained(base, folder)``) and, in ``folder/merged``, the base with the adapter
    merged in (``from_pretrained`` alone). Merging works on a copy: the model keeps training. A quantized base's
    adapter is merged into ``unquantized_base``, the base as stored, as QLoRA's adapters are: the export then needs
    neither bitsandbytes nor the quantized weights' rounding."""
    # the base's embeddings are the base's, unchanged (an adapter on an output layer saves its low-rank update only)
    model.save_pretrained(folder, safe_serialization=True, save_embedding_layers=False)
    if unquantized_base is None:
        merged = copy.deepcopy(model).merge_and_unload()
    else:
        from peft import PeftModel

        merged = PeftModel.from_pretrained(unquantized_base, folder).merge_and_unload()
    merged.save_pretrained(Path(folder) / MERGED_FOLDER, safe_serialization=True)
