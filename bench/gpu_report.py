"""``bench/results/gpu.md`` from the sections ``bench.gpu`` measured, one per kind of device ("cuda", "cpu")."""

from __future__ import annotations

MIB = 2**20
KINDS = ("cuda", "cpu")
SOLO_MEMORY = {"cuda": "`torch.cuda.max_memory_reserved` (the CUDA context not included)",
               "cpu": "its peak RSS (VmHWM)"}


def markdown(sections: dict) -> str:
    lines = ["# The GPU path: tasks, an adapter and a swarm on one device, and the memory estimate", "",
             "Written by `python -m bench.gpu`: `make bench-gpu` on a CUDA machine, and its CPU half (`--device cpu`, "
             "the same checks at", "sizes two cores finish in minutes) in `make bench`. A run replaces its own kind's "
             "section and keeps the other's. How each", "figure is measured: the docstrings of `bench/gpu.py` and "
             "`bench/gpu_trial.py`.", ""]
    for kind in KINDS:
        lines += section(kind, sections[kind]) if kind in sections else missing(kind)
    return "\n".join(lines) + "\n"


def missing(kind: str) -> list[str]:
    if kind != "cuda":
        return [f"## {kind}", "", "Not run yet.", ""]
    return ["## CUDA", "", "No CUDA run has happened yet: no accelerator was lent to the session that wrote this "
            "bench. `make bench-gpu` on a", "CUDA machine fills this section; no GPU figure is estimated in its place.",
            ""]


def section(kind: str, run: dict) -> list[str]:
    lines = [f"## {run['hardware']}", "",
             f"{run['date']}, commit {run['commit']}, torch {run['torch']}; the whole run took {run['seconds']} s; the "
             "machine's load average (1 minute) at its start and end: "
             f"{' and '.join(str(v) for v in run['load_before_and_after'])}.", ""]
    lines += trials(run["trials"], kind)
    lines += adapters([row for row in run["trials"] if "error" not in row and row["trained_parameters"] <
                       row["parameters"]])
    lines += swarm(run["swarm"], kind)
    lines += fp16(run.get("fp16_overflow"))
    return lines


def fp16(row) -> list[str]:
    if row is None:
        return []
    lines = ["### float16 with hivemind's GradScaler, an overflow forced", ""]
    if "error" in row:
        return lines + [f"Failed: {row['error']}", ""]
    return lines + [f"Scale {row['scale_before']:g} before, {row['scale_after']:g} after the overflow; the overflowed "
                    f"mini-step {'rejected' if row['overflow_rejected'] else 'ACCEPTED'} and counted "
                    f"{row['overflow_counted']} times; the epoch then closed with {row['epoch_samples']} samples from "
                    f"{row['mini_steps_after']} mini-steps; the step was {'taken' if row['stepped'] else 'NOT taken'}.",
                    ""]


def trials(rows: list[dict], kind: str) -> list[str]:
    measured = ("`torch.cuda.max_memory_allocated` over the trial's mini-steps" if kind == "cuda" else
                "the growth of the trial process's peak RSS (VmHWM, reset after the probe, freed memory trimmed) "
                "plus the parameters' bytes, as tests/test_memory_peak.py measures it: it holds what is no tensor "
                "too (the allocator's slack, oneDNN's scratch, autograd's graph)")
    lines = ["### Training on the device, and the memory the worker predicts", "",
             "Each trial in a process of its own: the worker's task class, AdamW, a step per mini-batch. Loss: the "
             "mean of the first three and", "of the last three mini-steps. Predicted: `memory.peak(estimate(...), "
             f"probe(task, batch), batch)`. Measured: {measured}.", "",
             "| trial | parameters | trained | batch | mini-steps | samples/s | loss, start -> end | peak, measured | "
             "predicted | predicted / measured | model, optimizer, gradients | activations: fixed + per sample |",
             "|" + " --- |" * 12]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['name']} | failed: {row['error'].replace('|', '/')} |" + " |" * 10)
            continue
        need = row["estimate"]
        lines.append(
            f"| {row['name']} | {millions(row['parameters'])} | {millions(row['trained_parameters'])} | "
            f"{row['batch']} | {row['mini_steps']} | {row['samples_per_second']:,.1f} | "
            f"{row['loss_start']:.3f} -> {row['loss_end']:.3f} | {mib(row['measured_peak_bytes'])} | "
            f"{mib(row['predicted_peak_bytes'])} | {row['predicted_over_measured']:.2f} | {mib(need['device'])} | "
            f"{mib(need['activations_fixed'])} + {mib(need['activations_per_sample'])} |")
    return lines + [""]


def adapters(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    lines = ["### Adapters: what the swarm averages against the whole model", "",
             "| trial | trained parameters | adapter, bytes | model as stored, bytes | the model in float32 | "
             "adapter / float32 model |", "|" + " --- |" * 6]
    lines += [f"| {row['name']} | {row['trained_parameters']:,} | {mib(row['trained_bytes'])} | "
              f"{mib(row['parameter_bytes'])} | {mib(4 * row['parameters'])} | "
              f"{row['trained_bytes'] / (4 * row['parameters']):.2%} |" for row in rows]
    return lines + [""]


def swarm(row: dict, kind: str) -> list[str]:
    lines = ["### Two workers on one device against one solo process", ""]
    if "error" in row:
        return lines + [f"{row['name']}: failed: {row['error']}", ""]
    share = ("Both share one GPU: swarm / solo says what two workers on it make of one process's rate, averaging "
             "included." if kind == "cuda" else
             "On a CPU each worker and the solo process get one thread; two workers hold two cores, with the "
             "coordinator and the portal on the same cores (bench.training compares like with like: two solo "
             "processes).")
    lines += [f"`bench.training.swarm_rate`: a portal, the run's coordinator and {len(row['worker_losses'])} "
              "workers on loopback, the run's default optimizer (DPU, compression), no spot checks; solo: the same "
              "task and batch, a step per worker's share of the global batch, right before and right after the swarm. "
              f"{share} Workers' memory: {row['worker_memory_source']}; the solo process's: {SOLO_MEMORY[kind]}. "
              "Loss: what each worker's log printed for its first and last epoch.", "",
              "| task | parameters | batch | global batch | epoch, s | epochs | swarm samples/s | solo samples/s "
              "(before / after) | swarm / solo | workers' peak memory | solo's peak | workers' loss, first -> last "
              "epoch | failed rounds | partial rounds |", "|" + " --- |" * 14]
    memory = " / ".join(mib(b) if b else "-" for b in row["worker_peak_bytes"])
    if row.get("gpu_used_bytes"):
        memory += f" (the whole GPU: {mib(row['gpu_used_bytes'])})"
    losses = " / ".join(f"{pair[0]:.3f} -> {pair[1]:.3f}" if pair else "-" for pair in row["worker_losses"])
    solo = " / ".join(f"{rate:,.1f}" for rate in row["solo_before_and_after"])
    cells = [row["name"], millions(row["parameters"]), row["batch"], f"{row['target_batch_size']:,}",
             row["epoch_seconds"], row["epochs"], f"{row['swarm_samples_per_second']:,.1f}",
             f"{row['solo_samples_per_second']:,.1f} ({solo})", f"{row['swarm_over_solo']:.2f}", memory,
             mib(row["solo_process_peak_bytes"]), losses, row["failed_rounds"], row["partial_rounds"]]
    return lines + ["| " + " | ".join(str(cell) for cell in cells) + " |", ""]


def millions(count: int) -> str:
    return f"{count / 1e6:,.{2 if count < 10**7 else 1}f} M"


def mib(value: int) -> str:
    return f"{value / MIB:,.0f} MiB"
