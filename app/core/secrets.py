"""The portal's secret key: signs session cookies and encrypts run authority keys at rest."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from app.core.config import Settings

MIN_LENGTH = 32


def secret_key(settings: Settings) -> str:
    """``settings.secret_key``, else a random key created once in ``data_dir/secret.key`` (mode 0600).

    Refuses a configured key shorter than 32 characters: it would make forged sessions guessable.
    """
    if settings.secret_key:
        if len(settings.secret_key) < MIN_LENGTH:
            raise ValueError(f"DEDLOC_SECRET_KEY must be at least {MIN_LENGTH} characters; generate one with "
                             "`python -c 'import secrets; print(secrets.token_urlsafe(48))'`")
        return settings.secret_key
    path = Path(settings.data_dir) / "secret.key"
    if not path.exists():
        # Written whole under another name, then linked into place: processes starting together (several web
        # processes, a portal and a coordinator) all read the one key that won, never a half-written file.
        path.parent.mkdir(parents=True, exist_ok=True)
        draft = path.with_name(f".secret.key.{os.getpid()}.{secrets.token_hex(4)}")
        descriptor = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(descriptor, "w") as file:
                file.write(secrets.token_urlsafe(48))
            os.link(draft, path)
        except FileExistsError:
            pass  # another process was first
        finally:
            draft.unlink(missing_ok=True)
    return path.read_text().strip()
