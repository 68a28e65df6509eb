"""What this peer is credited for: receipts of the parts it aggregated, the outbox of its claims."""
