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
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as file:
            file.write(secrets.token_urlsafe(48))
    return path.read_text().strip()
