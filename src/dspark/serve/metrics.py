"""Prometheus metrics of ``dspark serve``, named in the style of vLLM's (``vllm:`` -> ``dspark:``).

A custom collector reads ``LLMEngine.metrics`` (and the loop's queue) at every scrape (with the engine in
its own process: the copy that came with its last outputs), so the values
are always current and the engine keeps plain counters. Reading them from the HTTP thread while the
engine thread writes is safe under the GIL (ints and list copies); a scrape may see one round's
counters half-updated, which the next scrape corrects. The latency histograms (``Latency``) are
observed on the HTTP side as each request's outputs arrive there: what a client sees, queueing
included.
"""

from __future__ import annotations

from collections import Counter

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .engine_loop import EngineLoop

FINISH_REASONS = ("stop", "length", "abort", "error")

# vLLM's buckets (seconds), the inter-token ones with two more below 10 ms: a speculative round
# of a small model can be that fast
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class ServerCounters:
    """What only the HTTP side knows: finished requests by reason (as the client saw it, e.g. a stop
    string is ``"stop"``; ``"abort"``: the client went away), prompt tokens, refused requests."""

    def __init__(self):
        self.finished: Counter[str] = Counter()
        self.prompt_tokens = 0
        self.rejected = 0


class DSparkCollector:
    def __init__(self, loop: EngineLoop, counters: ServerCounters, model_name: str):
        self.loop, self.counters, self.model_name = loop, counters, model_name

    def collect(self):
        m, labels = self.loop.metrics, [self.model_name]

        def gauge(name, doc, value):
            family = GaugeMetricFamily(f"dspark:{name}", doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        def counter(name, doc, value):
            family = CounterMetricFamily(f"dspark:{name}", doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        yield gauge("num_requests_running", "Requests in the running batch.", m.running)
        yield gauge("num_requests_waiting", "Requests waiting for a batch row.", m.waiting + self.loop.pending)
        yield counter("generation_tokens", "Tokens generated.", m.generated_tokens)
        yield counter("prompt_tokens", "Prompt tokens of the requests accepted.", self.counters.prompt_tokens)
        yield counter("request_rejected", "Requests refused because the waiting queue was full.",
                      self.counters.rejected)
        success = CounterMetricFamily("dspark:request_success", "Finished requests by finish reason.",
                                      labels=["model_name", "finished_reason"])
        for reason in FINISH_REASONS:
            success.add_metric(labels + [reason], self.counters.finished[reason])
        yield success
        yield counter("engine_steps", "Engine steps (each: admissions and one round for every running request).", m.steps)
        yield counter("engine_step_seconds", "Seconds spent inside engine steps (busy fraction: its rate).", m.step_time)
        yield counter("engine_host_seconds", "Seconds of engine steps on the host: everything but waiting for the "
                                             "device's readout (scheduling, admission, launches, commits).", m.host_time)
        phases = CounterMetricFamily("dspark:engine_host_phase_seconds", "engine_host_seconds by phase: plan "
                                     "(scheduling, admission), launch (staging, graph launches), commit (the "
                                     "readout's tokens, retiring).", labels=["model_name", "phase"])
        for phase, seconds in m.host_phases.items():
            phases.add_metric(labels + [phase], seconds)
        yield phases
        yield counter("engine_host_overlapped_seconds", "Of engine_host_seconds: host work done while the device "
                                                        "still ran a step's draft pass (off the critical path).",
                      m.host_overlapped_time)
        yield counter("engine_prompt_tokens", "Prompt tokens run inside engine steps (chunked prefill).", m.prompt_tokens)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", m.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache (not run).", m.prefix_cache_hits)
        yield counter("num_preemptions", "Requests taken out of the batch when KV blocks ran out, to run again.",
                      m.preemptions)
        yield gauge("kv_cache_usage_perc", "Fraction of the KV blocks that requests hold (cached free blocks "
                                           "count as free).", m.kv_blocks_used / max(m.kv_blocks, 1))
        yield gauge("kv_cache_blocks", "KV blocks of the engine (target and draft K/V of kv_block_size positions "
                                       "each).", m.kv_blocks)
        yield counter("engine_plain_steps", "DSpark steps that did not draft the next round (the cost scheduler "
                                            "found no draft worth its cost).", m.plain_steps)
        yield counter("engine_held_rounds", "DSpark steps that verified every draft on the cost scheduler's held "
                                            "choice, without waiting for the draft pass's confidences.", m.held_rounds)
        yield counter("engine_graph_captures", "CUDA graphs captured, at start-up and while serving.", m.graph_captures)
        yield gauge("engine_device_memory_bytes", "Bytes of GPU memory the engine's tensors hold (torch's allocator; "
                                                  "0 on the CPU), after its last step.", m.device_memory)
        yield counter("spec_decode_num_drafts", "Speculative rounds (one per request per step).", m.rounds)
        yield counter("spec_decode_num_draft_tokens", "Draft tokens verified.", m.draft_tokens)
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.", m.accepted_tokens)
        per_pos = [("spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at each position.",
                    list(m.position_accepts)),
                   ("spec_decode_num_draft_tokens_per_pos",
                    "Draft tokens verified at each position with all earlier drafts accepted.",
                    list(m.position_trials))]
        for name, doc, values in per_pos:
            family = CounterMetricFamily(f"dspark:{name}", doc, labels=["model_name", "position"])
            for position, value in enumerate(values):
                family.add_metric(labels + [str(position)], value)
            yield family
        yield gauge("spec_decode_mean_accepted_length",
                    "Tokens committed per round (accepted drafts + the bonus token); 0 before the first round.",
                    m.mean_accepted_length)
        yield gauge("spec_decode_num_speculative_tokens", "Draft tokens proposed per round (block size - 1).",
                    m.num_drafts)


class Latency:
    """The request latency histograms of vLLM: time to first token (from arrival), the gaps between
    a request's outputs (one engine step each, so several tokens per gap with drafts accepted) and
    the end-to-end time of the requests that finished (stop or length)."""

    def __init__(self, reg: CollectorRegistry, model_name: str):
        def histogram(name, doc, buckets):
            return Histogram(f"dspark:{name}", doc, ["model_name"], registry=reg, buckets=buckets).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Seconds between two outputs of a request (one engine step each).", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds",
                             "End-to-end latency of the requests that finished (stop / length), in seconds.",
                             E2E_BUCKETS)


def registry(loop: EngineLoop, counters: ServerCounters, model_name: str) -> tuple[CollectorRegistry, Latency]:
    """A registry of this server's metrics alone (not the process-global one: one per app) and its
    latency histograms."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(DSparkCollector(loop, counters, model_name))
    return reg, Latency(reg, model_name)
