"""Placing a model on a device mesh: degrees, TP/PP/DP, launch."""
