"""What a run trains: the built-in tasks' options, checked the same way by the portal (at run creation) and the
worker (before it loads anything). docs/tasks.md describes each option with an example.

``validate_task(task, options)`` returns the options with defaults filled in, or raises ``TaskOptionError`` whose
message names the option (``task_options.model.model_type: ...``).
"""

from __future__ import annotations

from typing import Annotated, Any, Dict, List, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, model_validator

from . import model_types

TINY_LM = "tiny-lm"
MASKED_LM = "masked-lm"
CAUSAL_LM = "causal-lm"
IMAGE_CLASSIFICATION = "image-classification"
BUILT_IN = (TINY_LM, MASKED_LM, CAUSAL_LM, IMAGE_CLASSIFICATION)
TEXT_TASKS = (MASKED_LM, CAUSAL_LM)
MODEL_TYPES = {MASKED_LM: model_types.MASKED_LM, CAUSAL_LM: model_types.CAUSAL_LM,
               IMAGE_CLASSIFICATION: model_types.IMAGE_CLASSIFICATION}
# Run files the portal serves to workers (organizer uploads and the tokenizer it trains): plain names only.
FILE_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"
TRAINED_TOKENIZER_FILE = "tokenizer.json"
SPECIAL_TOKENS = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]",
                  "mask_token": "[MASK]", "bos_token": "[CLS]", "eos_token": "[SEP]"}


class TaskOptionError(ValueError):
    """Options a task cannot use; the message names the option."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DataOptions(Strict):
    """Where samples come from: files the run serves (``files``) or a Hub dataset, streamed (``dataset``)."""

    files: List[str] = Field(default_factory=list, description="run files: .txt (one sample per line) or .jsonl")
    eval_files: List[str] = Field(default_factory=list, description="held-out run files for the evaluation loss")
    dataset: Optional[str] = Field(None, description="a Hugging Face Hub dataset, e.g. 'oscar' (streamed)")
    dataset_config: Optional[str] = None
    split: str = "train"
    eval_split: Optional[str] = Field(None, description="the Hub dataset's held-out split")
    text_column: str = "text"
    image_column: str = "image"
    label_column: str = "label"

    @model_validator(mode="after")
    def one_source(self):
        if bool(self.files) == bool(self.dataset):
            raise ValueError("give either files (served by the portal) or dataset (a Hub dataset), not both")
        for name in self.files + self.eval_files:
            if not _plain_name(name):
                raise ValueError(f"file {name!r} must be a plain file name (letters, digits, '.', '_', '-')")
        return self


class TrainedTokenizer(Strict):
    """A tokenizer the portal trains on the run's files when the run is created (as sahajBERT did)."""

    vocab_size: int = Field(8000, ge=100, le=250_000)
    kind: Literal["unigram", "bpe", "wordpiece"] = "unigram"


class TokenizerOptions(Strict):
    name: Optional[str] = Field(None, description="a Hugging Face Hub tokenizer, e.g. 'albert-base-v2'")
    train: Optional[TrainedTokenizer] = None

    @model_validator(mode="after")
    def one_source(self):
        if (self.name is None) == (self.train is None):
            raise ValueError("give either name (a Hub tokenizer) or train (trained by the portal on the run's files)")
        return self


class AdapterOptions(Strict):
    """LoRA (Hu et al. 2021, peft's ``LoraConfig``): the base stays frozen, only the adapter is trained, averaged,
    credited and checkpointed (docs/tasks.md#adapters)."""

    kind: Literal["lora"] = "lora"
    rank: int = Field(8, ge=1, le=4096, description="r: the rank of each low-rank update")
    alpha: float = Field(16.0, gt=0, allow_inf_nan=False, description="lora_alpha: updates are scaled by alpha/rank")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="lora_dropout")
    target_modules: Optional[List[Annotated[str, StringConstraints(min_length=1, max_length=200)]]] = Field(
        None, min_length=1, description="module names to adapt; none: peft's default for the model type")
    base_bits: Optional[Literal[4, 8]] = Field(None, description="hold the frozen base quantized with bitsandbytes: "
                                               "4 (NF4, as QLoRA) or 8 bits; none: as its weights are stored")


class ModelTaskOptions(Strict):
    """A Hugging Face model trained from scratch (seeded, identical on every peer) or from pretrained weights."""

    model: Dict[str, Any] = Field(description="a transformers config as a dict; must name model_type")
    pretrained: Optional[str] = Field(None, description="start from these Hub weights instead of the seed")
    data: DataOptions
    tokenizer: Optional[TokenizerOptions] = None
    sequence_length: int = Field(128, ge=8, le=65_536, description="tokens per sample (text tasks)")
    mlm_probability: float = Field(0.15, gt=0.0, lt=1.0, description="share of tokens masked (masked-lm)")
    image_size: int = Field(32, ge=8, le=4096, description="pixels per side (image-classification)")
    eval_samples: int = Field(256, ge=1, le=1_000_000, description="held-out samples behind an evaluation loss")
    adapter: Optional[AdapterOptions] = Field(None, description="train a LoRA adapter on a frozen base")
    gradient_checkpointing: bool = Field(False, description="recompute activations in the backward pass: less "
                                         "memory for about a third more compute (transformers')")


class TinyLmOptions(Strict):
    context: int = Field(64, ge=2, le=4096)
    width: int = Field(64, ge=4, le=4096)
    layers: int = Field(2, ge=1, le=64)
    heads: int = Field(4, ge=1, le=64)


def validate_task(task: str, options: Dict[str, Any]) -> Dict[str, Any]:
    """The options with defaults filled in; ``TaskOptionError`` naming the first bad option."""
    if task == TINY_LM:
        return _parse(TinyLmOptions, options).model_dump()
    if task not in MODEL_TYPES:
        if ":" in task:  # a plugin "module:Class": its options are its own business
            return dict(options)
        raise TaskOptionError(f"task: unknown task {task!r}; use one of {', '.join(BUILT_IN)} or 'module:Class'")
    parsed = _parse(ModelTaskOptions, options)
    model_type = parsed.model.get("model_type")
    if not isinstance(model_type, str):
        raise TaskOptionError("task_options.model.model_type: missing; name a transformers model type, e.g. 'albert'")
    if model_type not in MODEL_TYPES[task]:
        raise TaskOptionError(f"task_options.model.model_type: {model_type!r} cannot be a {task} model "
                              f"(transformers {model_types.TRANSFORMERS_VERSION}); e.g. "
                              f"{', '.join(sorted(MODEL_TYPES[task])[:6])}")
    if task in TEXT_TASKS:
        if parsed.tokenizer is None:
            raise TaskOptionError("task_options.tokenizer: a text task needs a tokenizer: {\"name\": ...} or "
                                  "{\"train\": {\"vocab_size\": ...}}")
        if parsed.tokenizer.train is not None and not parsed.data.files:
            raise TaskOptionError("task_options.tokenizer.train: the portal trains a tokenizer on the run's files; "
                                  "this run has none (data.files)")
        positions = parsed.model.get("max_position_embeddings")
        if isinstance(positions, int) and parsed.sequence_length > positions:
            raise TaskOptionError(f"task_options.sequence_length: {parsed.sequence_length} is longer than the "
                                  f"model's max_position_embeddings ({positions})")
    elif not isinstance(parsed.model.get("num_labels", parsed.model.get("id2label")), (int, dict)):
        raise TaskOptionError("task_options.model.num_labels: an image classifier needs its number of classes")
    return parsed.model_dump(exclude_none=True)


def run_files(task: str, options: Dict[str, Any]) -> List[str]:
    """The run files a worker needs for this task: data, held-out data and a trained tokenizer."""
    if task not in MODEL_TYPES:
        return []
    data = options.get("data", {})
    trained = (options.get("tokenizer") or {}).get("train") is not None
    tokenizer = [TRAINED_TOKENIZER_FILE] if trained else []
    return list(data.get("files", [])) + list(data.get("eval_files", [])) + tokenizer


def _parse(model, options):
    try:
        return model.model_validate(options)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(part) for part in ("task_options", *first["loc"]))
        raise TaskOptionError(f"{where}: {first['msg'].removeprefix('Value error, ')}") from None


def _plain_name(name: str) -> bool:
    import re

    return bool(re.match(FILE_NAME, name)) and name != TRAINED_TOKENIZER_FILE
