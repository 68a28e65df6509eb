"""The default task: a small causal transformer that learns English from text every Python ships.

``pydoc_data.topics`` (~460 KB of Python's own documentation) is always present, so the demo and the tests learn
something real offline. Bytes are tokens (vocabulary 256), so there is no tokenizer to download.
"""

from __future__ import annotations

import math
from pydoc_data.topics import topics

import torch
from torch import nn


def corpus_bytes() -> torch.Tensor:
    """The training text as a 1-D uint8 tensor (deterministic order)."""
    text = "\n\n".join(topics[key] for key in sorted(topics))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)


class TinyTransformer(nn.Module):
    def __init__(self, context: int, width: int, layers: int, heads: int):
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.position = nn.Parameter(torch.randn(context, width) * 0.02)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, 256)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        hidden = self.embed(tokens) + self.position[:length]
        hidden = self.blocks(hidden, mask=self.mask[:length, :length], is_causal=True)
        return self.head(hidden)


class TinyLanguageModel:
    """Next-byte prediction on Python's documentation.

    :param options: ``context`` (bytes per sample), ``width``, ``layers``, ``heads``
    :param seed: seeds the model initialisation (same on every peer); the data order is drawn per process
    """

    def __init__(self, options: dict, seed: int, files=None, data_seed: int = 0):
        self.options = options
        self.context = int(options.get("context", 64))
        torch.manual_seed(seed)
        self.model = TinyTransformer(
            self.context, int(options.get("width", 64)), int(options.get("layers", 2)), int(options.get("heads", 4))
        )
        self.data = corpus_bytes().long()
        self.generator = torch.Generator()
        self.generator.seed()  # each peer reads its own random windows

    def reseed(self, seed: int) -> None:
        """The next windows come from ``seed`` alone: a spot check redraws a peer's epoch
        (dedloc_worker.training.spot_checks)."""
        self.generator.manual_seed(seed)

    def batch_loss(self, batch_size: int) -> torch.Tensor:
        starts = torch.randint(0, len(self.data) - self.context - 1, (batch_size,), generator=self.generator)
        windows = torch.stack([self.data[s : s + self.context + 1] for s in starts.tolist()])
        logits = self.model(windows[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, 256), windows[:, 1:].reshape(-1))

    def to(self, device: str, amp=None) -> "TinyLanguageModel":
        self.model.to(device)
        self.data = self.data.to(device)
        return self

    def evaluate(self):
        return None  # it learns from all of its text: nothing is held out

    def save(self, folder) -> None:
        """Its parameters as model.safetensors and its options as config.json."""
        import json
        from pathlib import Path

        from safetensors.torch import save_file

        tensors = {k: v.contiguous() for k, v in self.model.state_dict().items()}
        save_file(tensors, str(Path(folder) / "model.safetensors"))
        (Path(folder) / "config.json").write_text(json.dumps({"task": "tiny-lm", **self.options}))

    @staticmethod
    def initial_loss() -> float:
        """Loss of a uniform guess over bytes, for reference (nats)."""
        return math.log(256)
