"""Averaging rounds: the planned split, following the plan, matchmaking, state sharing, robust aggregation."""
