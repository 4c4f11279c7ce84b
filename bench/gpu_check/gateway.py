"""The whole server in this process, for section (c)'s load."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from pathlib import Path


class RunningGateway:
    """The whole server (``server.app.Gateway``) on port 0, on its own thread and event loop."""

    def __init__(self, repository: Path) -> None:
        from server.app import Gateway, Settings

        settings = Settings(host="127.0.0.1", grpc_port=0, metrics_port=None,
                            model_repository=repository)
        self.gateway = Gateway(settings)
        self.loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="gateway", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self.gateway.start())
        except BaseException as exc:  # handed to start() below
            self._error = exc
            self._started.set()
            return
        self._started.set()
        self.loop.run_forever()

    def start(self, timeout_s: float) -> None:
        self.thread.start()
        if not self._started.wait(timeout_s):
            raise TimeoutError(f"the gateway did not start within {timeout_s:.0f} s")
        if self._error is not None:
            raise self._error

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gateway.grpc_port}"

    def stop(self) -> None:
        if self.loop.is_running():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(
                    self.gateway.stop(drain_timeout_s=5.0), self.loop).result(30)
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


