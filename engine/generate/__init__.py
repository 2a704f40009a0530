"""Generation: sampling, the decode loop, and the events it yields."""

from engine.generate.events import GenerationEvent
from engine.generate.loop import CacheState, TokenConstraint, generate, greedy_continuation
from engine.generate.sampling import Sampler, SamplingParams

__all__ = [
    "CacheState",
    "GenerationEvent",
    "Sampler",
    "SamplingParams",
    "TokenConstraint",
    "generate",
    "greedy_continuation",
]
