"""Starting a run's processes: `tessel train --nproc` through torchrun, multi-node rendezvous and
elastic node ranges, the per-node launcher, and the Slurm and Kubernetes job files.

Imports nothing here: `python -m tessel.launch.node` (what every Slurm node runs) and
`python -m tessel.launch.torchrun` start without loading torch or the trainer.
"""
