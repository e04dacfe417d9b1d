"""The planner: per-GPU memory and step time of a layout, predicted before launch, and the
search over every layout tessel can run (`tessel plan`, `parallel.auto`).

    hardware.py   GPU profiles (peaks, memory, links), TOML overrides, calibration
    layout.py     a candidate layout: exactly the parallel.* settings of a run
    probe.py      activation memory from the tensors the real model saves
    exchange.py   a stand-in context-parallel exchange (shapes only) for the probe
    saved.py      the saved-bytes profiles the probe measures
    schedule.py   micro-batches in flight per pipeline rank (PyTorch's own schedules)
    memory.py     parameters, gradients, optimizer state, activations, buffers per GPU
    speed.py      compute, communication, bubble: step time
    search.py     validity (tessel's own checks), evaluation, search, nearest layouts
    report.py     text and JSON output
    prelaunch.py  what `tessel train` asks before it builds the model
"""
