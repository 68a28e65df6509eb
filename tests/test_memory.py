"""The memory a run's model needs before activations (``dedloc_worker.training.memory``), against the tensors a
real optimizer step allocates, and the one line a worker gets where it cannot fit."""

from __future__ import annotations

import pytest
import torch
from dedloc_worker.errors import ResourceError
from dedloc_worker.training.memory import GIB, MemoryNeed, check_fits, estimate


def allocated(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("frozen", [False, True])
def test_the_estimate_is_the_tensors_an_adamw_step_holds(frozen):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    if frozen:  # as an adapter run's base
        model[0].requires_grad_(False)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained)
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    moments = [value for state in optimizer.state.values() for key, value in state.items() if key != "step"]
    measured = allocated(model.parameters()) + allocated(p.grad for p in trained) + allocated(moments)
    gradients = allocated(p.grad for p in trained)
    assert estimate(model.parameters(), trained, offload=False) == MemoryNeed(
        device=measured, host=0, workspace=allocated(trained), gradients=gradients)
    offloaded = estimate(model.parameters(), trained, offload=True)
    assert offloaded.device == allocated(model.parameters()) + allocated(p.grad for p in trained)
    assert offloaded.host == allocated(moments) + 2 * allocated(trained)  # + fp32 master copy and averaged grads


def test_a_model_that_cannot_fit_is_one_line_that_says_what_would():
    need = MemoryNeed(device=6 * GIB, host=GIB)
    check_fits(need, "cuda", device_free=8 * GIB, host_free=4 * GIB)  # control: it fits
    with pytest.raises(ResourceError) as refused:
        check_fits(need, "cuda", device_free=4 * GIB, host_free=4 * GIB)
    assert "\n" not in str(refused.value) and "needs 6.00 GiB on the GPU" in str(refused.value)
    assert "--device cpu" in str(refused.value) and refused.value.exit_code == 8
    with pytest.raises(ResourceError, match="needs 7.00 GiB of RAM"):
        check_fits(need, "cpu", host_free=4 * GIB)


def test_8_bit_moments_are_counted_as_the_bytes_bitsandbytes_keeps():
    """optimizer "adamw-8bit": each moment is 1 byte a parameter, with its blocks' scales and code table; a tensor
    too small to gain (a bias here) keeps float32 moments."""
    import bitsandbytes as bnb

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    optimizer = bnb.optim.AdamW8bit(model.parameters())
    model(torch.randn(4, 256)).sum().backward()
    optimizer.step()
    held = allocated(value for state in optimizer.state.values() for value in state.values()
                     if isinstance(value, torch.Tensor) and value.numel() > 1)
    need, full = (estimate(model.parameters(), list(model.parameters()), offload=False, moment_bytes=n) for n in (1, 4))
    counted = need.device - allocated(model.parameters()) - need.gradients
    assert counted == held
    assert full.device - need.device > 5.8 * sum(p.numel() for p in model.parameters())  # 2 moments, ~3 bytes saved
