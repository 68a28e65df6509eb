"""The built-in tasks on Hugging Face libraries: masked and causal language modelling on any transformers config,
and image classification. Options: ``dedloc_common.tasks``; what each means: docs/tasks.md.

Every peer builds the same initial model (the run's seed, or the same pretrained weights) and reads its own order
of the data (``data_seed``, derived from its key); where the data are the run's files, ``reseed`` redraws an
epoch's batches from a seed alone, for spot checks (dedloc_worker.training.spot_checks). The evaluation loss is
deterministic: the same held-out samples and, for masked LM, the same masks, so a checkpoint's recorded loss can be
recomputed by anyone who downloads it.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import torch
from dedloc_common import tasks as spec

from dedloc_worker.errors import ConfigError

EVAL_SEED = 0  # masks of the evaluation batches
EVAL_BATCH = 16


class HFTask:
    """What the trainer needs from a task: ``model``, ``batch_loss(n)``, ``evaluate()``, ``save(folder)``."""

    kind = ""

    def __init__(self, options: dict, seed: int, files: Optional[Dict[str, Path]] = None, data_seed: int = 0):
        quiet()
        try:
            self.options = spec.validate_task(self.kind, options)
        except spec.TaskOptionError as e:
            raise ConfigError(f"this run's task cannot be loaded: {e}") from None
        self.files = files or {}
        self.seed, self.data_seed = seed, data_seed
        self._tables: dict = {}
        self.device = torch.device("cpu")
        self.autocast: Optional[torch.dtype] = None
        # an adapter run's base quantized by bitsandbytes (4 or 8 bits), or as stored (None)
        self.base_bits: Optional[int] = (self.options.get("adapter") or {}).get("base_bits")
        self.train_stream = None  # created on first use: loading data is the slow part of a join
        self.model = self.build_model(seed, self.base_bits)
        if self.options.get("gradient_checkpointing"):
            if not self.model.supports_gradient_checkpointing:
                raise ConfigError(f"task_options.gradient_checkpointing: {type(self.model).__name__} does not "
                                  "support it; leave it out")
            # use_reentrant=False: gradients reach an adapter on a frozen base (the reentrant variant needs an input
            # that requires grad)
            self.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        if self.options.get("adapter"):
            from dedloc_worker.tasks.adapters import apply_adapter

            self.model = apply_adapter(self.model, self.options["adapter"], seed)

    def to(self, device: str, amp: Optional[str] = None) -> "HFTask":
        self.device = torch.device(device)
        self.autocast = getattr(torch, amp) if amp else None
        self.model.to(self.device)
        return self

    def unquantized_base(self):
        """The base as its weights are stored, not quantized: what a quantized run's merged export is merged into."""
        return self.build_model(self.seed, bits=None)

    @property
    def reseedable(self) -> bool:
        """Whether ``reseed`` can redraw batches: data from the run's files, not a Hub stream (refilling its shuffle
        buffer every epoch would cost more than the epoch)."""
        return not self.options["data"].get("dataset")

    def reseed(self, seed: int) -> None:
        """The next batches come from ``seed`` alone: the data's order, and dropout (the global RNG)."""
        self.train_stream = self.train_records(seed)
        torch.manual_seed(seed)

    def train_records(self, seed: Optional[int] = None):
        return self.records(train=True, seed=seed)

    def forward_loss(self, batch: dict) -> torch.Tensor:
        batch = {k: v.to(self.device) for k, v in batch.items()}
        with torch.autocast(self.device.type, dtype=self.autocast, enabled=self.autocast is not None):
            return self.model(**batch).loss

    def batch_loss(self, batch_size: int) -> torch.Tensor:
        self.model.train()
        return self.forward_loss(self.collate([next(self.train_stream) for _ in range(batch_size)], train=True))

    @torch.no_grad()
    def evaluate(self) -> Optional[float]:
        """Mean loss over the held-out samples (the first ``eval_samples``, in order), or None without any."""
        samples = self.eval_samples()
        if not samples:
            return None
        self.model.eval()
        losses = []
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(EVAL_SEED)
            for start in range(0, len(samples), EVAL_BATCH):
                chunk = samples[start:start + EVAL_BATCH]
                losses.append((float(self.forward_loss(self.collate(chunk, train=False))), len(chunk)))
        self.model.train()
        return sum(loss * n for loss, n in losses) / sum(n for _, n in losses)

    def eval_samples(self) -> list:
        if not hasattr(self, "_eval"):
            stream = self.eval_stream()
            self._eval = list(itertools.islice(stream, self.options["eval_samples"])) if stream else []
        return self._eval

    def save(self, folder: Path) -> None:
        """Hugging Face format: config.json, model.safetensors and, for text, the tokenizer's files; an adapter run's
        adapter, with the merged model in ``merged/`` (``tasks.adapters.save_adapter``)."""
        if self.options.get("adapter"):
            from dedloc_worker.tasks.adapters import save_adapter

            save_adapter(self.model, folder, self.unquantized_base() if self.base_bits else None)
        else:
            self.model.save_pretrained(folder, safe_serialization=True)
        if getattr(self, "tokenizer", None) is not None:
            self.tokenizer.save_pretrained(folder)

    # --- data ----------------------------------------------------------------------------------------------------

    def records(self, train: bool, seed: Optional[int] = None) -> Optional[Iterator[dict]]:
        """Rows of the training (endless, this peer's order, or ``seed``'s) or held-out data (once, fixed order);
        None when the run has no held-out data."""
        import datasets

        data = self.options["data"]
        seed = self.data_seed if seed is None else seed % 2**32
        if data.get("dataset"):
            split = data["split"] if train else data.get("eval_split")
            if split is None:
                return None
            rows = datasets.load_dataset(data["dataset"], data.get("dataset_config"), split=split, streaming=True)
            if train:
                return _endless(lambda epoch: rows.shuffle(seed=seed + epoch, buffer_size=10_000))
            return iter(rows)
        names = data["files"] if train else data.get("eval_files", [])
        if not names:
            return None
        paths = [str(self._file(name)) for name in names]
        if train not in self._tables:  # loaded once: reseed asks again every epoch
            self._tables[train] = datasets.load_dataset(_builder(names[0]), data_files=paths, split="train",
                                                        cache_dir=str(Path(paths[0]).parent / "datasets"))
        table = self._tables[train]
        if train:
            return _endless(lambda epoch: iter(table.shuffle(seed=seed + epoch, keep_in_memory=True)))
        return iter(table)

    def _file(self, name: str) -> Path:
        if name not in self.files:
            raise ConfigError(f"the run's file {name!r} was not downloaded; the portal does not serve it")
        return self.files[name]


class TextTask(HFTask):
    """Text tasks: the tokenizer, then samples of ``sequence_length`` tokens packed from consecutive texts."""

    def build_model(self, seed: int, bits: Optional[int] = None):
        import transformers

        if getattr(self, "tokenizer", None) is None:  # a second build (an unquantized base) reuses it
            self.tokenizer = self.load_tokenizer()
        config = dict(self.options["model"])
        config.setdefault("vocab_size", len(self.tokenizer))
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            token = getattr(self.tokenizer, name.replace("_id", ""), None)
            if token is not None:
                config.setdefault(name, self.tokenizer.convert_tokens_to_ids(token))
        return build(self.auto_class(transformers), config, self.options.get("pretrained"), seed, bits)

    def batch_loss(self, batch_size: int) -> torch.Tensor:
        if self.train_stream is None:
            self.train_stream = self.train_records()
        return super().batch_loss(batch_size)

    def load_tokenizer(self):
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        options = self.options["tokenizer"]
        if options.get("name"):
            return AutoTokenizer.from_pretrained(options["name"])
        path = self._file(spec.TRAINED_TOKENIZER_FILE)
        return PreTrainedTokenizerFast(tokenizer_file=str(path), model_max_length=self.options["sequence_length"],
                                       **spec.SPECIAL_TOKENS)

    def train_records(self, seed: Optional[int] = None):
        return self.packed(self.records(train=True, seed=seed))

    def eval_stream(self):
        rows = self.records(train=False)
        return None if rows is None else self.packed(rows)

    def packed(self, rows: Iterator[dict]) -> Iterator[List[int]]:
        """Token windows: texts joined by [SEP], cut into ``sequence_length`` tokens with [CLS] ... [SEP] around."""
        column, length = self.options["data"]["text_column"], self.options["sequence_length"]
        cls, sep = self.tokenizer.cls_token_id, self.tokenizer.sep_token_id
        inner = length - (cls is not None) - (sep is not None)
        buffer: List[int] = []
        for row in rows:
            if column not in row:
                raise ConfigError(f"task_options.data.text_column: the data has no column {column!r} "
                                  f"(it has {', '.join(row)})")
            text = row[column]
            if not text or not text.strip():
                continue
            tokens = self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
            buffer += tokens + ([sep] if sep is not None else [])
            while len(buffer) >= inner:
                window, buffer = buffer[:inner], buffer[inner:]
                yield ([cls] if cls is not None else []) + window + ([sep] if sep is not None else [])


class MaskedLM(TextTask):
    """Masked language modelling (ALBERT as in the paper, or any AutoModelForMaskedLM config)."""

    kind = spec.MASKED_LM

    @staticmethod
    def auto_class(transformers):
        return transformers.AutoModelForMaskedLM

    def reseed(self, seed: int) -> None:
        """As ``HFTask.reseed``, and the masks too."""
        super().reseed(seed)
        self._collator = self.collator(seed % 2**32)

    def collator(self, seed: Optional[int] = None):
        """Masks from ``seed``'s generator, or from the global RNG without one."""
        from transformers import DataCollatorForLanguageModeling

        return DataCollatorForLanguageModeling(
            self.tokenizer, mlm_probability=self.options["mlm_probability"], return_tensors="pt", seed=seed
        )

    def collate(self, samples: List[List[int]], train: bool) -> dict:
        name = "_collator" if train else "_eval_collator"  # evaluation masks: the global RNG, as evaluate seeds it
        if not hasattr(self, name):
            setattr(self, name, self.collator())
        return dict(getattr(self, name)([{"input_ids": s} for s in samples]))


class CausalLM(TextTask):
    """Next-token prediction on any AutoModelForCausalLM config."""

    kind = spec.CAUSAL_LM

    @staticmethod
    def auto_class(transformers):
        return transformers.AutoModelForCausalLM

    def collate(self, samples: List[List[int]], train: bool) -> dict:
        ids = torch.tensor(samples, dtype=torch.long)
        return {"input_ids": ids, "labels": ids.clone()}


class ImageClassification(HFTask):
    """Image classification on any AutoModelForImageClassification config: images resized to ``image_size``,
    scaled to [-1, 1]."""

    kind = spec.IMAGE_CLASSIFICATION

    def build_model(self, seed: int, bits: Optional[int] = None):
        import transformers

        config = dict(self.options["model"])
        config.setdefault("image_size", self.options["image_size"])
        return build(transformers.AutoModelForImageClassification, config, self.options.get("pretrained"), seed, bits)

    def batch_loss(self, batch_size: int) -> torch.Tensor:
        if self.train_stream is None:
            self.train_stream = self.train_records()
        return super().batch_loss(batch_size)

    def eval_stream(self):
        return self.records(train=False)

    def collate(self, rows: List[dict], train: bool) -> dict:
        import numpy as np

        data, size = self.options["data"], self.options["image_size"]
        try:
            pixels = [
                np.asarray(row[data["image_column"]].convert("RGB").resize((size, size)), dtype=np.float32)
                for row in rows
            ]
            labels = [int(row[data["label_column"]]) for row in rows]
        except KeyError as e:
            raise ConfigError(f"task_options.data: the images have no column {e}") from None
        values = torch.from_numpy(np.stack(pixels)).permute(0, 3, 1, 2) / 127.5 - 1.0
        return {"pixel_values": values, "labels": torch.tensor(labels)}


def quiet() -> None:
    """No progress bars or advice from the libraries: the worker's terminal shows its own progress line."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def build(auto_class, config: dict, pretrained: Optional[str], seed: int, bits: Optional[int] = None):
    """The model from ``pretrained`` weights, or initialised from ``seed`` (the same on every peer); with ``bits``, its
    linear layers quantized by bitsandbytes (an adapter run's frozen base)."""
    import transformers

    if pretrained:
        overrides = {k: v for k, v in config.items() if k != "model_type"}
        if bits:
            overrides["quantization_config"] = quantization(bits)
        return auto_class.from_pretrained(pretrained, **overrides)
    options = dict(config)
    try:
        model_config = transformers.AutoConfig.for_model(options.pop("model_type"), **options)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"task_options.model: transformers cannot build this config ({e})") from None
    torch.manual_seed(seed)
    random.seed(seed)
    model = auto_class.from_config(model_config)
    if not bits:
        return model
    import tempfile

    # transformers quantizes while it loads weights: the seeded ones go through a folder
    with tempfile.TemporaryDirectory(prefix="dedloc-base-") as folder:
        model.save_pretrained(folder, safe_serialization=True)
        return auto_class.from_pretrained(folder, quantization_config=quantization(bits))


def quantization(bits: int):
    """transformers' bitsandbytes settings for a frozen base: NF4 with double quantization (QLoRA's), or 8 bits."""
    from transformers import BitsAndBytesConfig

    from dedloc_worker.training.options import quantization_library

    quantization_library(f"{bits}-bit base")
    if bits == 4:
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
    return BitsAndBytesConfig(load_in_8bit=True)


def _builder(name: str) -> str:
    suffix = Path(name).suffix.lower()
    return {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}.get(suffix, "text")


def _endless(epoch_rows) -> Iterator[dict]:
    for epoch in itertools.count():
        yield from epoch_rows(epoch)
