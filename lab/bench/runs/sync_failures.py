"""``llm-epp-bench sync-failures``: what two active-active EPP replicas do when one dies, when
clients hang up, and when NATS goes away, measured once each through the live stack.

Every scenario runs two synced EPPs (``ray-kv-aware``) behind one Envoy, simulated engines with
the ``default`` profile, and a closed loop of streamed completions (each one a request record:
send time, status, whether it ended with ``[DONE]``, whether an error body was JSON):

* **kill-FailOpen / kill-FailClose**: SIGKILL one EPP under load. Reported: requests sent, ok and
  failed (status and error kind of each failure), the last time after the kill that Envoy still
  opened a connection or stream to the dead EPP, when Envoy marked it unhealthy, and when the
  survivor's remote token share (the dead EPP's bookings) reached 0, against the peer timeout.
* **cancellation soak**: streams spread over both EPPs, each hung up a few tokens in; every token
  load gauge of each EPP afterwards, and how long they took to reach 0.
* **NATS outage**: nats-server stopped for ``outage_s`` under load, then restarted on its port;
  failures before, during and after, and the time from the restart until both EPPs are connected
  again and have installed a peer snapshot (converged), and until every gauge is 0 once the load
  stops.

The pass/fail assertions of the same behaviour are in tests/integration/test_epp_replicas.py.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from epp.datalayer.metrics import TOKEN_LOAD_GAUGES
from epp.settings import EppSettings
from epp.sync.metrics import REMOTE_TOKEN_SHARE
from sim.envoy_admin import host_stats, is_healthy
from sim.measure.prometheus_samples import Samples, scrape, total
from sim.measure.report import machine, markdown_table, save_figure, write_results
from sim.nats_server import start_nats_server
from sim.stack import LocalStack, StackConfig, StackPorts

LOAD_GAUGES = (*TOKEN_LOAD_GAUGES, REMOTE_TOKEN_SHARE)
PEER_TIMEOUT_S = EppSettings.model_fields["sync_peer_timeout_s"].default
"""The stack starts its EPPs with the default peer (heartbeat) timeout."""


@dataclass
class SyncFailureSettings:
    clients: int = 4
    """Closed-loop clients, each streaming one completion after another."""
    max_tokens: int = 48
    before_s: float = 3.0
    """Load before the kill (after the dying EPP has served some requests)."""
    after_kill_s: float = 6.0
    """Load after the kill; longer than the peer timeout, so the expiry happens under load."""
    soak_streams: int = 40
    outage_s: float = 10.0
    after_outage_s: float = 3.0
    """Load after both EPPs converged again."""
    settle_timeout_s: float = 20.0
    sample_interval_s: float = 0.1


@dataclass
class Outcome:
    sent: float
    ended: float
    status: int
    """0: no reply."""
    kind: str
    """ok; json-error (a non-200 with an OpenAI-shaped JSON body); other-error (a non-200 with any
    other body); cut (a 200 stream that ended without ``[DONE]``); no-reply."""


def _kind(status: int, done: bool, body: str) -> str:
    if status == 0:
        return "no-reply"
    if status == 200:
        return "ok" if done else "cut"
    try:
        return "json-error" if "message" in json.loads(body)["error"] else "other-error"
    except (ValueError, KeyError, TypeError):
        return "other-error"


def stream_completion(
    client: httpx.Client, url: str, prompt: str, max_tokens: int, hang_up_after: int = 0
) -> Outcome:
    """One streamed completion; with ``hang_up_after``, the client closes it after that many lines."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    sent, status, done, lines = time.monotonic(), 0, False, []
    try:
        with client.stream("POST", url, json=body) as response:
            status = response.status_code
            for n, line in enumerate(response.iter_lines()):
                lines.append(line)
                done = done or line.strip() == "data: [DONE]"
                if hang_up_after and n + 1 >= hang_up_after:
                    return Outcome(sent, time.monotonic(), status, "ok" if status == 200 else "cut")
    except httpx.HTTPError:
        pass
    return Outcome(sent, time.monotonic(), status, _kind(status, done, "\n".join(lines)))


class ClosedLoop:
    """``clients`` threads streaming completions back to back until :meth:`stop`."""

    def __init__(self, url: str, settings: SyncFailureSettings) -> None:
        self.url, self.settings = url, settings
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,)) for i in range(settings.clients)]

    def _client(self, index: int) -> None:
        with httpx.Client(timeout=30) as client:
            n = 0
            while not self._stop.is_set():
                prompt = f"client {index} request {n}: " + "routers and caches " * 20
                self.outcomes.append(stream_completion(client, self.url, prompt, self.settings.max_tokens))
                n += 1

    def __enter__(self) -> ClosedLoop:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()


class Sampler:
    """Calls ``probe`` every ``interval_s`` from a thread; (time, value) of each call that answered."""

    def __init__(self, probe: Callable[[], dict[str, Any]], interval_s: float) -> None:
        self.probe, self.interval_s = probe, interval_s
        self.samples: list[tuple[float, dict[str, Any]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        while not self._stop.is_set():
            # A process that is down (or busy past the timeout) has no sample this round.
            with contextlib.suppress(httpx.HTTPError):
                self.samples.append((time.monotonic(), self.probe()))
            self._stop.wait(self.interval_s)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def first(self, after: float, condition: Callable[[dict[str, Any]], bool]) -> float | None:
        """Seconds from ``after`` to the first sample past it that meets ``condition``."""
        return next((round(t - after, 3) for t, s in self.samples if t >= after and condition(s)), None)


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Poll ``predicate`` until it holds; the seconds that took. Raises if it never does."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        try:
            if predicate():
                return round(time.monotonic() - start, 3)
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{what}: not within {timeout_s} s")


def _start(workdir: Path, failure_mode: str) -> LocalStack:
    config = StackConfig(
        replicas=2,
        ports=StackPorts.free(),
        workdir=workdir,
        epp_config="ray-kv-aware",
        epp_replicas=2,
        failure_mode=failure_mode,  # type: ignore[arg-type]
    )
    stack = LocalStack(config)
    stack.start()
    urls = stack.epp_metrics_urls
    wait_until(lambda: all(total(scrape(u), "llm_epp_sync_peers_alive") == 1 for u in urls), 30, "peers met")
    return stack


def gauges(samples: Samples) -> dict[str, float]:
    """Each token-load gauge, summed over endpoints."""
    return {name: round(total(samples, name), 6) for name in LOAD_GAUGES}


def _counts(outcomes: list[Outcome]) -> dict[str, Any]:
    failed = [o for o in outcomes if o.kind != "ok"]
    kinds: dict[str, int] = {}
    for o in failed:
        kinds[o.kind] = kinds.get(o.kind, 0) + 1
    return {
        "sent": len(outcomes),
        "ok": len(outcomes) - len(failed),
        "failed": len(failed),
        "failed_by_kind": kinds,
    }


def _timeline(outcomes: list[Outcome], origin: float) -> list[dict[str, Any]]:
    return [{"sent_s": round(o.sent - origin, 3), "ended_s": round(o.ended - origin, 3), "status": o.status,
             "kind": o.kind} for o in outcomes]  # fmt: skip


def kill_scenario(failure_mode: str, settings: SyncFailureSettings, workdir: Path) -> dict[str, Any]:
    stack = _start(workdir, failure_mode)
    try:
        admin = stack.config.ports.envoy_admin
        dead = f"127.0.0.1:{stack.epp_ports[1][0]}"
        doomed_url, survivor_url = stack.epp_metrics_urls[1], stack.epp_metrics_urls[0]
        wait_until(lambda: is_healthy(admin, "epp", dead), 30, "Envoy sees the doomed EPP healthy")

        def probe() -> dict[str, Any]:
            envoy = host_stats(admin, "epp", dead)
            survivor = scrape(survivor_url, timeout_s=2)
            return {
                "dead_attempts": sum(int(envoy.get(k, 0)) for k in ("cx_total", "rq_total")),
                "dead_healthy": envoy.get("health_flags") == "healthy",
                "remote_share": total(survivor, REMOTE_TOKEN_SHARE),
                "peers_alive": total(survivor, "llm_epp_sync_peers_alive"),
            }

        with (
            ClosedLoop(f"{stack.gateway_url}/v1/completions", settings) as load,
            Sampler(probe, settings.sample_interval_s) as sampler,
        ):
            served = "inference_objective_request_total"
            wait_until(lambda: total(scrape(doomed_url), served) >= 10, 60, "the doomed EPP served requests")
            time.sleep(settings.before_s)
            wait_until(
                lambda: total(scrape(survivor_url), REMOTE_TOKEN_SHARE) > 0, 10, "remote bookings on survivor"
            )
            killed_at = time.monotonic()
            stack.epps[1].stop(signal.SIGKILL)
            time.sleep(settings.after_kill_s)
        # From the last sample before the kill, so an attempt right after it counts too.
        after = [(t, s) for t, s in sampler.samples if t >= killed_at - settings.sample_interval_s * 2]
        changes = [
            t for (_, a), (t, b) in itertools.pairwise(after) if b["dead_attempts"] != a["dead_attempts"]
        ]
        outcomes = load.outcomes
        failed = [o for o in outcomes if o.kind != "ok"]
        return {
            "scenario": f"kill-{failure_mode}",
            "failure_mode": failure_mode,
            **_counts(outcomes),
            "sent_before_kill": sum(o.sent < killed_at for o in outcomes),
            "in_flight_at_kill": sum(o.sent < killed_at < o.ended for o in outcomes),
            "dead_attempts_before_kill": next(
                (s["dead_attempts"] for t, s in reversed(sampler.samples) if t < killed_at), None
            ),
            "failures": [
                {"sent_s": round(o.sent - killed_at, 3), "status": o.status, "kind": o.kind} for o in failed
            ],
            "last_failed_sent_s": round(max(o.sent for o in failed) - killed_at, 3) if failed else None,
            "last_attempt_to_dead_s": round(max(changes) - killed_at, 3) if changes else None,
            "envoy_unhealthy_s": sampler.first(killed_at, lambda s: not s["dead_healthy"]),
            "remote_share_zero_s": sampler.first(killed_at, lambda s: s["remote_share"] == 0),
            "peer_expired_s": sampler.first(killed_at, lambda s: s["peers_alive"] == 0),
            "peer_timeout_s": PEER_TIMEOUT_S,
            "timeline": _timeline(outcomes, killed_at),
            "share_series": [[round(t - killed_at, 3), s["remote_share"]] for t, s in sampler.samples],
        }
    finally:
        stack.stop()


def soak_scenario(stack: LocalStack, settings: SyncFailureSettings) -> dict[str, Any]:
    url = f"{stack.gateway_url}/v1/completions"
    before = [total(scrape(u), "inference_objective_request_total") for u in stack.epp_metrics_urls]

    def cancelled(i: int) -> Outcome:
        with httpx.Client(timeout=30) as client:
            return stream_completion(client, url, f"soak {i} " + "cache " * 50, 500, hang_up_after=2 + i % 5)

    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(cancelled, range(settings.soak_streams)))
    served = [
        total(scrape(u), "inference_objective_request_total") - b
        for u, b in zip(stack.epp_metrics_urls, before, strict=True)
    ]
    zero_s = wait_until(
        lambda: not any(v for u in stack.epp_metrics_urls for v in gauges(scrape(u)).values()),
        settings.settle_timeout_s,
        "token load back to 0 after the soak",
    )
    return {
        "scenario": "cancellation-soak",
        **_counts(outcomes),
        "served_per_epp": served,
        "gauges_zero_after_s": zero_s,
        "gauges_after": {f"epp-{i}": gauges(scrape(u)) for i, u in enumerate(stack.epp_metrics_urls)},
    }


def outage_scenario(stack: LocalStack, settings: SyncFailureSettings) -> dict[str, Any]:
    urls = stack.epp_metrics_urls
    installed = "llm_epp_sync_snapshots_total"

    def probe() -> dict[str, Any]:
        scraped = [scrape(u, timeout_s=2) for u in urls]
        return {
            "connected": [total(s, "llm_epp_sync_connected") for s in scraped],
            "remote_share": [total(s, REMOTE_TOKEN_SHARE) for s in scraped],
            "peers_alive": [total(s, "llm_epp_sync_peers_alive") for s in scraped],
            "snapshots": [total(s, installed, outcome="installed") for s in scraped],
        }

    assert stack.nats is not None
    with (
        ClosedLoop(f"{stack.gateway_url}/v1/completions", settings) as load,
        Sampler(probe, settings.sample_interval_s) as sampler,
    ):
        wait_until(lambda: all(total(scrape(u), REMOTE_TOKEN_SHARE) > 0 for u in urls), 30, "remote bookings")
        snapshots = [total(scrape(u), installed, outcome="installed") for u in urls]
        stopped_at = time.monotonic()
        stack.nats.stop()
        time.sleep(settings.outage_s)
        during = sampler.samples[-1][1] if sampler.samples else {}
        restarted_at = time.monotonic()
        stack.nats = start_nats_server(stack.workdir, stack.config.ports.nats, name="nats-again")
        converged_s = wait_until(
            lambda: all(
                total(s := scrape(u), "llm_epp_sync_connected") == 1
                and total(s, installed, outcome="installed") > b
                for u, b in zip(urls, snapshots, strict=True)
            ),
            settings.settle_timeout_s,
            "reconnected and resynced",
        )
        time.sleep(settings.after_outage_s)
    load_stopped = time.monotonic()
    zero_s = wait_until(
        lambda: not any(v for u in urls for v in gauges(scrape(u)).values()),
        settings.settle_timeout_s,
        "token load back to 0 after the outage",
    )
    outcomes = load.outcomes
    windows = {
        "before": [o for o in outcomes if o.sent < stopped_at],
        "during": [o for o in outcomes if stopped_at <= o.sent < restarted_at],
        "after": [o for o in outcomes if o.sent >= restarted_at],
    }
    return {
        "scenario": "nats-outage",
        **_counts(outcomes),
        "outage_s": settings.outage_s,
        "failed_by_window": {k: sum(o.kind != "ok" for o in v) for k, v in windows.items()},
        "sent_by_window": {k: len(v) for k, v in windows.items()},
        "disconnected_after_s": sampler.first(stopped_at, lambda s: not any(s["connected"])),
        "state_at_outage_end": during,
        "converged_after_restart_s": converged_s,
        "gauges_zero_after_load_s": zero_s,
        "load_stopped_after_restart_s": round(load_stopped - restarted_at, 3),
        "timeline": _timeline(outcomes, stopped_at),
        "restart_s": round(restarted_at - stopped_at, 3),
    }


KILL_COLUMNS = {
    "scenario": "scenario",
    "sent": "sent",
    "ok": "ok",
    "failed": "failed",
    "failed_by_kind": "failed by kind",
    "in_flight_at_kill": "in flight at kill",
    "dead_attempts_before_kill": "Envoy connections + streams to it before the kill",
    "last_failed_sent_s": "last failed one sent (s after kill)",
    "last_attempt_to_dead_s": "last Envoy attempt to the dead EPP (s)",
    "envoy_unhealthy_s": "Envoy marks it unhealthy (s)",
    "remote_share_zero_s": "survivor's remote share 0 (s)",
    "peer_timeout_s": "peer timeout (s)",
}
OUTAGE_COLUMNS = {
    "outage_s": "outage (s)",
    "sent_by_window": "sent before/during/after",
    "failed_by_window": "failed before/during/after",
    "disconnected_after_s": "disconnected after (s)",
    "converged_after_restart_s": "converged after restart (s)",
    "gauges_zero_after_load_s": "gauges 0 after the load stops (s)",
}


def _cell(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, dict):  # failed by kind: "cut 2"; by window: "0 / 1 / 0"
        labelled = not {"before", "during", "after"} & value.keys()
        return " / ".join(f"{k} {v}" if labelled else str(v) for k, v in value.items()) or "–"
    return str(value)


def _short(metric: str) -> str:
    return metric.removeprefix("llm_epp_endpoint_")


def _markdown(data: dict[str, Any]) -> str:
    kills = [[_cell(k[key]) for key in KILL_COLUMNS] for k in data["kills"]]
    soak, outage = data["soak"], data["outage"]
    soak_rows = [
        [
            name,
            served,
            soak["gauges_zero_after_s"],
            ", ".join(f"{_short(g)} {v:g}" for g, v in values.items()),
        ]
        for (name, values), served in zip(soak["gauges_after"].items(), soak["served_per_epp"], strict=True)
    ]
    kinds = {k: v for kill in data["kills"] for k, v in kill["failed_by_kind"].items()}
    return "\n\n".join(
        [
            "# Active-active EPP failures, live",
            f"Machine: {data['machine']['cpus']} CPUs, load average {data['load_average']} at the start, "
            f"{data['load_average_end']} at the end. Command: `{data['command']}`. Two EPPs (ray-kv-aware) "
            f"synced through nats-server, {data['settings']['clients']} clients streaming "
            f"{data['settings']['max_tokens']}-token completions (default simulated-engine profile).",
            "## One EPP killed (SIGKILL) under load",
            markdown_table(list(KILL_COLUMNS.values()), kills),
            f"Failure kinds seen: {', '.join(kinds) or 'none'}. json-error: a non-200 whose body is an "
            "OpenAI-shaped JSON error; other-error: a non-200 with any other body; cut: a 200 stream that "
            "ended without `[DONE]` (its headers were out before the EPP died, so no error body can follow); "
            "no-reply: no response. Times are from the kill, sampled every "
            f"{data['settings']['sample_interval_s']} s; 'none': no attempt after the kill.",
            f"## Cancellation soak over both EPPs ({soak['sent']} streams, each hung up a few tokens in)",
            markdown_table(
                ["EPP", "served", "every gauge 0 after (s)", "gauges after (summed over endpoints)"],
                soak_rows,
            ),
            "## NATS stopped under load",
            markdown_table(list(OUTAGE_COLUMNS.values()), [[_cell(outage[k]) for k in OUTAGE_COLUMNS]]),
            "Converged: both EPPs connected again and each installed a snapshot from its peer.",
        ]
    )


def _outcome_bars(axis: Any, timeline: list[dict[str, Any]], title: str, marks: dict[str, float]) -> None:
    sent = np.array([o["sent_s"] for o in timeline])
    ok = np.array([o["kind"] == "ok" for o in timeline])
    bins = np.arange(np.floor(sent.min()), np.ceil(sent.max()) + 1, 1.0)
    axis.hist(
        [sent[ok], sent[~ok]], bins=bins, stacked=True, color=["tab:green", "tab:red"], label=["ok", "failed"]
    )
    for label, at in marks.items():
        axis.axvline(at, color="black", linestyle="--", linewidth=1)
        axis.text(at, 0.03, f" {label}", transform=axis.get_xaxis_transform(), rotation=90, fontsize=8,
                  ha="right", va="bottom", color="white")  # fmt: skip
    axis.set(title=title, xlabel="request sent (s from the event)", ylabel="requests sent per second")
    axis.legend(fontsize=8)


def _plot(data: dict[str, Any], out_dir: Path) -> str:
    figure, axes = plt.subplots(1, 3, figsize=(15, 4))
    for axis, kill in zip(axes, data["kills"], strict=False):
        marks = {"kill": 0.0}
        if kill["remote_share_zero_s"] is not None:
            marks["survivor drops its bookings"] = kill["remote_share_zero_s"]
        _outcome_bars(axis, kill["timeline"], kill["scenario"], marks)
    outage = data["outage"]
    _outcome_bars(axes[2], outage["timeline"], "NATS outage", {
        "NATS stopped": 0.0, "restarted": outage["restart_s"],
        "converged": outage["restart_s"] + outage["converged_after_restart_s"]})  # fmt: skip
    return save_figure(figure, out_dir, "sync_failures.png")


def run(out_dir: Path, settings: SyncFailureSettings | None = None) -> dict[str, Any]:
    settings = settings or SyncFailureSettings()
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="llm-epp-sync-failures-") as tmp:
        work = Path(tmp)
        kills = []
        for mode in ("FailOpen", "FailClose"):
            (work / mode).mkdir()
            kills.append(kill_scenario(mode, settings, work / mode))
        (work / "soak").mkdir()
        stack = _start(work / "soak", "FailClose")
        try:
            soak = soak_scenario(stack, settings)
            outage = outage_scenario(stack, settings)
        finally:
            stack.stop()
    data = {
        "machine": machine(),
        "command": "nice -n 10 llm-epp-bench sync-failures",
        "load_average": [round(v, 2) for v in load_start],
        "load_average_end": [round(v, 2) for v in os.getloadavg()],
        "settings": asdict(settings),
        "kills": kills,
        "soak": soak,
        "outage": outage,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    data["plot"] = _plot(data, out_dir)
    write_results(out_dir, "sync_failures", data, _markdown(data))
    return data
