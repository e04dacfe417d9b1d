"""Placing a model on a device mesh: degrees, TP/PP/DP/CP/EP, the replica groups (starting
the processes: tessel.launch)."""
