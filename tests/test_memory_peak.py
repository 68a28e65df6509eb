"""The memory a worker predicts for a run (``dedloc_worker.training.memory``: the model counted, a mini-step's
activations probed) against the peak memory a process training that run really reaches, on this CPU, for several
kinds of run; and the micro-batch it picks where the run's mini-batch does not fit.

Tolerance (docs/memory.md#accuracy): the prediction counts tensors; a CPU process holds more than its tensors (the
allocator's slack, oneDNN's scratch buffers, autograd's graph, thread stacks). Measured here, that came to 84-180 MB
at one thread, up to 11% of the tensors on the largest model. The measured peak must lie between 90% of the prediction
(it counts the gradients a probe sees in backward alike, a little more than what is live at the peak) and 110% of it
plus 192 MiB."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dedloc_common.tasks import validate_task

from app.cli.demo import write_corpus
from app.runs import files as run_files
from tests.support.factories import LocalSteps

MIB = 1024**2
OVERHEAD = 192 * MIB  # a CPU process's memory besides its tensors (see the module's docstring)
LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 256,
         "tie_word_embeddings": False}
ADAPTER = {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}


@pytest.fixture(scope="module")
def causal_lm(tmp_path_factory):
    root = tmp_path_factory.mktemp("memory")
    train, held_out = write_corpus(root / "corpus")
    options = validate_task("causal-lm", {"model": LLAMA, "data": {"files": ["train.txt"], "eval_files": ["eval.txt"]},
                                          "tokenizer": {"train": {"vocab_size": 2000, "kind": "bpe"}},
                                          "sequence_length": 256, "eval_samples": 8})
    stored = run_files.add_run_files(root / "data", "lm", "causal-lm", options,
                                     {"train.txt": train, "eval.txt": held_out})
    return options, {f.name: str(run_files.path_of(root / "data", "lm", f.name)) for f in stored}, root


def predicted(options: dict, files: dict, micro_batch: int):
    from dedloc_worker.tasks.adapters import trainable
    from dedloc_worker.tasks.hf import CausalLM
    from dedloc_worker.training import memory

    task = CausalLM(options, seed=7, files={k: Path(v) for k, v in files.items()})
    need = memory.estimate(task.model.parameters(), trainable(task.model), offload=False)
    activations = memory.probe(task, micro_batch)
    return task, need, activations


def measured(root: Path, options: dict, files: dict, micro_batch: int, batch_size: int) -> int:
    spec = root / f"spec-{len(list(root.glob('spec-*')))}.json"
    spec.write_text(json.dumps({"options": options, "files": files}))
    script = Path(__file__).parent / "support" / "memory_peak.py"
    out = subprocess.run([sys.executable, str(script), str(spec), str(micro_batch), str(batch_size)],
                         capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["measured"]


@pytest.mark.parametrize("kind, micro_batch", [("full", 8), ("gradient checkpointing", 8), ("adapter", 8)])
def test_the_prediction_holds_against_the_peak_a_training_process_reaches(causal_lm, kind, micro_batch):
    from dedloc_worker.training import memory

    options, files, root = causal_lm
    options = {**options, "gradient_checkpointing": kind == "gradient checkpointing",
               "adapter": validate_task("causal-lm", {**options, "adapter": ADAPTER})["adapter"]
               if kind == "adapter" else None}
    _, need, activations = predicted(options, files, micro_batch)
    prediction = memory.peak(need, activations, micro_batch)
    peak = measured(root, options, files, micro_batch, micro_batch)
    print(f"{kind} at {micro_batch}: predicted {prediction / MIB:.0f} MiB, measured {peak / MIB:.0f} MiB")
    assert 0.9 * prediction <= peak <= 1.1 * prediction + OVERHEAD, (prediction / MIB, peak / MIB)


def test_a_mini_batch_that_does_not_fit_is_trained_in_accumulated_micro_batches(causal_lm):
    """Given room for a quarter of the mini-batch, the worker picks micro-batches that fit, and the mini-step's
    gradient is the mini-batch's: a spot check's recomputation at the whole mini-batch finds the same."""
    from dedloc_common.contract import RunConfig
    from dedloc_worker.tasks.adapters import trainable
    from dedloc_worker.training import loop, memory

    options, files, root = causal_lm
    task, need, activations = predicted(options, files, 8)
    room = memory.peak(need, activations, 2) + activations.per_sample // 2  # 2 samples fit, 4 do not
    micro_batch, _ = memory.choose_micro_batch(task, need, 8, "cpu", free=room)
    assert micro_batch == 2
    assert measured(root, options, files, 2, 8) <= 1.1 * room + OVERHEAD  # trained at 2, it stays within the room

    config = RunConfig(slug="m", run_id="m", task="causal-lm", task_options=options, target_batch_size=64,
                       batch_size=8, seed=3)
    sums = []
    for micro in (micro_batch, None):  # accumulated, and the whole mini-batch at once
        model_copy = predicted(options, files, 8)[0]
        tally = loop.open_epoch(model_copy, config, "a" * 64, 5)
        loop.mini_step(model_copy, config, LocalSteps(model_copy.model), tally, micro_batch=micro)
        sums.append(torch.cat([t.reshape(-1) for t in tally.gradients.tensors]))
        assert tally.mini_steps == 1
    assert torch.allclose(sums[0], sums[1], rtol=1e-4, atol=1e-6), (sums[0] - sums[1]).abs().max()
    assert sums[0].abs().sum() > 0 and trainable(task.model)


def test_a_run_that_fits_no_micro_batch_is_one_line(causal_lm):
    from dedloc_worker.errors import ResourceError
    from dedloc_worker.training import memory

    options, files, _ = causal_lm
    task, need, activations = predicted(options, files, 8)
    memory.choose_micro_batch(task, need, 8, "cpu", free=memory.peak(need, activations, 1))  # control: one fits
    with pytest.raises(ResourceError) as refused:
        memory.choose_micro_batch(task, need, 8, "cpu", free=memory.peak(need, activations, 1) - 1)
    message = str(refused.value)
    assert "\n" not in message and "at one sample per micro-batch" in message and refused.value.exit_code == 8
    assert "adapter run" in message
