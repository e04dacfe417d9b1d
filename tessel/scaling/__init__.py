"""Scaling measured on the machine: short real training runs of a config at several process
counts (`measure.measure_sweep`, what `tessel scale --measure` runs) and the all-reduce cost
of gloo between local processes (`gloo.measure_gloo`, for calibrating the planner)."""

from tessel.scaling.measure import default_layout, measure_sweep
from tessel.scaling.points import MeasuredPoint

__all__ = ["MeasuredPoint", "default_layout", "measure_sweep"]
