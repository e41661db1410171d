"""Next-layer expert predictors (DESIGN.md's `Predictor`): one file each, the contract in `base.py`, the measures
of a prediction in `quality.py`."""
