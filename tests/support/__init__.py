"""What the tests share, apart from fixtures (those are in tests/conftest.py). No test module imports another.

- ``harness``: a real deployment on loopback (``Deployment``), ``free_port``, ``wait_for``, ``tagged_processes``.
- ``oidc_provider``: a loopback OpenID Connect provider (``OidcProvider``) and ``LoopbackServer`` for ASGI apps.
- ``portal.client``: a portal served on loopback for the sign-in tests (``Portal``), the worker's device login in a
  thread (``LoginThread``), the provider's client settings and ``form_token``.
- ``browsers``: Debian's Chromium for the Playwright tests (``CHROMIUM``, ``needs_chromium``, ``launch_chromium``).
- ``factories``: shared builders of database rows and peer tokens (credited contributions, the populated
  accounting scenario, ``peer_token``).
- ``actors``: scripts and plugins that run in the processes a test starts (an attacker, a lying worker, a
  witnessing worker, a failing task); ``tests.support.actors`` names their paths.
"""
