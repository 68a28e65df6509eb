"""Identity: users, OpenID Connect and development sign-in, API credentials and the device login (RFC 8628).

Business logic lives in plain modules with no FastAPI import (``accounts``, ``device``); ``deps`` holds the
request dependencies other code imports (``CurrentUser``, ``OptionalUser``, ``ApiUser``); the routes are in
``app/web/auth_routes.py``.
"""
