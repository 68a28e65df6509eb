"""CenteredClip: a robust weighted average of a few vectors (Karimireddy, He and Jaggi, 2021).

Start at the coordinate-wise median, then ``iterations`` times move the centre by the weighted mean of every
input's offset from it, each offset clipped to length ``tau``. An input far from the others pulls the centre by at
most ``tau`` times its share of the weight per iteration; with no input farther than ``tau`` it is the weighted
mean. BTARD-SGD (Gorbunov et al., 2022) runs it on each part of a butterfly all-reduce, as dedloc does
(``dedloc_worker.averaging.robust``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ClipResult:
    """:param centre: the robust average, shaped like one input
    :param scales: per input, the factor its offset from ``centre`` was cut to in the last iteration (1: not clipped)
    """

    centre: torch.Tensor
    scales: torch.Tensor


def centered_clip(inputs: torch.Tensor, weights: torch.Tensor, tau: float, iterations: int) -> ClipResult:
    """CenteredClip of ``inputs`` (one input per row of the first dimension) with ``weights``.

    :param inputs: n finite inputs stacked along dimension 0 (n >= 1), any dtype (computed in float32 or wider)
    :param weights: n finite weights >= 0 with a positive sum (samples, in dedloc)
    :param tau: clip radius, in the inputs' units (> 0)
    :param iterations: clipping iterations (>= 1)
    """
    if inputs.shape[0] != weights.shape[0] or inputs.shape[0] == 0:
        raise ValueError(f"need one weight per input, got {inputs.shape[0]} inputs and {weights.shape[0]} weights")
    if not tau > 0 or iterations < 1:
        raise ValueError(f"tau must be > 0 and iterations >= 1, got {tau!r} and {iterations!r}")
    dtype = torch.promote_types(inputs.dtype, torch.float32)
    flat = inputs.reshape(inputs.shape[0], -1).to(dtype)
    shares = weights.to(dtype) / weights.to(dtype).sum()
    centre = flat.quantile(0.5, dim=0)  # the median, halfway between the middle two of an even count
    scales = torch.ones(flat.shape[0], dtype=dtype)
    for _ in range(iterations):
        offsets = flat - centre
        distances = offsets.norm(dim=1)
        # an input at the centre has offset 0: any scale leaves it 0, so 1 avoids 0/0
        scales = torch.where(distances > tau, tau / distances.clamp_min(torch.finfo(dtype).tiny), 1.0)
        centre = centre + (shares * scales) @ offsets
    return ClipResult(centre.reshape(inputs.shape[1:]), scales)
