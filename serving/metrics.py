"""Prometheus metrics through Ray (``ray.util.metrics``), exported by each node's metrics agent.

Names as Prometheus shows them (Ray adds the ``ray_`` prefix): ``ray_eyas_requests_total`` {model, route, status},
``ray_eyas_generated_tokens_total``, ``ray_eyas_accepted_tokens_total`` {position: 1..K, drafted tokens accepted
at that depth}, ``ray_eyas_tau`` (histogram: tokens per target forward, per request), ``ray_eyas_ttft_seconds``,
``ray_eyas_latency_seconds`` and the gauge ``ray_eyas_batch_size`` (sequences in the replica's last round). A hybrid's
requests add ``ray_eyas_proposer_offered_total`` and ``ray_eyas_proposer_accepted_total`` {proposer, position}:
cycles where the proposer had a judged node at that depth, and where the accepted one was its (their ratio: its
acceptance per depth).
"""
from __future__ import annotations

from ray.util.metrics import Counter, Gauge, Histogram

LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
TAU_BUCKETS = [1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0]


class ServingMetrics:
    def __init__(self, model: str) -> None:
        self.tags = {"model": model}
        self.requests = Counter("eyas_requests", "HTTP requests by route and status",
                                tag_keys=("model", "route", "status"))
        self.generated = Counter("eyas_generated_tokens", "Generated (completion) tokens", tag_keys=("model",))
        self.prompt_tokens = Counter("eyas_prompt_tokens", "Prompt tokens of requests that started generating",
                                     tag_keys=("model",))
        self.cached_prompt_tokens = Counter("eyas_cached_prompt_tokens", "Prompt tokens the prefix cache supplied "
                                            "instead of the prefill", tag_keys=("model",))
        self.accepted = Counter("eyas_accepted_tokens", "Drafted tokens accepted, by depth in the draft tree",
                                tag_keys=("model", "position"))
        self.tau = Histogram("eyas_tau", "Per request: mean tokens committed per target forward (accepted + 1)",
                             boundaries=TAU_BUCKETS, tag_keys=("model",))
        self.ttft = Histogram("eyas_ttft_seconds", "Time to first token", boundaries=LATENCY_BUCKETS,
                              tag_keys=("model",))
        self.latency = Histogram("eyas_latency_seconds", "Request latency, arrival to last token",
                                 boundaries=LATENCY_BUCKETS, tag_keys=("model",))
        self.proposer_offered = Counter("eyas_proposer_offered", "Hybrid cycles where a proposer had a judged node, "
                                        "by depth", tag_keys=("model", "proposer", "position"))
        self.proposer_accepted = Counter("eyas_proposer_accepted", "Hybrid cycles where the accepted node at a "
                                         "depth was the proposer's", tag_keys=("model", "proposer", "position"))
        self.batch_size = Gauge("eyas_batch_size", "Sequences decoded together in the last round",
                                tag_keys=("model",))

    def request(self, route: str, status: int) -> None:
        self.requests.inc(1, tags={**self.tags, "route": route, "status": str(status)})

    def finished(self, completion_tokens: int, accepted_per_position: list[int], tau: float | None,
                 latency_s: float, proposer_offered: dict[str, list[int]] | None = None,
                 proposer_accepted: dict[str, list[int]] | None = None) -> None:
        if completion_tokens:
            self.generated.inc(completion_tokens, tags=self.tags)
        for depth, count in enumerate(accepted_per_position, start=1):
            if count:
                self.accepted.inc(count, tags={**self.tags, "position": str(depth)})
        for counter, counts in ((self.proposer_offered, proposer_offered or {}),
                                (self.proposer_accepted, proposer_accepted or {})):
            for name, per_depth in counts.items():
                for depth, count in enumerate(per_depth, start=1):
                    if count:
                        counter.inc(count, tags={**self.tags, "proposer": name, "position": str(depth)})
        if tau is not None:
            self.tau.observe(tau, tags=self.tags)
        self.latency.observe(latency_s, tags=self.tags)

    def prompt(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens, tags=self.tags)
        if cached_tokens:
            self.cached_prompt_tokens.inc(cached_tokens, tags=self.tags)

    def first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s, tags=self.tags)

    def batch(self, size: int) -> None:
        self.batch_size.set(size, tags=self.tags)
