"""uvicorn's server, which on Ctrl-C or SIGTERM first marks the engine loop draining: a request that still reaches
it (on a kept-alive connection, or in the moment before the listening socket closes) gets a 503 with Retry-After,
while the requests in flight finish (uvicorn's graceful shutdown)."""

from __future__ import annotations

import uvicorn

from moetier.serve.engine_loop import EngineLoop


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, loop: EngineLoop) -> None:
        super().__init__(config)
        self.engine_loop = loop

    def handle_exit(self, sig, frame) -> None:
        self.engine_loop.draining = True
        super().handle_exit(sig, frame)
