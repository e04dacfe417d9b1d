"""Metrics sinks, MFU and the console display."""
