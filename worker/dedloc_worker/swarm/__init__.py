"""The run's swarm: the DHT node and the optimizer it serves, signed records, lookups, leaving cleanly."""
