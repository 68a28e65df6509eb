"""The coordinator: the run's bootstrap peer and monitor. A separate process from the web portal."""
