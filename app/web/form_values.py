"""Reading the run forms' text fields: JSON options and whole numbers, with errors that name the option."""

from __future__ import annotations

import json
from typing import Any, Optional

from app.core.errors import Invalid

INT_MAX = 2**31 - 1  # the database's INTEGER: a larger number would fail there, not here


def json_object(text: Optional[str], name: str) -> dict[str, Any]:
    """A JSON object typed into a textarea; empty means no options (the defaults)."""
    if text is None or not text.strip():
        return {}
    try:
        value = json.loads(text)
    except ValueError as e:
        raise Invalid(f"{name}: not JSON ({e})") from None
    if not isinstance(value, dict):
        raise Invalid(f"{name}: must be a JSON object, {{...}}")
    return value


def whole(text: Optional[str], name: str, optional: bool = False) -> Optional[int]:
    """A whole number typed into an input; empty means none when ``optional``."""
    text = (text or "").strip()
    if not text and optional:
        return None
    try:
        value = int(text)
    except ValueError:
        raise Invalid(f"{name}: {text!r} is not a whole number") from None
    if abs(value) > INT_MAX:
        raise Invalid(f"{name}: {value} is past {INT_MAX:,}")
    return value


def pretty(value: Any) -> str:
    """Options as the forms show them: indented JSON."""
    return json.dumps(value, indent=2)
