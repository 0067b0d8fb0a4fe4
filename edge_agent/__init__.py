"""The edge agent: answer locally, escalate the inputs it is unsure about, never block.

The names an integrator composes; transports are in `edge_agent.transports`, the journal in
`edge_agent.journal`, the controller in `edge_agent.controller` (`EdgeAgent(controller=True)` builds
one, with the priors of `AdaptiveOptions`).
"""

from edge_agent.adaptive import AdaptiveOptions
from edge_agent.agent import AgentOptions, EdgeAgent
from edge_agent.breaker import BreakerConfig, CircuitBreaker
from edge_agent.budget import Budget
from edge_agent.cache import ResultCache
from edge_agent.policy import (
    BoundPolicy,
    Calibrated,
    CustomScore,
    EnergyOOD,
    Entropy,
    Margin,
    MaxProb,
    MinOf,
    Policy,
    Scorer,
    Weighted,
    threshold_for_accuracy,
    threshold_for_rate,
)
from edge_agent.prediction import Prediction

__all__ = [
    "AdaptiveOptions",
    "AgentOptions",
    "BoundPolicy",
    "BreakerConfig",
    "Budget",
    "Calibrated",
    "CircuitBreaker",
    "CustomScore",
    "EdgeAgent",
    "EnergyOOD",
    "Entropy",
    "Margin",
    "MaxProb",
    "MinOf",
    "Policy",
    "Prediction",
    "ResultCache",
    "Scorer",
    "Weighted",
    "threshold_for_accuracy",
    "threshold_for_rate",
]
