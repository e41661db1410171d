"""moetier: run Mixture-of-Experts language models on machines too small to hold all their experts."""

from moetier.engine.engine import Engine, EngineConfig, GenerationOutput

__all__ = ["Engine", "EngineConfig", "GenerationOutput"]
__version__ = "0.1.0"
