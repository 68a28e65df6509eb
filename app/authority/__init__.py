"""A run's authority: its signing key, who it admits (policy, allowlist, bans) and the peer tokens it issues."""
