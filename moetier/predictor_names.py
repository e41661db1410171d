"""The predictors by name: what each is made from and where a caller gets it. Names alone, apart from the
predictors (moetier/predict/, which import torch), so the command line offers and checks them without loading it."""

BUILT_ON = {  # what each is made from, and where a caller gets it
    "stacked-gates": ("routers", "the model's router weights (the engine hands them over; a trace needs its model)"),
    "smoe-lookahead": ("lookahead", "the model's next attention layer and router, run by the engine on the hidden "
                       "state (a trace does not hold what it needs)"),
    "llapor": ("nets", "networks trained by `moetier train predictor --predictor llapor`"),
    "comoe-mlp": ("nets", "networks trained by `moetier train predictor --predictor comoe-mlp`"),
    "hot": ("counts", "use counts per expert, from a recorded trace"),
    "oracle": ("truth", "the true routing of the same run: a recorded trace (the simulator)"),
}
# the predictors made of networks trained and saved with a model (moetier/predictor_files.py reads and writes them)
TRAINED = tuple(name for name, (needs, _) in BUILT_ON.items() if needs == "nets")
