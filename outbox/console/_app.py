"""The console's Starlette app: routes, access checks, input parsing, error pages.

Handlers are synchronous (SQLAlchemy Core on the caller's engine) and run on
Starlette's thread pool. Every page reads through one connection with a local
statement timeout, so a pathological filter costs at most `statement_timeout_ms` and
answers 503 instead of tying up the database. Bad input is a 4xx page, never a 500.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from outbox._schema import EffectStatus
from outbox.console import _security as sec
from outbox.console import _views as views
from outbox.console._html import Markup
from outbox.console._mask import Mask
from outbox.sql import console as cq
from outbox.sql.console import EffectFilter

Auth = Callable[[Request], "str | Awaitable[str | None] | None"]

STATIC = Path(__file__).parent / "static"
MAX_TEXT = 255
MAX_BODY = 64 * 1024
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)?\s*$")
_UNITS = {None: 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_MAX_ID = 2**63 - 1
_UNSET: Any = object()


class Problem(Exception):
    """An answer other than the page: status, a title and one sentence."""

    def __init__(self, status: int, title: str, detail: str = "") -> None:
        super().__init__(title)
        self.status, self.title, self.detail = status, title, detail


@dataclass
class Console:
    """Everything a handler needs; one per app."""

    engine: Engine
    keys: sec.Keys
    mask: Mask
    auth: Auth | None
    trace_url: str | None
    read_only: bool
    page_size: int = 50
    bulk_cap: int = 10_000
    statement_timeout_ms: int = 5000
    origin_timeout_ms: int = 2000
    exact_counts_below: int = 200_000
    _bytewise: bool | None = field(default=None, repr=False)

    @property
    def token(self) -> str | None:
        return self.keys.token

    def bytewise(self, conn: Connection) -> bool:
        if self._bytewise is None:
            self._bytewise = cq.effect_keys_sort_bytewise(conn)
        return self._bytewise

    def reader(self) -> Connection:
        conn = self.engine.connect()
        cq.configure_console_transaction(conn, self.statement_timeout_ms)
        return conn


# --- input --------------------------------------------------------------------------

def parse_duration(value: str, what: str) -> float:
    match = _DURATION.match(value)
    if not match:
        raise Problem(400, f"Bad {what}", f"{value[:40]!r} is not a duration (90s, 15m, 24h, 7d).")
    seconds = float(match.group(1)) * _UNITS[match.group(2)]
    if not math.isfinite(seconds) or seconds > 3650 * 86400:
        raise Problem(400, f"Bad {what}", "at most 3650 days")
    return seconds


def parse_id(value: str | None, what: str = "effect id") -> int:
    if value is None or not value.isascii() or not value.isdigit() or len(value) > 19:
        raise Problem(400, f"Bad {what}", f"{(value or '')[:40]!r} is not a positive integer.")
    number = int(value)
    if number > _MAX_ID:
        raise Problem(400, f"Bad {what}", "too large")
    return number


def _text(value: str | None, what: str) -> str | None:
    if value is None:
        return None
    value = value.strip()
    if not value:
        return None
    if len(value) > MAX_TEXT or "\x00" in value or not value.isprintable():
        raise Problem(400, f"Bad {what}", f"at most {MAX_TEXT} printable characters")
    return value


def parse_filter(params: Mapping[str, list[str]]) -> EffectFilter:
    """Query-string (or form) filters; anything unknown or malformed is a 400."""
    statuses: list[str] = []
    for value in params.get("status", []):
        if value == "":
            continue
        if value not in {s.value for s in EffectStatus}:
            raise Problem(400, "Bad status", f"{value[:40]!r} is not an effect status.")
        if value not in statuses:
            statuses.append(value)

    def one(name: str, what: str) -> str | None:
        values = params.get(name, [])
        if len(values) > 1:
            raise Problem(400, f"Bad {what}", "given twice")
        return _text(values[0], what) if values else None

    older = one("older", "age")
    newer = one("newer", "age")
    return EffectFilter(
        statuses=tuple(statuses), kind=one("kind", "kind"), queue=one("queue", "queue"),
        ordering_key=one("ordering_key", "ordering key"),
        key_prefix=one("key", "effect key prefix"),
        older_than=parse_duration(older, "age") if older else None,
        newer_than=parse_duration(newer, "age") if newer else None)


def filter_query(f: EffectFilter, raw: Mapping[str, list[str]] | None = None
                 ) -> list[tuple[str, str]]:
    """The filter as query-string pairs (durations as the user typed them)."""
    raw = raw or {}
    pairs: list[tuple[str, str]] = [("status", s) for s in f.statuses]
    for name, value in (("kind", f.kind), ("queue", f.queue),
                        ("ordering_key", f.ordering_key), ("key", f.key_prefix)):
        if value:
            pairs.append((name, value))
    for name, seconds in (("older", f.older_than), ("newer", f.newer_than)):
        if seconds is not None:
            typed = (raw.get(name) or [""])[0].strip()
            pairs.append((name, typed or f"{seconds:g}s"))
    return pairs


async def read_form(request: Request) -> dict[str, list[str]]:
    """An urlencoded POST body (no multipart: the console's forms need none)."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/x-www-form-urlencoded":
        return {}  # no form, so no CSRF field: refused as such (403)
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > MAX_BODY):
        raise Problem(413, "Form too large")
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY:
            raise Problem(413, "Form too large")
    try:
        return parse_qs(body.decode("utf-8"), keep_blank_values=True, max_num_fields=200)
    except (UnicodeDecodeError, ValueError):
        raise Problem(400, "Bad form") from None


def query_params(request: Request) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for key, value in request.query_params.multi_items():
        out.setdefault(key, []).append(value)
    return out


def first(params: Mapping[str, list[str]], name: str) -> str | None:
    values = params.get(name)
    return values[0] if values else None


# --- access ---------------------------------------------------------------------------

def _upstream_user(request: Request) -> str | None:
    user = request.scope.get("user")
    if user is not None and getattr(user, "is_authenticated", False):
        return str(getattr(user, "display_name", "") or "user")
    return None


def trust_upstream(request: Request) -> str:
    """`auth=` for a console mounted behind the application's own authentication:
    admits every request that reached it, named by the ASGI `user` if there is one."""
    return _upstream_user(request) or "upstream"


async def check_access(console: Console, request: Request) -> str:
    """The operator's name, or a Problem (401/403) / a redirect to the login form."""
    client = request.client.host if request.client else "?"
    if console.auth is not None:
        who = console.auth(request)
        if inspect.isawaitable(who):
            who = await who
        if not who:
            raise Problem(403, "Forbidden",
                          "Your application's authorization refused this request.")
        return str(who)
    if console.token is not None:
        if console.keys.authenticated(request):
            return f"token@{client}"
        raise Problem(401, "Log in", "This console needs its token.")
    if not sec.client_is_loopback(request):
        raise Problem(403, "Forbidden",
                      "Without a token the console answers loopback clients only.")
    if not sec.host_header_is_loopback(request):
        raise Problem(403, "Forbidden",
                      "Without a token the console answers only to a loopback host name.")
    return _upstream_user(request) or f"local@{client}"


def security_headers(response: Response) -> Response:
    response.headers["content-security-policy"] = (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:;"
        " connect-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'")
    response.headers["x-frame-options"] = "DENY"
    response.headers["x-content-type-options"] = "nosniff"
    response.headers["referrer-policy"] = "same-origin"
    response.headers["cache-control"] = "no-store"
    return response


Handler = Callable[[Console, Request, str], Response]


def _problem_response(console: Console, request: Request, problem: Problem) -> Response:
    if problem.status == 401 and request.method == "GET" and not _is_live(request):
        login = views.url(request, "login") + "?" + urlencode({"next": _here(request)})
        return security_headers(RedirectResponse(login, status_code=303))
    page = views.problem_page(console, request, problem.status, problem.title, problem.detail)
    if problem.status == 401:
        page.headers["www-authenticate"] = 'Bearer realm="outbox console"'
    return security_headers(page)


def _is_live(request: Request) -> bool:
    return request.url.path.endswith("/live")


def _here(request: Request) -> str:
    path: str = request.scope.get("path", "")  # includes root_path (ASGI spec)
    if request.url.query:
        path += "?" + request.url.query
    return path


def endpoint(handler: Handler, *, public: bool = False) -> Callable[[Request], Awaitable[Response]]:
    """Wrap a synchronous handler: access check, thread pool, errors as pages."""

    async def run(request: Request) -> Response:
        console: Console = request.app.state.console
        try:
            actor = "anonymous" if public else await check_access(console, request)
            if request.method == "POST":
                form = await read_form(request)
                if not console.keys.csrf_ok(request, first(form, "csrf")):
                    raise Problem(403, "Forbidden", "The form's CSRF token is missing or wrong: "
                                  "reload the page and try again.")
                request.state.form = form
            response = await run_in_threadpool(handler, console, request, actor)
        except Problem as problem:
            response = _problem_response(console, request, problem)
        except DBAPIError as exc:
            sqlstate = getattr(exc.orig, "sqlstate", None)
            if sqlstate == "57014":  # query_canceled: our statement timeout
                response = _problem_response(console, request, Problem(
                    503, "Too slow", "The query ran past the console's time limit: "
                    "narrow it (a status, a queue, a key prefix)."))
            elif sqlstate and sqlstate.startswith("22"):  # data exception: bad input
                response = _problem_response(console, request, Problem(400, "Bad input"))
            else:
                response = _problem_response(console, request, Problem(
                    503, "Database unavailable", str(exc.orig or exc).splitlines()[0][:200]))
        except SQLAlchemyError as exc:
            response = _problem_response(console, request, Problem(
                503, "Database unavailable", str(exc).splitlines()[0][:200]))
        new_csrf = getattr(request.state, "new_csrf", None)
        if isinstance(new_csrf, str):
            sec.set_cookie(request, response, sec.CSRF_COOKIE, new_csrf)
        return security_headers(response)

    return run


# --- handlers ---------------------------------------------------------------------------

def overview(console: Console, request: Request, actor: str) -> Response:
    return views.page(console, request, "Overview", views.overview_shell(
        console, request, views.overview_live(console, request)), active="overview")


def overview_live(console: Console, request: Request, actor: str) -> Response:
    return HTMLResponse(views.overview_live(console, request))


def effects_list(console: Console, request: Request, actor: str) -> Response:
    params = query_params(request)
    f = parse_filter(params)
    before = first(params, "before")
    after = first(params, "after")
    if before is not None and after is not None:
        raise Problem(400, "Bad page", "give before or after, not both")
    before_id = parse_id(before, "cursor") if before is not None else None
    after_id = parse_id(after, "cursor") if after is not None else None
    limit = console.page_size
    with console.reader() as conn:
        rows = cq.list_effects(conn, f, limit=limit + 1, before=before_id, after=after_id,
                               bytewise_keys=console.bytewise(conn))
        now = cq.database_now(conn).now
    if after_id is not None:
        has_newer = len(rows) > limit
        rows = rows[1:] if has_newer else rows
        has_older = True
    else:
        has_older = len(rows) > limit
        rows = rows[:limit]
        has_newer = before_id is not None
    body = views.effects_page(console, request, f, params, rows, now,
                              has_newer=has_newer, has_older=has_older)
    return views.page(console, request, "Effects", body, active="effects")


def _load_effect(conn: Connection, request: Request) -> Any:
    effect_id = parse_id(request.path_params.get("effect_id"))
    row = cq.get_effect_by_id(conn, effect_id)
    if row is None:
        raise Problem(404, "No such effect", f"There is no effect #{effect_id}.")
    return row


def effect_page(console: Console, request: Request, actor: str) -> Response:
    from outbox.sql import effects as fx

    with console.reader() as conn:
        row = _load_effect(conn, request)
        attempts = fx.attempts_of(conn, row.id)
        actions = cq.actions_on_effect(conn, row.id)
        now = cq.database_now(conn).now
    notice = first(query_params(request), "notice")
    body = views.effect_page(console, request, row, attempts, actions, now, notice)
    return views.page(console, request, f"Effect #{row.id}", body, active="effects")


def effect_live(console: Console, request: Request, actor: str) -> Response:
    from outbox.sql import effects as fx

    with console.reader() as conn:
        row = _load_effect(conn, request)
        attempts = fx.attempts_of(conn, row.id)
        now = cq.database_now(conn).now
    return HTMLResponse(views.effect_live(console, request, row, attempts, now))


def effect_origin(console: Console, request: Request, actor: str) -> Response:
    with console.reader() as conn:
        row = _load_effect(conn, request)
        cq.set_local_statement_timeout(conn, console.origin_timeout_ms)
        candidates = cq.keys_written_at(conn, row.created_at)
    body = views.origin_page(console, request, row, candidates)
    return views.page(console, request, f"Effect #{row.id}: origin", body, active="effects")


def _confirm_or_do(console: Console, request: Request, actor: str, action: str) -> Response:
    from outbox.sql import effects as fx

    if console.read_only:
        raise Problem(403, "Read-only console", "Actions are disabled here.")
    if request.method == "GET":
        with console.reader() as conn:
            row = _load_effect(conn, request)
            now = cq.database_now(conn).now
        return views.page(console, request, f"{action.title()} effect #{row.id}",
                          views.confirm_effect_action(console, request, row, action, now),
                          active="effects")
    # The change and its audit row commit together; the statements are the CLI's,
    # fenced by status, so a row that moved since the confirmation page is left alone.
    with console.engine.begin() as conn:
        cq.configure_console_transaction(conn, console.statement_timeout_ms)
        row = _load_effect(conn, request)
        changed = (fx.requeue(conn, [row.id]) if action == "retry"
                   else fx.cancel(conn, [row.id]))
        outcome = "done" if changed else "refused"
        cq.record_action(conn, actor=actor, action=action, effect_ids=changed,
                         request=json.dumps({"ids": [row.id], "status_seen": row.status}),
                         outcome=outcome)
    if not changed:
        why = ("only failed, parked (needs review) or cancelled effects can be retried"
               if action == "retry" else
               "an in-flight effect may already be applied and a delivered one was; "
               "only pending, failed or parked effects can be cancelled")
        raise Problem(409, f"{action.title()} refused",
                      f"Effect #{row.id} is {row.status.replace('_', ' ')}: {why}. "
                      "The refusal is in the audit log.")
    target = views.url(request, "effect", effect_id=str(row.id))
    done = "retried" if action == "retry" else "cancelled"
    return RedirectResponse(f"{target}?notice={done}", status_code=303)


def effect_retry(console: Console, request: Request, actor: str) -> Response:
    return _confirm_or_do(console, request, actor, "retry")


def effect_cancel(console: Console, request: Request, actor: str) -> Response:
    return _confirm_or_do(console, request, actor, "cancel")


def redrive(console: Console, request: Request, actor: str) -> Response:
    if console.read_only:
        raise Problem(403, "Read-only console", "Actions are disabled here.")
    if request.method == "GET":
        params = query_params(request)
        f = parse_filter(params)
        with console.reader() as conn:
            n, max_id = cq.count_redrivable(conn, f, cap=console.bulk_cap,
                                            bytewise_keys=console.bytewise(conn))
        body = views.confirm_redrive(console, request, f, params, n, max_id)
        return views.page(console, request, "Redrive dead letters", body, active="effects")
    form: dict[str, list[str]] = request.state.form
    f = parse_filter(form)
    max_id = parse_id(first(form, "max_id"), "max id")
    limit = parse_id(first(form, "limit"), "limit")
    if not 1 <= limit <= console.bulk_cap:
        raise Problem(400, "Bad limit", f"between 1 and {console.bulk_cap}")
    with console.engine.begin() as conn:
        cq.configure_console_transaction(conn, console.statement_timeout_ms * 6)
        changed = cq.redrive_dead_letters(conn, f, max_id=max_id, limit=limit,
                                          bytewise_keys=console.bytewise(conn))
        request_doc = {"filter": dict(filter_query(f, form)), "statuses": ["failed"],
                       "max_id": max_id, "limit": limit}
        action_id = cq.record_action(conn, actor=actor, action="redrive", effect_ids=changed,
                                     request=json.dumps(request_doc),
                                     outcome="done" if changed else "refused")
    target = views.url(request, "audit")
    return RedirectResponse(f"{target}?highlight={action_id}", status_code=303)


def audit(console: Console, request: Request, actor: str) -> Response:
    params = query_params(request)
    before = first(params, "before")
    before_id = parse_id(before, "cursor") if before is not None else None
    highlight = first(params, "highlight")
    highlight_id = parse_id(highlight, "action id") if highlight is not None else None
    with console.reader() as conn:
        rows = cq.recent_actions(conn, console.page_size + 1, before_id)
        now = cq.database_now(conn).now
    body = views.audit_page(console, request, rows[:console.page_size], now,
                            more=len(rows) > console.page_size, highlight=highlight_id)
    return views.page(console, request, "Audit", body, active="audit")


def login(console: Console, request: Request, actor: str) -> Response:
    if console.token is None:
        return RedirectResponse(views.url(request, "overview"), status_code=303)
    if request.method == "GET":
        nxt = first(query_params(request), "next") or ""
        return views.login_page(console, request, nxt)
    form: dict[str, list[str]] = request.state.form
    nxt = first(form, "next") or ""
    if not console.keys.token_matches(first(form, "token") or ""):
        return views.login_page(console, request, nxt, error=True)
    root = (request.scope.get("root_path") or "").rstrip("/") + "/"
    target = nxt if nxt.startswith(root) and not nxt.startswith("//") and "\\" not in nxt \
        else views.url(request, "overview")
    response = RedirectResponse(target, status_code=303)
    sec.set_cookie(request, response, sec.SESSION_COOKIE, console.keys.new_session(),
                   max_age=sec.SESSION_SECONDS)
    return response


def logout(console: Console, request: Request, actor: str) -> Response:
    response = RedirectResponse(views.url(request, "login"), status_code=303)
    response.delete_cookie(sec.SESSION_COOKIE, path=sec.cookie_path(request))
    return response


async def _not_found(request: Request, exc: Exception) -> Response:
    console: Console = request.app.state.console
    status = exc.status_code if isinstance(exc, HTTPException) else 404
    title = "Not found" if status == 404 else "Not allowed" if status == 405 else "Error"
    return security_headers(views.problem_page(console, request, status, title, ""))


def create_console_app(engine: Engine, *, token: str | None = None, mask: Any = _UNSET,
                       auth: Auth | None = None, trace_url: str | None = _UNSET,
                       secret: str | bytes | None = None, read_only: bool = False,
                       page_size: int = 50) -> Starlette:
    """The web console as an ASGI app; `app.mount("/outbox", console)` to embed it.

    - `token`: required on every request (Bearer header or the login form's cookie).
    - `auth`: `callable(request) -> operator name | None` (may be async): your own
      authorization decides instead (see `trust_upstream` when your middleware
      already guards the mount). With neither, only loopback clients are answered.
    - `mask`: a `Mask`, a list of rules, or by default `$OUTBOX_UI_MASK` / the defaults.
    - `trace_url`: e.g. `http://localhost:16686/trace/{trace_id}`; default
      `$OUTBOX_TRACE_URL`.
    - `secret`: the CSRF/cookie signing key, when several processes serve the console
      without a token (with a token, it is derived from the token).
    - `read_only`: no retry, cancel or redrive.
    """
    if mask is _UNSET:
        mask = Mask.from_env()
    elif not isinstance(mask, Mask):
        mask = Mask(mask or ())
    if trace_url is _UNSET:
        trace_url = os.environ.get("OUTBOX_TRACE_URL") or None
    if trace_url is not None and not (trace_url.startswith(("http://", "https://"))
                                      and "{trace_id}" in trace_url):
        raise ValueError("trace_url must be an http(s) URL containing {trace_id}")
    console = Console(engine=engine, keys=sec.Keys(token, secret), mask=mask, auth=auth,
                      trace_url=trace_url, read_only=read_only, page_size=page_size)
    routes = [
        Route("/", endpoint(overview), name="overview"),
        Route("/live", endpoint(overview_live), name="overview_live"),
        Route("/effects", endpoint(effects_list), name="effects"),
        Route("/effects/{effect_id}", endpoint(effect_page), name="effect"),
        Route("/effects/{effect_id}/live", endpoint(effect_live), name="effect_live"),
        Route("/effects/{effect_id}/origin", endpoint(effect_origin), name="origin"),
        Route("/effects/{effect_id}/retry", endpoint(effect_retry), methods=["GET", "POST"],
              name="retry"),
        Route("/effects/{effect_id}/cancel", endpoint(effect_cancel), methods=["GET", "POST"],
              name="cancel"),
        Route("/redrive", endpoint(redrive), methods=["GET", "POST"], name="redrive"),
        Route("/audit", endpoint(audit), name="audit"),
        Route("/login", endpoint(login, public=True), methods=["GET", "POST"], name="login"),
        Route("/logout", endpoint(logout), methods=["POST"], name="logout"),
        Mount("/static", app=StaticFiles(directory=STATIC), name="static"),
    ]
    app = Starlette(routes=routes, exception_handlers={404: _not_found, 405: _not_found})
    app.state.console = console
    return app


__all__ = ["Markup", "create_console_app", "trust_upstream"]
