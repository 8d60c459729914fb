"""Held-out evaluation: episodes on held-out tasks (heldout.py) and their statistics (stats.py)."""
