"""Runs: creating and finding them, their coordinators, swarm snapshots, public averaging plans, and what a volunteer
downloads to join."""
