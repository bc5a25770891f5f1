"""What the EPP and the Envoy in front of it agree on, beyond the ext_proc and access-log protos:
the gRPC health service Envoy checks, how long Envoy waits for each ext_proc answer, and the
dynamic metadata a gateway's filters set on a streamed answer for the EPP's access log.

The local gateway (``sim.envoy_config``) is configured from these; a production gateway must be
configured to match them.
"""

from __future__ import annotations

EXT_PROC_HEALTH_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
"""The gRPC health service an EPP reports SERVING for while it is ready to take ext_proc streams."""

MESSAGE_TIMEOUT_S = 5
"""How long Envoy waits for the EPP's answer to each ext_proc message (``message_timeout``)."""
MAX_MESSAGE_TIMEOUT_S = 120
"""The most the EPP may extend that wait to, with a ProcessingResponse carrying only
``override_message_timeout`` (Envoy honours one per message): what flow control needs to hold a
request for its band's TTL."""

SSE_DONE_METADATA = ("llm_epp", "sse_done")
"""Where the gateway marks a streamed answer whose ``data: [DONE]`` went to the client."""
FIRST_BODY_BYTE_METADATA = ("llm_epp", "first_body_byte_us")
"""Where the gateway notes when a streamed answer's first body chunk passed (wall clock, µs
since the epoch, as a string): its first token, for requests the EPP routed over ext_authz."""
SSE_EVENTS_METADATA = ("llm_epp", "sse_events")
"""Where the gateway counts a streamed answer's JSON events (``data: {``; ``[DONE]`` is not
one): its output tokens give or take the role and usage events, for requests routed over
ext_authz, which no stream of tells the EPP its bytes per token. Set when the answer ends."""

INFERENCE_API_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models")
"""The paths a gateway sends to the model servers through the EPP; any other is answered 404."""
