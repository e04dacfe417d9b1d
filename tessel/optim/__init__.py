"""The optimizers a run trains with (AdamW, Muon; state in low precision or host memory) and
the learning-rate schedule."""
