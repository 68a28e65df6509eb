"""Talking to the portal over HTTP: the client, device login, the run's files."""
