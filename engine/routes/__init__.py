"""Routing traces: which experts each token chose in each MoE layer.

``trace``: the file format (``.npz``), its checks and the recorder a model's MoE layers report to;
``synthetic``: traces with a published model's routing statistics, for models whose weights are not here.
"""

from engine.routes.trace import PHASE_DECODE, PHASE_PROMPT, RouteRecorder, RouteTrace, load_trace, save_trace

__all__ = ["PHASE_DECODE", "PHASE_PROMPT", "RouteRecorder", "RouteTrace", "load_trace", "save_trace"]
