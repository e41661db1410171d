"""Next-layer expert predictors (DESIGN.md's `Predictor`): one file each, the contract in `base.py`, the measures
of a prediction in `quality.py`. Each is made by name from what it is built on, handed in by its caller: a
model's router weights (`routers`), the model's look-ahead (`lookahead`), a table of use counts (`counts`), the
true routing (`truth`), trained networks (`nets`, read by moetier/predictor_files.py)."""

from __future__ import annotations

from collections.abc import Sequence

from moetier.errors import MoetierError
from moetier.predict.base import Predictions, Predictor
from moetier.predict.comoe_mlp import ComoeMLPPredictor
from moetier.predict.hot import HotPredictor
from moetier.predict.llapor import LLaPorPredictor
from moetier.predict.oracle import OraclePredictor
from moetier.predict.smoe_lookahead import SmoeLookaheadPredictor
from moetier.predict.stacked_gates import StackedGatesPredictor
from moetier.predictor_names import BUILT_ON

PREDICTORS: dict[str, type[Predictor]] = {
    "stacked-gates": StackedGatesPredictor,
    "smoe-lookahead": SmoeLookaheadPredictor,
    "llapor": LLaPorPredictor,
    "comoe-mlp": ComoeMLPPredictor,
    "hot": HotPredictor,
    "oracle": OraclePredictor,
}


def make_predictor(name: str, moe_layers: Sequence[int], num_experts: int, top_k: int, distance: int = 1,
                   **inputs) -> Predictor:
    """Predictor `name`, or a clear error naming what it needs."""
    if name not in PREDICTORS:
        raise MoetierError(f"unknown predictor {name!r}", hint=f"one of {', '.join(PREDICTORS)}")
    needs, where = BUILT_ON[name]
    if inputs.get(needs) is None:
        raise MoetierError(f"predictor {name!r} needs {needs}: {where}, and none was given")
    return PREDICTORS[name](moe_layers, num_experts, top_k, distance=distance, **inputs)


__all__ = ["BUILT_ON", "PREDICTORS", "Predictions", "Predictor", "make_predictor"]
