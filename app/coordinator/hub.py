"""Pushing checkpoints to the Hugging Face Hub, when a run's checkpoint options name a ``hub_repo``.

Each stored checkpoint's Hugging Face files (config.json, model.safetensors, tokenizer files; not the training
state) go to the repository in one commit, with a README.md model card naming the run, its page, the epoch, the
evaluation loss and the credited contributors. The token is the coordinator's ``HF_TOKEN``; ``HF_ENDPOINT`` points
at another Hub. A push that fails is one line in the coordinator's output: the checkpoint stays stored."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Optional

CONTRIBUTORS_SHOWN = 20
# What resuming needs beyond the model: it stays in the portal's archive, not on the Hub.
NOT_PUSHED = {"training_state.pt", "dedloc.json", "README.md"}


class HubPushError(Exception):
    """A push that did not happen, in one line (network, refused token, missing repository, bad answer)."""


def model_card(*, run_title: str, run_url: str, contributors: list[tuple[str, int]], epoch: int,
               eval_loss: Optional[float]) -> str:
    """The README.md of the repository: metadata (``library_name: transformers``, tag ``dedloc``) and the run."""
    from huggingface_hub import ModelCard, ModelCardData

    data = ModelCardData(library_name="transformers", tags=["dedloc"])
    run = f"[{run_title}]({run_url})" if run_url else run_title
    loss = "not measured" if eval_loss is None else f"{eval_loss:.4f}"
    lines = [f"# {run_title}", "",
             f"Trained collaboratively with dedloc, by volunteers, in the run {run}.", "",
             f"- epoch (collaboration-wide optimizer steps): {epoch}",
             f"- evaluation loss: {loss}", "",
             "## Contributors", ""]
    if contributors:
        lines += ["| volunteer | samples |", "| --- | ---: |"]
        lines += [f"| {name} | {samples:,} |" for name, samples in contributors]
    else:
        lines.append("No credited samples yet.")
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n"))


def push_checkpoint(folder: Path, repo_id: str, *, token: Optional[str], run_title: str, run_url: str,
                    contributors: list[tuple[str, int]], epoch: int, eval_loss: Optional[float],
                    endpoint: Optional[str] = None, private: Optional[bool] = None) -> str:
    """Create ``repo_id`` if missing, then commit the folder's model files and a model card; the commit's URL.

    Raises HubPushError (one line) for anything that stops the push."""
    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.errors import HfHubHTTPError

    card = model_card(run_title=run_title, run_url=run_url, contributors=contributors, epoch=epoch,
                      eval_loss=eval_loss)
    operations = [CommitOperationAdd(path_in_repo=path.name, path_or_fileobj=str(path))
                  for path in sorted(Path(folder).iterdir()) if path.is_file() and path.name not in NOT_PUSHED]
    operations.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=card.encode()))
    api = HfApi(endpoint=endpoint or os.environ.get("HF_ENDPOINT") or None, token=token)
    try:
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        info = api.create_commit(repo_id, operations, repo_type="model",
                                 commit_message=f"dedloc: {run_title}, checkpoint at epoch {epoch}")
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        if status in (401, 403):
            raise HubPushError(f"the Hub refused the token (HTTP {status}): check HF_TOKEN's write access "
                               f"to {repo_id!r}") from None
        if status == 404:
            raise HubPushError(f"no repository {repo_id!r} on the Hub (HTTP 404)") from None
        raise HubPushError(f"the Hub answered HTTP {status} for {repo_id!r}: {one_line(e)}") from None
    except Exception as e:  # noqa: BLE001 - network errors, answers huggingface_hub could not read, a refused card
        raise HubPushError(f"could not push to the Hub at {api.endpoint}: {one_line(e)}") from None
    return info.commit_url or info.oid


def one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def push_stored(config, options, archive: Path, sessions, *, epoch: int, eval_loss: Optional[float]) -> Optional[str]:
    """The checkpointer's hook, after a checkpoint is stored: push it when ``options.hub_repo`` is set.

    Never raises: a failed push prints one line and the checkpoint stays stored."""
    if not options.hub_repo:
        return None
    try:
        from dedloc_worker.training.checkpoints import extract

        from app.credit.ledger import leaderboard
        from app.runs import registry

        with sessions() as session:
            run = registry.get_run(session, config.slug)
            title = run.title or config.slug
            contributors = [(entry.username, entry.samples)
                            for entry in leaderboard(session, run, CONTRIBUTORS_SHOWN) if entry.samples > 0]
        public_url = os.environ.get("DEDLOC_PUBLIC_URL", "").rstrip("/")
        with tempfile.TemporaryDirectory(dir=archive.parent) as scratch:
            folder = extract(archive, Path(scratch) / "checkpoint")
            where = push_checkpoint(folder, options.hub_repo, token=os.environ.get("HF_TOKEN") or None,
                                    run_title=title, run_url=f"{public_url}/runs/{config.slug}" if public_url else "",
                                    contributors=contributors, epoch=epoch, eval_loss=eval_loss)
    except Exception as e:  # noqa: BLE001 - the checkpointer must go on whatever happened here
        print(f"could not push checkpoint {epoch} to the Hub: {one_line(e)}", flush=True)
        return None
    print(f"pushed checkpoint {epoch} of run {config.slug!r} to the Hub: {where}", flush=True)
    return where
