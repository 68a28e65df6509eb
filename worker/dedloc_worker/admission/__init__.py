"""Who may talk to this peer: its key, its peer token and renewal, the denylist keeper, the RPC gate."""
