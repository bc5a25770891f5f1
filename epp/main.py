"""``llm-epp``: run the endpoint picker."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal

import uvloop
from pydantic import ValidationError

from epp.app import EppApp
from epp.datalayer.static_file import EndpointsFileError
from epp.scheduling.config import ConfigError
from epp.settings import EppSettings
from wire.auth import TokenFileError
from wire.heap import freeze_startup_heap


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def parse_args(argv: list[str] | None = None) -> tuple[EppSettings, str]:
    parser = argparse.ArgumentParser(
        prog="llm-epp", description="Envoy ext_proc endpoint picker for LLM fleets"
    )
    for name, field in EppSettings.model_fields.items():
        flag = _flag(name)
        kwargs: dict = {"help": field.description, "dest": name}
        if field.annotation == list[str]:
            kwargs["action"] = "append"
            kwargs["default"] = argparse.SUPPRESS
            parser.add_argument(flag, **kwargs)
            continue
        if field.annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        kwargs["default"] = argparse.SUPPRESS
        if field.is_required():
            kwargs["help"] = f"{field.description} (required)"
        else:
            kwargs["help"] = f"{field.description} (default: {field.default})"
        parser.add_argument(flag, **kwargs)
    parser.add_argument("--log-level", default="INFO")
    args = vars(parser.parse_args(argv))
    # Checked here rather than by argparse, whose message names the flag but not what it needs.
    for name, field in EppSettings.model_fields.items():
        if field.is_required() and name not in args:
            parser.error(f"{_flag(name)} is required: {field.description}")
    log_level = args.pop("log_level")
    for name, field in EppSettings.model_fields.items():
        if field.annotation == list[str] and name in args:
            args[name] = [u for value in args[name] for u in value.split(",") if u]
    try:
        return EppSettings.model_validate(args), log_level
    except ValidationError as exc:
        parser.error(str(exc))


async def serve(settings: EppSettings) -> None:
    app = EppApp(settings)
    await app.start()
    log = logging.getLogger(__name__)
    log.debug("froze %d start-up objects out of the garbage collector's walks", freeze_startup_heap())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    # Drain: NOT_SERVING first, streams still taken for the grace (a second signal cuts it
    # short), then in-flight streams get up to the drain time.
    stop.clear()
    log.info("draining: NOT_SERVING, taking new streams for %.1f s more", settings.shutdown_grace_s)
    await app.begin_drain()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), settings.shutdown_grace_s)
    log.info("shutting down: in-flight streams get up to %.1f s", settings.shutdown_drain_s)
    await app.stop(settings.shutdown_drain_s)


def main(argv: list[str] | None = None) -> None:
    settings, log_level = parse_args(argv)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        # uvloop: about a fifth less CPU per ext_proc stream than asyncio's own loop, and less
        # for the scraper's and predictor client's HTTP (``llm-epp-bench stack``).
        uvloop.run(serve(settings))
    except (ConfigError, EndpointsFileError, FileNotFoundError, TokenFileError) as exc:
        raise SystemExit(f"llm-epp: {exc}") from None


if __name__ == "__main__":
    main()
