"""``token-load-producer``: the EPP's own in-flight token load per endpoint (see ``epp.load``).

Writes each candidate's load (``TOKEN_LOAD``) before scheduling, books the request on its
target after the pick (its uncached prompt from the prefix match, its expected output), and
follows it through first token, streamed tokens and finish (completed, upstream error or
client cancel alike). Bookings are keyed by ``CycleState.key``, unique per request, so two
in-flight requests that carry the same client request id never touch each other's.

With active-active replicas (``epp.sync``), ``peers`` holds the load the other EPP replicas
published (``epp.load.peer_totals``); the load it writes is its own plus theirs. A peer's release
reaches this replica one sync lag after the request ended, while a conversation's next turn,
routed here, may come at once. So when a prompt extends the whole prompt of a peer's booking on
an endpoint, and no other peer booking there ends the same way (a prefix shared by concurrent
requests, such as an RL step's prompt, does not count), that booking is taken as over: the
conversation moved on, and its turn's load leaves ``peers`` now rather than when its release
arrives. Prompts are matched by the prefix match's block hashes (the approximate prefix
producer's, when the config has one) against the tails the peers publish with their bookings;
one router alone releases its own bookings at once and never needs this.

==================  ============  =============================================================
parameter           default       meaning
==================  ============  =============================================================
outputRatio         1.5           expected output tokens per prompt token when the request gives
                                  no hint, no session estimate and no ``max_tokens``; the
                                  estimate is corrected as tokens arrive
maxOutputGuess      8192          cap on that estimate
learnSessionOutput  false         estimate a request's output from its session's earlier
                                  answers (``epp.load.output_length``)
sessionHeader       x-session-id  request header holding the session key
sessionHalfLife     2             turns after which a session's earlier answers weigh half
sessionCapacity     100000        sessions remembered (least recently answered forgotten first)
sessionTtlS         3600          seconds after its last answer that a session is forgotten
==================  ============  =============================================================

A request's expected output (``EXPECTED_OUTPUT``, which it books, and which the latency and
token-load scorers may read) is the client's ``x-expected-output-tokens`` hint, else (with
``learnSessionOutput``) its session's mean answer, else the pool's mean answer, else
``max_tokens``, else ``outputRatio`` times the prompt.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

from pydantic import Field

from epp.load.output_length import ExpectedOutput, OutputSource, SessionOutputLengths
from epp.load.peer_totals import PeerTotals
from epp.load.token_load import NO_LOAD, EndpointLoad, TokenLoadTracker, token_cost
from epp.scheduling.cycle_data import ENDPOINT_SPEED, EXPECTED_OUTPUT, PREFIX_MATCH, TOKEN_LOAD, PrefixMatch
from epp.scheduling.framework import (
    CycleState,
    DataProducer,
    Plugin,
    PluginContext,
    PluginParameters,
    PreRequest,
    RequestOutcome,
)
from epp.scheduling.observers import LifecycleObserver, RoutedRequest
from epp.scheduling.registry import register_default_producer
from epp.scheduling.types import EndpointState, LLMRequest, SchedulingResult


class TokenLoadParameters(PluginParameters):
    output_ratio: float = Field(default=1.5, gt=0, le=100, alias="outputRatio")
    max_output_guess: int = Field(default=8192, ge=1, alias="maxOutputGuess")
    learn_session_output: bool = Field(default=False, alias="learnSessionOutput")
    session_header: str = Field(default="x-session-id", min_length=1, alias="sessionHeader")
    session_half_life: float = Field(default=2.0, gt=0, le=1000, alias="sessionHalfLife")
    session_capacity: int = Field(default=100_000, ge=1, alias="sessionCapacity")
    session_ttl_s: float = Field(default=3600.0, gt=0, alias="sessionTtlS")


@register_default_producer
class TokenLoadProducer(DataProducer, PreRequest, LifecycleObserver):
    type_name = "token-load-producer"
    Parameters = TokenLoadParameters
    produces = (TOKEN_LOAD, EXPECTED_OUTPUT)
    reads_if_present = (PREFIX_MATCH,)
    params: TokenLoadParameters

    def __init__(self, name: str, params: TokenLoadParameters, context: PluginContext) -> None:
        super().__init__(name, params, context)
        self.tracker = TokenLoadTracker()
        self.peers = PeerTotals()
        """The load of peer EPP replicas (filled by ``epp.sync``; empty without it)."""
        self.sessions = (
            SessionOutputLengths(params.session_half_life, params.session_capacity, params.session_ttl_s)
            if params.learn_session_output
            else None
        )

    def load(self, endpoint: str) -> EndpointLoad:
        """The token load on ``endpoint``: this replica's bookings plus its peers'."""
        own = self.tracker.load(endpoint)
        return own + self.peers.load(endpoint) if self.peers.in_flight() else own

    def produce(self, request: LLMRequest, endpoints: Sequence[EndpointState], state: CycleState) -> None:
        match = state.get(PREFIX_MATCH)
        if match is not None and self.peers.has_tails():
            self.release_continued_peer_turns(request.input_tokens, match)
        state.put(TOKEN_LOAD, {e.name: self.load(e.name) for e in endpoints})
        state.put(EXPECTED_OUTPUT, self.expected_output(request))

    def release_continued_peer_turns(self, prompt_tokens: int, match: PrefixMatch) -> list[str]:
        """Release the peer bookings this prompt continues (see the module); returns their endpoints.

        On each endpoint the prefix match credits, the candidate is the booking whose prompt ends
        at the last matched block: the index holds a conversation's earlier prompts there, not
        the output that follows them, so the match stops where the previous turn's prompt did."""
        return [
            endpoint
            for endpoint, blocks in match.matched_blocks.items()
            if 0 < blocks <= len(match.block_hashes)
            and self.peers.continue_turn(endpoint, match.block_hashes[blocks - 1], prompt_tokens)
        ]

    def _session(self, request: LLMRequest) -> str | None:
        return request.headers.get(self.params.session_header)

    def expected_output(self, request: LLMRequest) -> ExpectedOutput:
        """The request's expected output tokens and where the figure comes from (see the module)."""
        if request.expected_output_tokens is not None:
            return ExpectedOutput(request.expected_output_tokens, OutputSource.HINT)
        if self.sessions is not None:
            learned = self.sessions.expected(self._session(request), self.context.clock())
            if learned is not None:
                return learned
        if request.max_tokens is not None:
            return ExpectedOutput(request.max_tokens, OutputSource.DEFAULT)
        guess = min(
            self.params.max_output_guess, max(1, round(self.params.output_ratio * request.input_tokens))
        )
        return ExpectedOutput(guess, OutputSource.DEFAULT)

    def pre_request(self, request: LLMRequest, result: SchedulingResult, state: CycleState) -> None:
        target = result.endpoint.name
        match = state.get(PREFIX_MATCH)
        cached = match.cached_tokens(target, request.input_tokens) if match else 0
        expected = state.get(EXPECTED_OUTPUT) or self.expected_output(request)
        self.tracker.admit(state.key, target, request.input_tokens, cached, expected.tokens)

    def on_first_token(self, routed: RoutedRequest, now: float) -> None:
        self.tracker.first_token(routed.state.key)

    def on_progress(self, routed: RoutedRequest, tokens: int, now: float) -> None:
        self.tracker.progress(routed.state.key, tokens)

    def on_finished(self, routed: RoutedRequest, outcome: RequestOutcome) -> None:
        self.tracker.finish(routed.state.key)
        if self.sessions is not None and outcome.completed and outcome.completion_tokens:
            self.sessions.observe(
                self._session(routed.request), outcome.completion_tokens, outcome.finished_at
            )


def token_costs(
    request: LLMRequest,
    endpoints: Sequence[EndpointState],
    state: CycleState,
    prefill_scale: float = 1.0,
    expected_output_weight: float = 0.0,
    unit_tokens: int = 1,
) -> list[float]:
    """Each candidate's Dynamo cost (``epp.load.token_load.token_cost``) of taking ``request``,
    in units of ``unit_tokens`` tokens (a KV block, say), from the token load and prefix match in
    ``state``, times the endpoint's measured slowness where ``ENDPOINT_SPEED`` has it: the work
    it adds, counted in time."""
    loads = state.get(TOKEN_LOAD) or {}
    slowness = state.get(ENDPOINT_SPEED) or {}
    match = state.get(PREFIX_MATCH)
    isl = request.input_tokens
    costs = []
    for e in endpoints:
        uncached = isl - (match.cached_tokens(e.name, isl) if match else 0)
        tokens = token_cost(loads.get(e.name, NO_LOAD), uncached, prefill_scale, expected_output_weight)
        costs.append(tokens / unit_tokens * slowness.get(e.name, 1.0))
    return costs


@runtime_checkable
class BooksTokenLoad(Protocol):
    """A plugin that books each routed request's tokens per endpoint (``tracker``), beside those
    peer replicas booked (``peers``, while replicas share load): the ``token-load-producer``."""

    tracker: TokenLoadTracker
    peers: PeerTotals


def find_token_load(plugins: Iterable[Plugin]) -> BooksTokenLoad | None:
    """The plugin among ``plugins`` that books token load, if there is one."""
    return next((p for p in plugins if isinstance(p, BooksTokenLoad)), None)
