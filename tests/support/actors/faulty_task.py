"""A task plugin that fails after a few mini-steps, as a buggy plugin or a bad batch would."""

from dedloc_worker.tasks.tiny_lm import TinyLanguageModel


class ExplodingTask(TinyLanguageModel):
    def __init__(self, options: dict, seed: int):
        super().__init__(options, seed)
        self.steps_left = int(options.get("explode_after", 5))

    def batch_loss(self, batch_size: int):
        self.steps_left -= 1
        if self.steps_left < 0:
            raise RuntimeError("corrupt batch")
        return super().batch_loss(batch_size)
