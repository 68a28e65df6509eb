"""The GPU path proven: the worker's tasks on a device, a two-worker swarm on one device, an adapter run on a causal
LM of about 1 B parameters, and the memory the worker predicts against the peak it reaches.

    python -m bench.gpu                  # CUDA where torch has it (`make bench-gpu`), sized for 8 minutes on an H100
    python -m bench.gpu --device cpu     # the CPU half, the same checks at sizes 2 cores finish in minutes

1. Masked-LM (ALBERT) and causal-LM (Llama) trials: the worker's task classes on a tokenizer trained here on local
   text (the Hub is out of reach), placed as a worker places them (autocast on CUDA), AdamW; samples/s, the peak
   memory, the loss at the start and the end (``bench.gpu_trial``, one process per trial).
2. A causal LM with gradient checkpointing, and LoRA adapters on a seeded Llama of about 1 B parameters (25 M on a
   CPU): with the base stored as the worker holds it (float32), and cast to the autocast dtype (CUDA only).
3. The memory estimate (``training.memory``: ``estimate``, ``probe``, ``peak``) against the measured peak, in every
   trial: ``torch.cuda.max_memory_allocated`` on CUDA, the growth of peak RSS on a CPU (``bench.gpu_trial``).
4. float16 with hivemind's GradScaler, an overflow forced (CUDA only, ``bench.gpu_fp16``): the scale shrinks, the
   mini-step is not counted, the epoch closes with the later samples and the step is taken.
5. A swarm (``bench.training.swarm_rate``: a portal, the run's coordinator and two workers, real processes on
   loopback, no spot checks) on one device against one solo process of the same task and batch, before and after
   it: samples/s, each worker's peak memory, the loss each worker's log printed at its first and last epoch.

Results: ``bench/results/gpu.json`` and ``gpu.md``, a section per kind of device; a run replaces its own kind's
section and keeps the other's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dedloc_common.contract import OptimizerOptions

from app.cli.demo import DEMO_TASK, write_corpus
from bench import write_results

RESULTS = Path("bench/results")
TOKENIZER = {"train": {"vocab_size": 8000, "kind": "bpe"}}
ADAPTER = {"rank": 16, "alpha": 32, "target_modules": ["q_proj", "v_proj", "lm_head"]}
PEERS = 2
TRIAL_TIMEOUT = 600  # seconds: a trial past it has hung
WARMUP = 3  # untimed mini-steps before a trial's clock starts
SOLO_SECONDS = 20
# The coordinator recomputes a drawn epoch on its CPU (bench.spot_checks measures that): on a GPU's swarm that is
# minutes of every core, beside workers that need a core each to feed the GPU.
NO_SPOT_CHECKS = {"spot_check_rate": 0}


@dataclass(frozen=True)
class Trial:
    """A task trained in a process of its own (``bench.gpu_trial``): ``steps`` timed mini-steps, or ``seconds``."""

    name: str
    task: str
    options: dict  # the task's options, as an organizer gives them
    batch: int
    lr: float  # AdamW's
    steps: int = 0
    seconds: float = 0.0
    cast_frozen: bool = False  # the frozen base stored in the autocast dtype (on CUDA)
    threads: int | None = None  # CPU threads; None: the worker's choice (every physical core)
    accumulate: int = 1  # mini-steps per optimizer step


@dataclass(frozen=True)
class Swarm:
    name: str
    task: str
    options: dict
    batch: int
    target: int  # the global batch
    seconds: float  # the measurement window


def lm(model: dict, length: int, **extra) -> dict:
    """A text task's options on the run's files, with a tokenizer trained on them."""
    return {"model": model, "data": {"files": ["train.txt"], "eval_files": ["eval.txt"]}, "tokenizer": TOKENIZER,
            "sequence_length": length, **extra}


# ALBERT-large (the paper's sahajBERT), Llamas of 25 M, 100 M and 1 B (TinyLlama's shape, with this vocabulary).
ALBERT = {"model_type": "albert", "embedding_size": 128, "hidden_size": 1024, "num_hidden_layers": 24,
          "num_attention_heads": 16, "intermediate_size": 4096, "max_position_embeddings": 512}
LLAMA_1B = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
            "num_attention_heads": 32, "num_key_value_heads": 4, "tie_word_embeddings": False}
LLAMA_100M = {**LLAMA_1B, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
              "num_attention_heads": 12, "num_key_value_heads": 12}
LLAMA_25M = {**LLAMA_1B, "hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 6,
             "num_attention_heads": 8, "num_key_value_heads": 8}
# The CPU half's smaller shapes: two cores here train about 25 GFLOP/s.
ALBERT_SMALL = {**ALBERT, "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
                "intermediate_size": 512, "embedding_size": 64, "max_position_embeddings": 128}
LLAMA_7M = {**LLAMA_1B, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 4}

TRIALS = {
    "cuda": [Trial("masked-LM, ALBERT-large", "masked-lm", lm(ALBERT, 128), batch=32, lr=5e-4, steps=100),
             Trial("causal-LM, Llama 100 M", "causal-lm", lm(LLAMA_100M, 256), batch=16, lr=1e-3, steps=100),
             Trial("causal-LM, Llama 100 M, gradient checkpointing", "causal-lm",
                   lm(LLAMA_100M, 256, gradient_checkpointing=True), batch=16, lr=1e-3, steps=20),
             Trial("LoRA on Llama 1 B, float32 base", "causal-lm", lm(LLAMA_1B, 256, adapter=ADAPTER), batch=8,
                   lr=2e-3, steps=20),
             Trial("LoRA on Llama 1 B, base in the autocast dtype", "causal-lm", lm(LLAMA_1B, 256, adapter=ADAPTER),
                   batch=8, lr=2e-3, steps=40, cast_frozen=True)],
    "cpu": [Trial("masked-LM, ALBERT 4 layers", "masked-lm", lm(ALBERT_SMALL, 64), batch=16, lr=1e-3, steps=20),
            Trial("causal-LM, Llama 7 M", "causal-lm", lm(LLAMA_7M, 64), batch=16, lr=2e-3, steps=20),
            Trial("causal-LM, Llama 7 M, gradient checkpointing", "causal-lm",
                  lm(LLAMA_7M, 64, gradient_checkpointing=True), batch=16, lr=2e-3, steps=10),
            Trial("LoRA on Llama 25 M, float32 base", "causal-lm", lm(LLAMA_25M, 64, adapter=ADAPTER), batch=8,
                  lr=2e-3, steps=10)],
}
# The CPU's is the demo's run (bench.training's "albert" row); the GPU's a model a GPU is for.
SWARMS = {"cuda": Swarm("causal-LM, Llama 25 M", "causal-lm", lm(LLAMA_25M, 128), batch=32, target=4096, seconds=30),
          "cpu": Swarm("masked-LM, the demo's ALBERT", "masked-lm", DEMO_TASK, batch=16, target=1024, seconds=20)}


def run_files(corpus: Path, task: str, options: dict) -> tuple[dict, dict[str, str]]:
    """The validated ``options`` and the run's files as a worker downloads them, with the tokenizer the portal trains
    at a run's creation (stored under ``corpus``, once per tokenizer)."""
    from dedloc_common.tasks import validate_task

    from app.runs import files

    options = validate_task(task, options)
    data, slug = corpus / "runs", "tokenizer-{kind}-{vocab_size}".format(**options["tokenizer"]["train"])
    if not (files.files_dir(data, slug) / "tokenizer.json").exists():
        files.add_run_files(data, slug, task, options, {"train.txt": corpus / "train.txt",
                                                        "eval.txt": corpus / "eval.txt"})
    return options, {f.name: str(files.path_of(data, slug, f.name)) for f in files.listed(data, slug)}


def trial(corpus: Path, device: str, config: Trial) -> dict:
    """The row ``bench.gpu_trial`` measured in a process of its own; {"name", "error"} where it failed."""
    options, files = run_files(corpus, config.task, config.options)
    spec = {**asdict(config), "options": options, "files": files, "device": device, "warmup": WARMUP}
    try:
        done = subprocess.run([sys.executable, "-m", "bench.gpu_trial", json.dumps(spec)], capture_output=True,
                              text=True, timeout=TRIAL_TIMEOUT)
    except subprocess.TimeoutExpired:  # run() has killed it
        return dict(name=config.name, error=f"no result within {TRIAL_TIMEOUT} s")
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return dict(name=config.name, error=f"exit code {done.returncode}: {last}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{config.name}: {row['samples_per_second']:,.1f} samples/s, loss {row['loss_start']:.3f} -> "
          f"{row['loss_end']:.3f}, peak {row['measured_peak_bytes'] / 2**20:,.0f} MiB (predicted "
          f"{row['predicted_peak_bytes'] / 2**20:,.0f})", flush=True)
    return row


def swarm_against_solo(corpus: Path, device: str) -> dict:
    """Two workers on the one device against one solo process (1 CPU thread each, as the swarm's workers get), the
    solo rate measured right before and right after the swarm and averaged."""
    from bench import training

    run, defaults = SWARMS[device], OptimizerOptions()
    # a solo process takes a step per swarm peer's share of the global batch, as each worker steps once per epoch
    solo = Trial(f"{run.name}, solo", run.task, run.options, run.batch, defaults.lr, seconds=SOLO_SECONDS, threads=1,
                 accumulate=max(1, run.target // (PEERS * run.batch)))
    before = trial(corpus, device, solo)
    swarm = training.swarm_rate(run.name, run.target, defaults.delay_optimizer_step, defaults.compression,
                                run.seconds, corpus, device, spec=dict(task=run.task, options=run.options, files=True),
                                batch=run.batch, during=memory_watch(device), checkpoints=NO_SPOT_CHECKS)
    after = trial(corpus, device, solo)
    if "error" in before or "error" in after:
        return dict(name=run.name, error=before.get("error") or after["error"])
    rates = [before["samples_per_second"], after["samples_per_second"]]
    solo_rate = sum(rates) / 2
    return dict(name=run.name, parameters=before["parameters"], batch=run.batch, target_batch_size=run.target,
                **swarm, solo_samples_per_second=round(solo_rate, 1), solo_before_and_after=rates,
                solo_process_peak_bytes=max(before["process_peak_bytes"], after["process_peak_bytes"]),
                swarm_over_solo=round(swarm["swarm_samples_per_second"] / solo_rate, 3))


def memory_watch(device: str):
    """``during`` for ``training.swarm_rate``: reads each worker's memory every second of the window; its peak."""
    def watch(pids: list[int], seconds: float) -> dict:
        peaks: dict[int, int] = {}
        gpu = 0
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            now, total = worker_memory(pids, device)
            peaks = {pid: max(peaks.get(pid, 0), now.get(pid, 0)) for pid in pids}
            gpu = max(gpu, total)
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        source = ("peak RSS of the worker's process (VmHWM)" if device == "cpu" else
                  "GPU memory nvidia-smi showed for the worker's process (CUDA context and cached blocks included), "
                  "the most of the window's one-second reads")
        return dict(worker_peak_bytes=[peaks.get(pid) or None for pid in pids], worker_memory_source=source,
                    **({"gpu_used_bytes": gpu} if device == "cuda" else {}))
    return watch


def worker_memory(pids: list[int], device: str) -> tuple[dict[int, int], int]:
    """Bytes each of ``pids`` holds now (CPU: its peak RSS so far), and on CUDA all the GPU's used memory."""
    if device == "cpu":
        from bench.gpu_trial import rss_of

        return {pid: rss_of(pid, "VmHWM") for pid in pids}, 0
    try:
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10).stdout
        used = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}, 0
    rows = [line.split(",") for line in apps.splitlines() if line.count(",") == 1]
    held = {int(pid): int(mib) * 2**20 for pid, mib in rows if pid.strip().isdigit() and mib.strip().isdigit()}
    total = sum(int(mib) for mib in used.split() if mib.isdigit()) * 2**20
    return {pid: held[pid] for pid in pids if pid in held}, total


def measure(device: str) -> dict:
    began, load = time.monotonic(), round(os.getloadavg()[0], 2)  # other work on the machine, named with the figures
    corpus = Path(tempfile.mkdtemp(prefix="dedloc-bench-gpu-"))
    try:
        write_corpus(corpus)
        trials = [trial(corpus, device, config) for config in TRIALS[device]]
        fp16 = fp16_overflow() if device == "cuda" else None
        try:
            swarm = swarm_against_solo(corpus, device)
        except (RuntimeError, subprocess.SubprocessError) as e:  # the swarm never got there: the trials still count
            swarm = dict(name=SWARMS[device].name, error=f"{type(e).__name__}: {e}")
    finally:
        shutil.rmtree(corpus, ignore_errors=True)
    hardware = next((row["hardware"] for row in trials if "hardware" in row), device)
    return dict(hardware=hardware, torch=torch_version(), commit=commit(), date=time.strftime("%Y-%m-%d"),
                seconds=round(time.monotonic() - began), load_before_and_after=[load, round(os.getloadavg()[0], 2)],
                trials=trials, swarm=swarm, fp16_overflow=fp16)


def fp16_overflow() -> dict:
    """``bench.gpu_fp16`` in a process of its own: float16 and hivemind's GradScaler on CUDA, an overflow forced."""
    done = subprocess.run([sys.executable, "-m", "bench.gpu_fp16"], capture_output=True, text=True,
                          timeout=TRIAL_TIMEOUT)
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        return dict(error=f"exit {done.returncode}: {(done.stderr.strip().splitlines() or [''])[-1]}")
    return json.loads(lines[-1])


def torch_version() -> str:
    import torch

    return torch.__version__


def commit() -> str:
    """The checkout measured: its commit, "-dirty" where files differ from it."""
    done = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def failures(section: dict) -> list[str]:
    """What the run did not show: a trial or the swarm that failed, or a loss that did not fall."""
    rows = [*section["trials"], section["swarm"]]
    found = [f"{row['name']}: {row['error']}" for row in rows if "error" in row]
    found += [f"{row['name']}: the loss did not fall ({row['loss_start']} -> {row['loss_end']})"
              for row in section["trials"] if "error" not in row and row["loss_end"] >= row["loss_start"]]
    fp16 = section.get("fp16_overflow")
    if fp16 is not None and ("error" in fp16 or not (fp16["overflow_rejected"] and fp16["scale_after"] <
                                                     fp16["scale_before"] and fp16["stepped"])):
        found.append(f"float16 overflow on CUDA: {fp16}")
    swarm = section["swarm"]
    found += [f"{swarm['name']}: a worker's loss did not fall ({losses})" for losses in swarm.get("worker_losses", [])
              if not losses or losses[1] >= losses[0]]
    return found


def main(argv=None) -> int:
    import torch

    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description="the GPU path: tasks, an adapter and a "
                                     "swarm on one device, and the memory estimate")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where to train (default: cuda where torch has it)")
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu.json")
    args = parser.parse_args(argv)
    from dedloc_worker.errors import ConfigError
    from dedloc_worker.training import device as devices

    try:  # the machine's answer without a CUDA context in this process: the trials and workers hold the GPU
        devices.choose(args.device, 1, bf16_supported=True, gpu_name="")
    except ConfigError as e:
        print(f"bench.gpu: {e}", file=sys.stderr)
        return 2
    section = measure(args.device)
    sections = json.loads(args.out.read_text()) if args.out.exists() else {}
    sections[args.device] = section
    from bench.gpu_report import markdown

    write_results(args.out, sections, markdown(sections))
    problems = failures(section)
    for problem in problems:
        print(f"bench.gpu: {problem}", file=sys.stderr)
    print(f"bench.gpu: {args.device} in {section['seconds']} s", flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
