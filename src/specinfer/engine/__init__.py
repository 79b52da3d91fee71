"""In-process speculative generation (one LLM, any number of SSMs)."""

from specinfer.engine.engine import EngineConfig, SpeculativeEngine
from specinfer.engine.requests import GenerationRequest, GenerationResult, SpeculationConfig, StepStats

__all__ = ["EngineConfig", "GenerationRequest", "GenerationResult", "SpeculationConfig", "SpeculativeEngine", "StepStats"]
