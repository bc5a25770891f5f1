"""The ``flowControl`` section of the EndpointPickerConfig (decoded strictly, like the rest)::

    featureGates: [flowControl]          # or just give the section
    plugins:
    - type: queue-kv-saturation-detector
      parameters: {queueDepthThreshold: 5}
    - type: least-attained-service-fairness
    flowControl:
      saturationDetectors: [queue-kv-saturation-detector]
      fairnessPolicy: least-attained-service-fairness
      orderingPolicy: fcfs-ordering
      maxQueuedRequests: 5000
      defaultBand: {maxRequests: 1000, ttlSeconds: 4}
      bands:
      - {priority: -1, maxRequests: 200, ttlSeconds: 5}

Policies and detectors are plugins: a reference names a plugin listed under ``plugins`` or, if
none has that name, a plugin type created with its default parameters.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

FEATURE_GATE = "flowControl"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class BandLimitsSpec(_Strict):
    max_requests: int = Field(default=1000, ge=1, alias="maxRequests")
    ttl_seconds: float = Field(default=4.0, gt=0, alias="ttlSeconds")
    """Up to the gateway's ext_proc ``max_message_timeout`` less its ``message_timeout`` (120 s
    and 5 s in the shipped Envoy config): while it holds a request the EPP extends Envoy's wait
    for its answer by the TTL and one ``message_timeout``, as far as ``max_message_timeout``
    allows; a request held longer is failed by the gateway (504) before flow control answers it 429."""


class BandSpec(BandLimitsSpec):
    priority: int


class FlowControlSpec(_Strict):
    saturation_detectors: list[str] = Field(
        default_factory=lambda: ["queue-kv-saturation-detector", "token-load-saturation-detector"],
        min_length=1,
        alias="saturationDetectors",
    )
    fairness_policy: str = Field(default="round-robin-fairness", alias="fairnessPolicy")
    ordering_policy: str = Field(default="fcfs-ordering", alias="orderingPolicy")
    max_queued_requests: int = Field(default=5000, ge=1, alias="maxQueuedRequests")
    retry_after_seconds: int = Field(default=1, ge=0, alias="retryAfterSeconds")
    default_output_tokens: int = Field(default=512, ge=1, alias="defaultOutputTokens")
    """Output tokens booked for a request without ``max_tokens`` (and at most, with it)."""
    poll_interval_ms: float = Field(default=5.0, gt=0, alias="pollIntervalMs")
    """How often the live dispatcher re-checks saturation while requests wait (scrapes and
    predictions change without telling it); arrivals, finishes and first tokens, this replica's
    and (with replica sync) its peers', wake it at once."""
    default_band: BandLimitsSpec = Field(default_factory=BandLimitsSpec, alias="defaultBand")
    bands: list[BandSpec] = Field(default_factory=list)
