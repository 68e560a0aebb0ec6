"""Predict each strategy's speed on a model, a size and a machine before running it (``paradiff plan``)."""
