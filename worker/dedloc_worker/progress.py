"""What the volunteer sees: a live bar in a terminal, one line per epoch otherwise (logs, the demo)."""

from __future__ import annotations

import sys

from tqdm import tqdm


class ProgressDisplay:
    """Shows epoch, local and swarm samples/s, and loss. Use as a context manager; feed it ``Status`` objects."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.interactive = self.stream.isatty()
        self.epoch = None
        self.bar = None

    def __enter__(self):
        if self.interactive:
            self.bar = tqdm(total=None, unit="step", file=self.stream, dynamic_ncols=True)
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()

    def update(self, status) -> None:
        loss = "n/a" if status.loss is None else f"{status.loss:.3f}"
        text = (f"epoch {status.epoch} | {status.local_samples_per_second:.0f} samples/s here, "
                f"{status.swarm_samples_per_second:.0f} in the swarm ({status.peers} peers) | last epoch's loss {loss}")
        if self.bar is not None:
            self.bar.set_description_str(text, refresh=False)
            self.bar.update(1)
        elif status.epoch != self.epoch:
            print(text, file=self.stream, flush=True)
        self.epoch = status.epoch
