"""A run's files: the data an organizer provides and the tokenizer the portal trains on it at run creation, kept
under DATA_DIR/runs/<slug>/files and served to workers (``GET /api/v1/runs/{slug}/files/{name}``).

A manifest (``files.json``) holds each file's size and sha256, which workers check and cache by."""

from __future__ import annotations

import csv
import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Any, Iterable, Iterator

from dedloc_common import tasks as spec
from dedloc_common.contract import RunFile

from app.core.errors import Invalid, NotFound

MANIFEST = "files.json"
TEXT_SUFFIXES = (".txt", ".jsonl", ".json", ".csv")


def files_dir(data_dir: Path | str, slug: str) -> Path:
    return Path(data_dir).resolve() / "runs" / slug / "files"


def listed(data_dir: Path | str, slug: str) -> list[RunFile]:
    manifest = files_dir(data_dir, slug) / MANIFEST
    if not manifest.exists():
        return []
    return [RunFile.model_validate(entry) for entry in json.loads(manifest.read_text())]


def path_of(data_dir: Path | str, slug: str, name: str) -> Path:
    """The stored file ``name``; ``NotFound`` unless the manifest lists it (never a path from the request)."""
    for file in listed(data_dir, slug):
        if file.name == name:
            return files_dir(data_dir, slug) / file.name
    raise NotFound(f"run {slug!r} has no file named {name!r}")


def store(data_dir: Path | str, slug: str, name: str, source: Path) -> RunFile:
    """Copy ``source`` in as ``name`` and list it in the manifest."""
    if not re.match(spec.FILE_NAME, name):
        raise Invalid(f"file name {name!r}: use letters, digits, '.', '_' and '-'")
    folder = files_dir(data_dir, slug)
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / name
    shutil.copyfile(source, target)
    digest = hashlib.sha256()
    with target.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    entry = RunFile(name=name, size=target.stat().st_size, sha256=digest.hexdigest())
    others = [f for f in listed(data_dir, slug) if f.name != name]
    (folder / MANIFEST).write_text(json.dumps([f.model_dump() for f in others + [entry]], indent=1))
    return entry


def check_data(task: str, options: dict, provided: dict[str, Path]) -> None:
    """Every data file the options name is provided, and text files have the text column; ``Invalid`` naming
    the option otherwise."""
    data = options.get("data", {})
    for key in ("files", "eval_files"):
        for name in data.get(key, []):
            if name not in provided:
                raise Invalid(f"task_options.data.{key}: {name!r} was not uploaded with the run")
            if task in spec.TEXT_TASKS:
                if Path(name).suffix.lower() not in TEXT_SUFFIXES:
                    raise Invalid(f"task_options.data.{key}: {name!r} is not text (.txt, .jsonl or .csv)")
                first = next(texts([provided[name]], data.get("text_column", "text"), name), None)
                if first is None:
                    raise Invalid(f"task_options.data.{key}: {name!r} holds no text")


def texts(paths: Iterable[Path], column: str, label: str = "") -> Iterator[str]:
    """The texts of .txt (a line each), .jsonl and .csv files (the ``column`` of each record)."""
    for path in paths:
        suffix = Path(label or path).suffix.lower()
        with open(path, encoding="utf-8", errors="replace") as f:
            rows: Iterable[Any]  # records: JSON values (checked below to be objects) or CSV rows
            if suffix in (".jsonl", ".json"):
                rows = (json.loads(line) for line in f if line.strip())
            elif suffix == ".csv":
                rows = csv.DictReader(f)
            else:
                yield from (line.rstrip("\n") for line in f if line.strip())
                continue
            try:
                for row in rows:
                    if not isinstance(row, dict) or column not in row:
                        raise Invalid(f"task_options.data.text_column: {Path(label or path).name} has no column "
                                      f"{column!r}")
                    yield str(row[column])
            except (ValueError, csv.Error) as e:  # a broken line: the organizer's file, not a portal fault
                raise Invalid(f"task_options.data: {Path(label or path).name} is not well-formed {suffix[1:]} "
                              f"({e})") from None


def train_tokenizer(paths: list[Path], labels: list[str], column: str, options: dict) -> bytes:
    """A tokenizer trained on the run's texts (``tokenizers``), as tokenizer.json bytes, with the special tokens
    the worker's tasks use (``dedloc_common.tasks.SPECIAL_TOKENS``)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    wanted = spec.TrainedTokenizer.model_validate(options)
    special = sorted(set(spec.SPECIAL_TOKENS.values()), key=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"].index)
    trainer: trainers.Trainer
    if wanted.kind == "unigram":
        tokenizer = Tokenizer(models.Unigram())
        trainer = trainers.UnigramTrainer(vocab_size=wanted.vocab_size, special_tokens=special, unk_token="[UNK]")
    elif wanted.kind == "bpe":
        tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
        trainer = trainers.BpeTrainer(vocab_size=wanted.vocab_size, special_tokens=special)
    else:
        tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        trainer = trainers.WordPieceTrainer(vocab_size=wanted.vocab_size, special_tokens=special)
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    stream = (text for path, label in zip(paths, labels) for text in texts([path], column, label))
    tokenizer.train_from_iterator(stream, trainer)
    return tokenizer.to_str().encode()


def add_run_files(data_dir: Path | str, slug: str, task: str, options: dict,
                  provided: dict[str, Path]) -> list[RunFile]:
    """Store the uploaded files the options name, and train the tokenizer they ask for."""
    check_data(task, options, provided)
    stored = [store(data_dir, slug, name, path) for name, path in provided.items()]
    trained = (options.get("tokenizer") or {}).get("train")
    if task in spec.TEXT_TASKS and trained is not None:
        names = options["data"]["files"]
        body = train_tokenizer([provided[n] for n in names], names, options["data"].get("text_column", "text"), trained)
        scratch = files_dir(data_dir, slug) / (spec.TRAINED_TOKENIZER_FILE + ".new")
        scratch.write_bytes(body)
        stored.append(store(data_dir, slug, spec.TRAINED_TOKENIZER_FILE, scratch))
        scratch.unlink()
    return stored


def remove_all(data_dir: Path | str, slug: str) -> None:
    shutil.rmtree(files_dir(data_dir, slug), ignore_errors=True)
