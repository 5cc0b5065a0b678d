"""The web console: overview, effects, one effect's story, retry/cancel/redrive.

    outbox ui [--host H] [--port P] [--token T]        # a process of its own
    app.mount("/outbox", create_console_app(engine))   # inside your Starlette/FastAPI app

Server-rendered HTML, one stylesheet and one small script, all served by the app
itself (no CDN, no build step). See docs/console.md.
"""

from outbox.console._app import create_console_app, trust_upstream
from outbox.console._mask import DEFAULT_RULES, MASKED, Mask

__all__ = ["DEFAULT_RULES", "MASKED", "Mask", "create_console_app", "trust_upstream"]
