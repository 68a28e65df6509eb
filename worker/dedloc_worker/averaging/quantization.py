"""hivemind 1.1.12's 8-bit quantization (the run option ``compression: uint8``), readable under NumPy 2.4."""

from __future__ import annotations


def readable_quantization() -> None:
    """hivemind reads a quantized part's codebook size with ``int()`` of a one-element array, which NumPy 2.4 refuses
    (TypeError): a peer lost every uint8 part it received, and a pair's rounds averaged nothing ("received 50.0% of
    input tensors"; docs/hivemind.md#pitfalls, 29). The same reader, taking the size as a scalar."""
    import numpy as np
    import torch
    from hivemind.compression.quantization import Quantization

    def extract(self, serialized_tensor) -> torch.Tensor:
        codebook_size = int(np.frombuffer(serialized_tensor.buffer, count=1, dtype=np.int64)[0])
        codebook = np.frombuffer(serialized_tensor.buffer, offset=8, count=codebook_size, dtype=self.codebook_dtype)
        quantized = np.frombuffer(serialized_tensor.buffer, offset=8 + codebook.nbytes, dtype=self.indices_dtype)
        quantized = torch.as_tensor(quantized, dtype=torch.int64).reshape(tuple(serialized_tensor.size))
        codebook = torch.as_tensor(codebook).to(dtype=getattr(torch, serialized_tensor.dtype))
        return codebook[quantized].requires_grad_(serialized_tensor.requires_grad)

    Quantization.extract = extract
