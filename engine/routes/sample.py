"""A session's own routing, sampled from its prompts: what the planner's re-plan of an ``auto`` placement prices the
expert cache with (``engine.api.Session``; the hit-rate curve of the cache policy replayed on it,
``engine.runtime.hit_curves.hit_curve``).

:class:`RoutingSample` is a one-shot route tap (``DecoderModel.set_route_tap``): :meth:`RoutingSample.arm` attaches
it in front of whatever tap the model has (a replayer's routes are then what it records); the next forward pass
records every MoE layer's routing when it is a prompt (two tokens or more), and the tap then gives the model back its
previous tap. A prompt pass's routing comes off the device once a layer; decode steps never see the sample (it has
left before the first of them), so their fused host step and CUDA graphs are as without it.
"""

from __future__ import annotations

from engine.routes.trace import RouteRecorder, RouteTrace


class RoutingSample:
    """The routes of this session's prompts, pass by pass, until :attr:`n_tokens` reaches what the caller needs."""

    def __init__(self, n_expert: int, k: int, model: str = ""):
        self._rec = RouteRecorder(n_expert, k, model=model, source="session prompts")
        self._model = None  # the model it is attached to, while armed
        self._inner = None  # the tap it stands in front of (None: none)
        self._recording = False

    @property
    def layerwise(self) -> bool:
        """As the tap it stands in front of: a recorder's layer-by-layer decode stays (no decode step sees this one)."""
        return bool(getattr(self._inner, "layerwise", False))

    @property
    def armed(self) -> bool:
        return self._model is not None

    @property
    def n_tokens(self) -> int:
        """Prompt tokens recorded so far."""
        return self._rec.n_tokens

    def arm(self, model) -> None:
        """Record the next forward pass of ``model`` (when it is a prompt), then detach. The decode graphs the model
        has captured stay: a one-token pass through this tap routes as the tap behind it does."""
        if self._model is not None:
            return
        self._inner, self._model = model.route_tap, model
        model.set_route_tap(self, keep_graphs=True)

    def disarm(self) -> None:
        """Detach now (the model's previous tap back in place)."""
        model, self._model = self._model, None
        if model is not None and model.route_tap is self:
            model.set_route_tap(self._inner, keep_graphs=True)
        self._inner = None

    def trace(self) -> RouteTrace:
        return self._rec.trace()

    # -- the tap ------------------------------------------------------------------------------------
    def begin_pass(self, n_tokens: int) -> None:
        if self._inner is not None:
            self._inner.begin_pass(n_tokens)
        self._recording = n_tokens >= 2

    def route(self, layer: int, r):
        if self._inner is not None:
            r = self._inner.route(layer, r)
        if self._recording:
            self._rec.observe(layer, r.ids, r.weights)
        return r

    def end_pass(self, n_tokens: int) -> None:
        if self._inner is not None:
            self._inner.end_pass(n_tokens)
        if self._recording:
            self._rec.end_pass(n_tokens)
        self._recording = False
        self.disarm()
