"""The built-in tasks in one process: options checked alike on both sides, a causal LM and an image classifier that
learn and whose saved files load with ``from_pretrained``, and where a worker trains (device, threads, precision)."""

from __future__ import annotations

import warnings

import pytest
import torch
from dedloc_common import model_types
from dedloc_common.tasks import TaskOptionError, validate_task
from dedloc_worker.errors import ConfigError
from dedloc_worker.training import device

from app.cli.demo import write_corpus
from app.runs import files as run_files

GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64}


def test_the_portals_model_types_are_the_installed_transformers():
    from transformers.models.auto import modeling_auto as auto

    assert model_types.MASKED_LM == set(auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES)
    assert model_types.CAUSAL_LM == set(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    assert model_types.IMAGE_CLASSIFICATION == set(auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES)


@pytest.mark.parametrize("task, options, named", [
    ("masked-lm", {"model": {"model_type": "gpt2"}, "data": {"files": ["a.txt"]}, "tokenizer": {"name": "t"}},
     "task_options.model.model_type"),
    ("causal-lm", {"model": {"model_type": "gpt2"}, "data": {"files": ["a.txt"]}}, "task_options.tokenizer"),
    ("causal-lm", {"model": GPT2, "data": {"files": ["a.txt"], "dataset": "x"}, "tokenizer": {"name": "t"}},
     "task_options.data"),
    ("causal-lm", {"model": GPT2, "data": {"files": ["../a.txt"]}, "tokenizer": {"name": "t"}}, "task_options.data"),
    ("causal-lm", {"model": GPT2, "data": {"files": ["a.txt"]}, "tokenizer": {"name": "t"}, "sequence_lenght": 9},
     "task_options.sequence_lenght"),
    ("image-classification", {"model": {"model_type": "vit"}, "data": {"files": ["a.parquet"]}},
     "task_options.model.num_labels"),
    ("no-such-task", {}, "task: unknown task"),
])
def test_bad_task_options_name_the_option(task, options, named):
    with pytest.raises(TaskOptionError, match=named.replace(".", r"\.")):
        validate_task(task, options)


@pytest.fixture(scope="module")
def text_files(tmp_path_factory):
    """The demo's text, stored as run files with a tokenizer the portal trained on it."""
    root = tmp_path_factory.mktemp("text")
    train, held_out = write_corpus(root / "corpus")
    options = validate_task("causal-lm", {"model": GPT2, "data": {"files": ["train.txt"], "eval_files": ["eval.txt"]},
                                          "tokenizer": {"train": {"vocab_size": 1000, "kind": "bpe"}},
                                          "sequence_length": 64, "eval_samples": 32})
    stored = run_files.add_run_files(root / "data", "lm", "causal-lm", options,
                                     {"train.txt": train, "eval.txt": held_out})
    return options, {f.name: run_files.path_of(root / "data", "lm", f.name) for f in stored}


def test_a_causal_lm_learns_and_its_saved_files_load_with_from_pretrained(text_files, tmp_path):
    from dedloc_worker.tasks.hf import CausalLM
    from transformers import AutoModelForCausalLM

    options, paths = text_files
    torch.manual_seed(0)
    task = CausalLM(options, seed=7, files=paths, data_seed=1)
    again = CausalLM(options, seed=7, files=paths, data_seed=2)
    # Seeded initialisation: every peer starts from the same parameters.
    assert all(torch.equal(a, b) for a, b in zip(task.model.parameters(), again.model.parameters()))
    before = task.evaluate()
    optimizer = torch.optim.AdamW(task.model.parameters(), lr=3e-3)
    for _ in range(25):
        task.batch_loss(16).backward()
        optimizer.step()
        optimizer.zero_grad()
    after = task.evaluate()
    assert after < before - 0.5, (before, after)

    task.save(tmp_path / "model")
    loaded = CausalLM(options, seed=99, files=paths)
    loaded.model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert abs(loaded.evaluate() - after) < 1e-5  # same weights, same held-out windows


def test_an_image_classifier_trains_and_loads(tmp_path):
    import numpy as np
    from datasets import Dataset, Features, Image, Value
    from dedloc_worker.tasks.hf import ImageClassification
    from PIL import Image as PILImage
    from transformers import AutoModelForImageClassification

    rng = np.random.default_rng(0)
    # Two classes a classifier can tell apart: dark and bright noise.
    images = [PILImage.fromarray((rng.random((12, 12, 3)) * 100 + 155 * (i % 2)).astype("uint8")) for i in range(64)]
    table = Dataset.from_dict({"image": images, "label": [i % 2 for i in range(64)]},
                              features=Features({"image": Image(), "label": Value("int64")}))
    table.to_parquet(tmp_path / "train.parquet")
    vit = {"model_type": "vit", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
           "intermediate_size": 64, "patch_size": 4, "num_labels": 2}
    options = {"model": vit, "data": {"files": ["train.parquet"], "eval_files": ["train.parquet"]}, "image_size": 16,
               "eval_samples": 32}
    task = ImageClassification(options, seed=0, files={"train.parquet": tmp_path / "train.parquet"})
    before = task.evaluate()
    optimizer = torch.optim.AdamW(task.model.parameters(), lr=3e-3)
    for _ in range(15):
        task.batch_loss(16).backward()
        optimizer.step()
        optimizer.zero_grad()
    after = task.evaluate()
    assert after < before, (before, after)
    task.save(tmp_path / "model")
    assert isinstance(AutoModelForImageClassification.from_pretrained(tmp_path / "model"), torch.nn.Module)


def test_device_auto_is_the_gpu_when_there_is_one_else_every_physical_core():
    cpu = device.choose("auto", cuda_available=False)
    assert cpu.device == "cpu" and cpu.amp is None and cpu.threads == device.physical_cores() >= 1
    assert "cpu" in cpu.description and str(cpu.threads) in cpu.description
    bf16 = device.choose("auto", cuda_available=True, bf16_supported=True, gpu_name="NVIDIA H100")
    assert (bf16.device, bf16.amp, bf16.scaler) == ("cuda", "bfloat16", False)
    assert "NVIDIA H100" in bf16.description
    fp16 = device.choose("cuda", cuda_available=True, bf16_supported=False, gpu_name="Tesla T4")
    assert (fp16.device, fp16.amp, fp16.scaler) == ("cuda", "float16", True)
    assert device.choose("cpu", threads=3, cuda_available=True).device == "cpu"
    assert device.choose("cpu", threads=3).threads == 3


def test_device_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(ConfigError, match="no CUDA GPU"):
        device.choose("cuda", cuda_available=False)
    with pytest.raises(ConfigError, match="--device 'tpu'"):
        device.choose("tpu")


def test_physical_cores_count_hyperthread_siblings_once(tmp_path):
    import os

    allowed = sorted(os.sched_getaffinity(0))
    for cpu in allowed:  # pairs of logical CPUs share a core, as with hyper-threading
        folder = tmp_path / f"cpu{cpu}" / "topology"
        folder.mkdir(parents=True)
        folder.joinpath("thread_siblings_list").write_text(f"{cpu // 2}\n")
    assert device.physical_cores(tmp_path) == len({cpu // 2 for cpu in allowed})
    assert device.physical_cores(tmp_path / "missing") == len(allowed)  # unreadable: the logical count


def test_a_float16_task_gets_hiveminds_grad_scaler_and_others_none():
    from dedloc_worker.training.loop import grad_scaler
    from hivemind import GradScaler

    class Task:
        autocast = None

    assert grad_scaler(Task()) is None
    Task.autocast = torch.bfloat16
    assert grad_scaler(Task()) is None
    Task.autocast = torch.float16
    with warnings.catch_warnings():  # float16 only happens on a GPU; torch warns that this CPU has none
        warnings.simplefilter("ignore", UserWarning)
        assert isinstance(grad_scaler(Task()), GradScaler)
