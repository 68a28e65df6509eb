"""Adapter runs (LoRA with peft, ``dedloc_worker.tasks.adapters``): the same adapter on every peer, only its tensors
trained, and checkpoints that load with ``PeftModel.from_pretrained`` on the base and, merged, with
``from_pretrained`` alone. The two-worker swarm of an adapter run: tests/test_adapter_swarm.py."""

from __future__ import annotations

import sys

import pytest
import torch
from dedloc_common.tasks import TaskOptionError, validate_task

from app.cli.demo import write_corpus
from app.runs import files as run_files

# Untied output embeddings: an adapter on a model this small learns through its output layer (a LoRA of the attention
# and MLP layers alone gained 0.002 of held-out loss in 40 steps, full training with frozen embeddings 0.02)
LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 64,
         "tie_word_embeddings": False}
ADAPTER = {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj", "lm_head"]}


@pytest.fixture(scope="module")
def adapter_run(tmp_path_factory):
    """A causal LM pretrained here for a few steps (the Hub is out of reach), and an adapter run on it."""
    from dedloc_worker.tasks.hf import CausalLM

    root = tmp_path_factory.mktemp("adapter")
    train, held_out = write_corpus(root / "corpus")
    options = validate_task("causal-lm", {"model": LLAMA, "data": {"files": ["train.txt"], "eval_files": ["eval.txt"]},
                                          "tokenizer": {"train": {"vocab_size": 1000, "kind": "bpe"}},
                                          "sequence_length": 64, "eval_samples": 32})
    stored = run_files.add_run_files(root / "data", "lm", "causal-lm", options,
                                     {"train.txt": train, "eval.txt": held_out})
    paths = {f.name: run_files.path_of(root / "data", "lm", f.name) for f in stored}
    base = CausalLM(options, seed=7, files=paths)
    optimizer = torch.optim.AdamW(base.model.parameters(), lr=3e-3)
    for _ in range(25):
        base.batch_loss(16).backward()
        optimizer.step()
        optimizer.zero_grad()
    base.model.save_pretrained(root / "base")
    return {**options, "pretrained": str(root / "base"), "adapter": validate_task(
        "causal-lm", {**options, "adapter": ADAPTER})["adapter"]}, paths


def test_only_the_adapter_trains_and_its_checkpoint_loads_on_the_base_and_merged(adapter_run, tmp_path):
    from dedloc_worker.tasks.adapters import MERGED_FOLDER, trainable
    from dedloc_worker.tasks.hf import CausalLM
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    options, paths = adapter_run
    task = CausalLM(options, seed=7, files=paths, data_seed=1)
    peer = CausalLM(options, seed=7, files=paths, data_seed=2)
    # every peer starts from the same adapter (LoRA's A drawn from the run's seed) on the same base
    assert all(torch.equal(a, b) for a, b in zip(task.model.state_dict().values(), peer.model.state_dict().values()))
    adapter = trainable(task.model)
    names = [name for name, p in task.model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in name for name in names), names
    total = sum(p.numel() for p in task.model.parameters())
    assert sum(p.numel() for p in adapter) < total / 5  # 8,192 of 67,712 here
    base_before = {name: p.detach().clone() for name, p in task.model.named_parameters() if not p.requires_grad}

    before, after = train_adapter(task)
    assert all(torch.equal(p, base_before[name]) for name, p in task.model.named_parameters() if not p.requires_grad)

    task.save(tmp_path / "checkpoint")
    base = CausalLM({**options, "adapter": None}, seed=7, files=paths)  # the base, loaded as every peer loads it
    loaded = CausalLM(options, seed=99, files=paths)
    loaded.model = PeftModel.from_pretrained(base.model, tmp_path / "checkpoint")
    assert abs(loaded.evaluate() - after) < 1e-5
    merged = CausalLM(options, seed=99, files=paths)
    merged.model = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint" / MERGED_FOLDER)
    assert abs(merged.evaluate() - after) < 1e-4  # merging adds B @ A into the weights: float rounding only


def train_adapter(task) -> tuple[float, float]:
    """The held-out loss before and after 40 steps of the task's trainable parameters, which must have learned."""
    from dedloc_worker.tasks.adapters import trainable

    before = task.evaluate()
    optimizer = torch.optim.AdamW(trainable(task.model), lr=1e-2)
    for _ in range(40):
        task.batch_loss(16).backward()
        optimizer.step()
        optimizer.zero_grad()
    after = task.evaluate()
    assert after < before - 0.05, (before, after)
    return before, after


def test_an_adapter_on_modules_the_model_lacks_is_one_clear_error(adapter_run):
    from dedloc_worker.errors import ConfigError
    from dedloc_worker.tasks.hf import CausalLM

    options, paths = adapter_run
    with pytest.raises(ConfigError, match="task_options.adapter: peft cannot adapt this model"):
        CausalLM({**options, "adapter": {**options["adapter"], "target_modules": ["c_attn"]}}, seed=7, files=paths)


@pytest.mark.parametrize("adapter, named", [
    ({"rank": 0}, "task_options.adapter.rank"),
    ({"alpha": -1}, "task_options.adapter.alpha"),
    ({"dropout": 1.0}, "task_options.adapter.dropout"),
    ({"target_modules": []}, "task_options.adapter.target_modules"),
    ({"kind": "ia3"}, "task_options.adapter.kind"),
    ({"base_bits": 3}, "task_options.adapter.base_bits"),
])
def test_bad_adapter_options_name_the_option(adapter, named):
    with pytest.raises(TaskOptionError, match=named.replace(".", r"\.")):
        validate_task("causal-lm", {"model": LLAMA, "data": {"files": ["a.txt"]}, "tokenizer": {"name": "t"},
                                    "adapter": adapter})


@pytest.mark.parametrize("adapter", [False, True])
def test_gradient_checkpointing_gives_the_same_gradients(adapter_run, adapter):
    from dedloc_worker.tasks.adapters import trainable
    from dedloc_worker.tasks.hf import CausalLM

    options, paths = adapter_run
    options = {**options, "adapter": options["adapter"] if adapter else None}
    grads = []
    for checkpointing in (False, True):
        task = CausalLM({**options, "gradient_checkpointing": checkpointing}, seed=7, files=paths, data_seed=3)
        base = task.model.get_base_model() if adapter else task.model
        assert base.is_activation_checkpointing == checkpointing
        task.batch_loss(8).backward()
        grads.append([p.grad.clone() for p in trainable(task.model)])
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*grads))


def test_a_4_bit_base_holds_a_fraction_of_the_memory_and_its_adapter_trains_and_exports_at_full_precision(
        adapter_run, tmp_path):
    """QLoRA's recipe (bitsandbytes' NF4 base, runs on this CPU too): the frozen base is stored in 4 bits, the adapter
    trains on it, its checkpoint loads on the quantized base, and the merged export is the base as stored with the
    adapter merged in, loadable by ``from_pretrained`` alone (no bitsandbytes, no quantization settings)."""
    from bitsandbytes.nn import Linear4bit
    from dedloc_worker.tasks.adapters import MERGED_FOLDER, trainable
    from dedloc_worker.tasks.hf import CausalLM
    from dedloc_worker.training import memory
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    options, paths = adapter_run
    plain = CausalLM(options, seed=7, files=paths)
    quantized_options = {**options, "adapter": {**options["adapter"], "base_bits": 4}}
    task = CausalLM(quantized_options, seed=7, files=paths, data_seed=1)
    layers = [m for m in task.model.modules() if isinstance(m, Linear4bit)]
    assert layers and all(not p.requires_grad for m in layers for p in m.parameters())
    assert all("lora_" in name for name, p in task.model.named_parameters() if p.requires_grad)
    linear = sum(m.weight.numel() * m.weight.element_size() for m in plain.model.modules()
                 if isinstance(m, torch.nn.Linear) and "lora_" not in str(m) and m.weight.shape[0] != 1000)
    four_bit = sum(m.weight.numel() * m.weight.element_size() for m in layers)
    assert 0 < four_bit <= linear / 7  # 4 of 32 bits (the layers' quantization constants are kept beside)
    need = memory.estimate(task.model.parameters(), trainable(task.model), offload=False)
    assert need.device < memory.estimate(plain.model.parameters(), trainable(plain.model), offload=False).device

    before, after = train_adapter(task)

    task.save(tmp_path / "checkpoint")
    on_quantized = CausalLM(quantized_options, seed=7, files=paths)  # the quantized base, as a peer builds it
    on_quantized.model = PeftModel.from_pretrained(on_quantized.model.unload(), tmp_path / "checkpoint")
    assert abs(on_quantized.evaluate() - after) < 1e-4
    merged = CausalLM({**options, "adapter": None}, seed=99, files=paths)
    merged.model = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint" / MERGED_FOLDER)
    assert not any(isinstance(m, Linear4bit) for m in merged.model.modules())
    assert getattr(merged.model.config, "quantization_config", None) is None
    assert abs(merged.evaluate() - after) < 0.1 * (before - after)  # the base's 4-bit rounding undone: near, not equal


def test_without_bitsandbytes_a_quantized_run_is_one_line_that_says_what_to_install(adapter_run, monkeypatch):
    from dedloc_common.contract import OptimizerOptions
    from dedloc_worker.errors import ConfigError
    from dedloc_worker.tasks.hf import CausalLM
    from dedloc_worker.training.options import inner_optimizer

    options, paths = adapter_run
    inner_optimizer(OptimizerOptions(name="adamw-8bit"))  # control: with it installed, both load
    CausalLM({**options, "adapter": {**options["adapter"], "base_bits": 8}}, seed=7, files=paths)
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as on a machine without the extra: the import fails
    for build in (lambda: inner_optimizer(OptimizerOptions(name="adamw-8bit")),
                  lambda: CausalLM({**options, "adapter": {**options["adapter"], "base_bits": 4}}, seed=7,
                                   files=paths)):
        with pytest.raises(ConfigError) as refused:
            build()
        assert "\n" not in str(refused.value) and "pip install 'bitsandbytes>=0.48'" in str(refused.value)
