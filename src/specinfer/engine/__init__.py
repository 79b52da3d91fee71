"""In-process speculative generation (one LLM, any number of SSMs)."""

from specinfer.core.requests import GenerationRequest, GenerationResult, SpeculationConfig, StepStats
from specinfer.engine.engine import EngineConfig, SpeculativeEngine

__all__ = [
    "EngineConfig",
    "GenerationRequest",
    "GenerationResult",
    "SpeculationConfig",
    "SpeculativeEngine",
    "StepStats",
]
