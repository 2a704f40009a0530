"""``GET /metrics``: Prometheus text (prometheus_client), with what llama-server's lacks.

Request counters and latency histograms are kept as requests end; the queue, the expert cache
(hit rate, hits/misses, bytes uploaded and the recent upload rate), the device bytes by kind and
the placement are read from the runner and the session when scraped.
"""

from __future__ import annotations

import math

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServerMetrics:
    def __init__(self, host):
        self.host = host
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("sharpi_requests", "HTTP requests answered", ["route", "status"], registry=r)
        self.prompt_tokens = Counter("sharpi_prompt_tokens", "Prompt tokens of answered requests", registry=r)
        self.completion_tokens = Counter("sharpi_completion_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram(
            "sharpi_time_to_first_token_seconds",
            "Prompt processing + first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "sharpi_request_duration_seconds",
            "Generation requests, queue to last token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        r.register(_EngineCollector(host))

    def observe(self, answer) -> None:
        """A finished generation (``protocol.Answer``)."""
        u = answer.usage()
        self.prompt_tokens.inc(u["prompt_tokens"])
        self.completion_tokens.inc(u["completion_tokens"])
        t = answer.timings()
        if "ttft_ms" in t:
            self.ttft.observe(t["ttft_ms"] / 1000)
        self.duration.observe(t["total_ms"] / 1000)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _finite(x: float) -> float:
    return x if math.isfinite(x) else 0.0


class _EngineCollector:
    """Scrape-time figures: the queue, the model, the expert cache, the device memory, the placement."""

    def __init__(self, host):
        self.host = host

    def describe(self):
        return []

    def collect(self):
        h, st = self.host, self.host.runner.stats
        yield GaugeMetricFamily("sharpi_model_ready", "1 once the model is loaded", value=float(h.state == "ready"))
        yield GaugeMetricFamily("sharpi_requests_running", "Generations running (0 or 1)", value=st.running)
        yield GaugeMetricFamily("sharpi_requests_waiting", "Generations queued for the model", value=st.waiting)
        yield GaugeMetricFamily("sharpi_queue_capacity", "Requests that may wait", value=h.runner.max_queue)
        yield CounterMetricFamily("sharpi_requests_rejected", "Refused with 429: queue full", value=st.rejected)
        yield CounterMetricFamily("sharpi_requests_cancelled", "Ended by a client disconnect", value=st.cancelled)
        if st.queue_s:
            yield GaugeMetricFamily(
                "sharpi_queue_wait_seconds_recent",
                "Mean wait for the model, last 256",
                value=float(np.mean(st.queue_s)),
            )
        s = h.session
        if s is None:
            return
        yield GaugeMetricFamily("sharpi_context_size", "Context size in tokens", value=s.n_ctx)
        yield GaugeMetricFamily("sharpi_context_used", "Positions of the KV cache in use", value=len(s.state.tokens))
        snap = s.stats()
        hits, misses = int(snap.hits.sum()), int(snap.misses.sum())
        yield CounterMetricFamily("sharpi_tokens_processed", "Tokens through the model", value=snap.tokens_total)
        yield CounterMetricFamily("sharpi_expert_cache_hits", "Expert routings served on the device", value=hits)
        yield CounterMetricFamily("sharpi_expert_cache_misses", "Expert routings computed on the CPU", value=misses)
        yield GaugeMetricFamily(
            "sharpi_expert_cache_hit_rate", "hits / (hits + misses); NaN without a device cache", value=snap.hit_rate
        )
        yield CounterMetricFamily(
            "sharpi_expert_upload_bytes", "Expert bytes copied host to device", value=int(snap.uploaded_bytes.sum())
        )
        rate = snap.step_upload_mb_s[np.isfinite(snap.step_upload_mb_s)]
        yield GaugeMetricFamily(
            "sharpi_expert_upload_gb_per_second",
            "Host to device expert upload rate over the recent forward passes",
            value=_finite(float(rate.mean()) / 1000) if rate.size else 0.0,
        )
        p = s.placement
        dev = GaugeMetricFamily("sharpi_device_bytes", "Device bytes of the placement, by kind", labels=["kind"])
        if p is not None:
            for kind, n in p.device.to_dict().items():
                dev.add_metric([kind], n)
        yield dev
        info = GaugeMetricFamily(
            "sharpi_placement_info",
            "The placement in force (labels); 1",
            labels=["device", "n_gpu_layers", "n_layer", "moe_mode", "kv_type", "expert_slots"],
        )
        if p is None:
            info.add_metric(["cpu", "0", str(s.args.n_layer), "cpu", str(s.kv_type), "0"], 1)
        else:
            info.add_metric(
                [
                    str(s.device),
                    str(p.n_gpu_layers),
                    str(p.n_layer),
                    p.moe_mode,
                    p.kv_type,
                    str(p.expert_slots_allocated),
                ],
                1,
            )
        yield info
