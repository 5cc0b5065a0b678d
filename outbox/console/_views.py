"""The console's pages, as HTML strings built with `Markup` (everything escaped).

Links are built from route names plus the request's `root_path`, so they work when
the console is mounted under a prefix (`app.mount("/outbox", console)`).
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode

from starlette.requests import Request
from starlette.responses import HTMLResponse

from outbox._schema import EffectStatus
from outbox.console import _security as sec
from outbox.console._html import DASH, Markup, ago, badge, concat, duration, pretty_json
from outbox.errors import KEY_RETENTION_REFUSALS
from outbox.sql import console as cq
from outbox.sql.console import EffectFilter

if TYPE_CHECKING:
    from outbox.console._app import Console

STATUSES = [s.value for s in EffectStatus]
_TRACE_ID = re.compile(r"^[0-9a-f]{32}$")
NOTICES = {
    "retried": "Retried: the effect is pending again with a fresh set of attempts.",
    "cancelled": "Cancelled: no worker will deliver it.",
}


def url(request: Request, name: str, **params: str) -> str:
    root = (request.scope.get("root_path") or "").rstrip("/")
    return root + str(request.app.url_path_for(name, **params))


def static(request: Request, path: str) -> str:
    return url(request, "static", path=path)


def with_query(base: str, pairs: Sequence[tuple[str, str]]) -> str:
    return f"{base}?{urlencode(list(pairs))}" if pairs else base


def csrf_input(console: Console, request: Request) -> Markup:
    cookie, _ = sec.csrf_cookie(request)
    return Markup('<input type="hidden" name="csrf" value="{}">').format(
        console.keys.csrf_field(cookie))


# --- layout -------------------------------------------------------------------------

def page(console: Console, request: Request, title: str, body: Markup, *, active: str = "",
         status: int = 200) -> HTMLResponse:
    nav = concat(
        Markup('<a href="{}" class="{}">{}</a>').format(
            href, "active" if key == active else "", label)
        for key, href, label in (
            ("overview", url(request, "overview"), "Overview"),
            ("effects", url(request, "effects"), "Effects"),
            ("dead", with_query(url(request, "effects"),
                                [("status", "failed"), ("status", "needs_review")]),
             "Dead letters"),
            ("audit", url(request, "audit"), "Audit"),
        ))
    logout = Markup("")
    if console.token is not None and request.cookies.get(sec.SESSION_COOKIE):
        logout = Markup(
            '<form method="post" action="{}" class="inline">{}'
            '<button class="link">log out</button></form>').format(
            url(request, "logout"), csrf_input(console, request))
    db = console.engine.url.database or ""
    html = Markup(
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<title>{title} · outbox</title>'
        '<link rel="stylesheet" href="{css}"><script src="{js}" defer></script></head>'
        '<body><header><a class="brand" href="{home}">outbox</a><nav>{nav}</nav>'
        '<span class="db" title="database">{db}{ro}</span>{logout}</header>'
        '<main><h1>{title}</h1>{body}</main></body></html>').format(
        title=title, css=static(request, "console.css"), js=static(request, "console.js"),
        home=url(request, "overview"), nav=nav, db=db,
        ro=Markup(" · read-only") if console.read_only else "", logout=logout, body=body)
    return HTMLResponse(html, status_code=status)


def problem_page(console: Console, request: Request, status: int, title: str,
                 detail: str) -> HTMLResponse:
    body = Markup('<div class="problem"><p class="code">{}</p><p>{}</p>'
                  '<p><a href="{}">Overview</a> · <a href="{}">Effects</a></p></div>').format(
        status, detail, url(request, "overview"), url(request, "effects"))
    try:
        return page(console, request, title, body, status=status)
    except Exception:  # a broken layout must not hide the answer
        return HTMLResponse(Markup("<h1>{}</h1><p>{}</p>").format(title, detail),
                            status_code=status)


def login_page(console: Console, request: Request, nxt: str, error: bool = False
               ) -> HTMLResponse:
    body = Markup(
        '<form method="post" action="{}" class="login">{}'
        '<input type="hidden" name="next" value="{}">'
        '<label>Token <input type="password" name="token" autocomplete="current-password"'
        ' autofocus required></label><button>Log in</button>{}</form>'
        '<p class="muted">The token is the one the console was started with'
        ' (<code>--token</code> or <code>OUTBOX_UI_TOKEN</code>).</p>').format(
        url(request, "login"), csrf_input(console, request), nxt,
        Markup('<p class="error">Wrong token.</p>') if error else "")
    return page(console, request, "Log in", body, status=401 if error else 200)


# --- overview -----------------------------------------------------------------------

def overview_shell(console: Console, request: Request, live: Markup) -> Markup:
    return Markup('<div id="live" data-poll="{}" data-interval="5000">{}</div>'
                  '<p class="muted live-note">Live: refreshes every 5 s.</p>').format(
        url(request, "overview_live"), live)


def _effects_link(request: Request, label: Any, pairs: Sequence[tuple[str, str]],
                  cls: str = "") -> Markup:
    return Markup('<a class="{}" href="{}">{}</a>').format(
        cls, with_query(url(request, "effects"), pairs), label)


def overview_live(console: Console, request: Request) -> Markup:
    from outbox.sql import effects as fx

    conn = console.engine.connect().execution_options(isolation_level="REPEATABLE READ")
    with conn:
        cq.configure_console_transaction(conn, console.statement_timeout_ms)
        clock = cq.database_now(conn)
        unfinished = cq.count_unfinished(conn)
        pending = cq.pending_by_queue(conn)
        expired = cq.expired_leases_by_queue(conn)
        estimate = cq.estimated_effect_rows(conn)
        exact = estimate is None or estimate < console.exact_counts_below
        delivered = cq.count_delivered(conn) if exact else {}
        minutes = cq.attempts_per_minute(conn, 60)
        blocked = fx.blocked_ordering_keys(conn, limit=20)
        processing, stale, stale_rows = cq.stale_processing_keys(conn, 20)
    now: datetime = clock.now

    by: dict[str, dict[str, int]] = {}
    for r in unfinished:
        by.setdefault(r.queue, {})[r.status] = int(r.n)
    pend = {r.queue: r for r in pending}
    for q, n in delivered.items():
        by.setdefault(q, {})["delivered"] = n
    for q in pend:
        by.setdefault(q, {})
    totals: dict[str, int] = {}
    for counts in by.values():
        for s, n in counts.items():
            totals[s] = totals.get(s, 0) + n
    due = sum(int(r.due) for r in pending)
    later = sum(int(r.later) for r in pending)
    oldest = max((float(r.oldest_due_age or 0) for r in pending), default=0.0)
    if exact:
        delivered_total = Markup("{:,}").format(totals.get("delivered", 0))
    else:
        rough = max((estimate or 0) - sum(v for k, v in totals.items() if k != "delivered"), 0)
        delivered_total = Markup('<span title="planner estimate (last ANALYZE)">≈ {:,}</span>'
                                 ).format(rough)

    def card(label: str, value: Any, pairs: Sequence[tuple[str, str]], cls: str = "",
             note: Any = "") -> Markup:
        return Markup('<a class="card {}" href="{}"><span class="n">{}</span>'
                      '<span class="label">{}</span><span class="note">{}</span></a>').format(
            cls, with_query(url(request, "effects"), pairs), value, label, note)

    cards = concat([
        card("due now", Markup("{:,}").format(due), [("status", "pending")],
             "warn" if oldest > 60 else "", Markup("oldest waits {}").format(duration(oldest))
             if due else ""),
        card("scheduled later", Markup("{:,}").format(later), [("status", "pending")]),
        card("in flight", Markup("{:,}").format(totals.get("in_flight", 0)),
             [("status", "in_flight")], "bad" if sum(expired.values()) else "",
             Markup("{} expired leases").format(sum(expired.values()))
             if sum(expired.values()) else ""),
        card("failed", Markup("{:,}").format(totals.get("failed", 0)), [("status", "failed")],
             "bad" if totals.get("failed") else ""),
        card("needs review", Markup("{:,}").format(totals.get("needs_review", 0)),
             [("status", "needs_review")], "warn" if totals.get("needs_review") else ""),
        card("cancelled", Markup("{:,}").format(totals.get("cancelled", 0)),
             [("status", "cancelled")]),
        card("delivered", delivered_total, [("status", "delivered")], "good"),
    ])

    cols = ["pending", "in_flight", "failed", "needs_review", "cancelled", "delivered"]
    head = concat(Markup("<th class='num'>{}</th>").format(c.replace("_", " ")) for c in cols)
    body_rows = []
    for q in sorted(by):
        counts = by[q]
        p = pend.get(q)
        cells = []
        for c in cols:
            if c == "delivered" and not exact:
                cells.append(Markup("<td class='num muted'>&ndash;</td>"))
                continue
            n = counts.get(c, 0)
            label: Any = Markup("{:,}").format(n)
            if c == "pending" and p is not None:
                label = Markup('{:,} <span class="muted">({:,} due)</span>').format(n, int(p.due))
            cells.append(Markup("<td class='num'>{}</td>").format(
                _effects_link(request, label, [("status", c), ("queue", q)]) if n else label))
        oldest_q = float(p.oldest_due_age or 0) if p is not None else 0.0
        body_rows.append(Markup("<tr><th>{}</th>{}<td class='num'>{}</td><td class='num'>{}</td>"
                                "</tr>").format(
            _effects_link(request, q, [("queue", q)]), concat(cells),
            duration(oldest_q) if p is not None and int(p.due) else DASH,
            expired.get(q, 0) or ""))
    queues = Markup(
        "<table class='grid'><thead><tr><th>queue</th>{}<th class='num'>oldest due</th>"
        "<th class='num'>expired leases</th></tr></thead><tbody>{}</tbody></table>").format(
        head, concat(body_rows) or Markup("<tr><td colspan='9' class='muted'>no effects</td></tr>"))

    chart = minute_chart(minutes, clock.minute, 60)
    last_hour_ok = sum(int(r.delivered) for r in minutes)
    last_hour_bad = sum(int(r.failed) for r in minutes)

    if blocked:
        blocked_rows = concat(
            Markup("<tr><td>{}</td><td><a href='{}'>#{}</a></td><td>{}</td><td class='num'>{}"
                   "</td><td class='err'>{}</td></tr>").format(
                _effects_link(request, b.ordering_key, [("ordering_key", b.ordering_key)]),
                url(request, "effect", effect_id=str(b.id)), b.id, badge(b.status),
                b.attempts, (b.last_error or "")[:160])
            for b in blocked)
        blocked_html = Markup(
            "<table class='grid'><thead><tr><th>ordering key</th><th>head</th><th>status</th>"
            "<th class='num'>attempts</th><th>last error</th></tr></thead><tbody>{}</tbody>"
            "</table>").format(blocked_rows)
    else:
        blocked_html = Markup("<p class='muted'>None: every ordering key's head is moving.</p>")

    if stale_rows:
        stale_html = Markup(
            "<table class='grid'><thead><tr><th>scope</th><th>key</th><th>claimed</th>"
            "<th class='num'>past its TTL by</th></tr></thead><tbody>{}</tbody></table>").format(
            concat(Markup("<tr><td>{}</td><td><code>{}</code></td><td>{}</td>"
                          "<td class='num'>{}</td></tr>").format(
                r.scope, r.key, ago(r.locked_at, now), duration(float(r.overdue or 0)))
                for r in stale_rows))
    else:
        stale_html = Markup("<p class='muted'>None.</p>")

    return Markup(
        '<section class="cards">{cards}</section>'
        '<section><h2>Attempts per minute <span class="muted">last hour: {ok:,} delivered,'
        ' {bad:,} failed</span></h2>{chart}</section>'
        '<section><h2>By queue</h2>{queues}</section>'
        '<section><h2>Blocked ordering keys <span class="muted">a head that failed,'
        ' is parked or keeps retrying holds back its key</span></h2>{blocked}</section>'
        '<section><h2>Stale processing keys <span class="muted">{processing:,} phased claims'
        ' in progress, {stale:,} past their TTL</span></h2>{stale_html}</section>'
        '<p class="muted small">as of {asof}</p>').format(
        cards=cards, ok=last_hour_ok, bad=last_hour_bad, chart=chart, queues=queues,
        blocked=blocked_html, processing=processing, stale=stale, stale_html=stale_html,
        asof=now.strftime("%H:%M:%S"))


def minute_chart(rows: Sequence[Any], last_minute: datetime, minutes: int) -> Markup:
    """Stacked bars, one per minute: deliveries (green) over failed attempts (red)."""
    by = {r.minute: (int(r.delivered), int(r.failed)) for r in rows}
    start = last_minute - timedelta(minutes=minutes - 1)
    series = [by.get(start + timedelta(minutes=i), (0, 0)) for i in range(minutes)]
    top = max((ok + bad for ok, bad in series), default=0) or 1
    width, height, bar = 720, 120, 720 / minutes
    rects = []
    for i, (ok, bad) in enumerate(series):
        x = i * bar + 1
        when = (start + timedelta(minutes=i)).strftime("%H:%M")
        h_ok = ok / top * (height - 16)
        h_bad = bad / top * (height - 16)
        tip = Markup("<title>{}: {} delivered, {} failed</title>").format(when, ok, bad)
        if ok:
            rects.append(Markup('<rect class="ok" x="{:.1f}" y="{:.1f}" width="{:.1f}"'
                                ' height="{:.1f}">{}</rect>').format(
                x, height - h_ok, bar - 2, h_ok, tip))
        if bad:
            rects.append(Markup('<rect class="bad" x="{:.1f}" y="{:.1f}" width="{:.1f}"'
                                ' height="{:.1f}">{}</rect>').format(
                x, height - h_ok - h_bad, bar - 2, h_bad, tip))
        if not ok and not bad:
            rects.append(Markup('<rect class="zero" x="{:.1f}" y="{}" width="{:.1f}"'
                                ' height="1">{}</rect>').format(x, height - 1, bar - 2, tip))
    return Markup(
        '<svg class="chart" viewBox="0 0 {w} {h2}" role="img" aria-label="attempts per minute">'
        '{rects}<text x="0" y="10" class="axis">{top:,}/min</text>'
        '<text x="0" y="{h2}" class="axis" dy="-2">&minus;{m} min</text>'
        '<text x="{w}" y="{h2}" class="axis end" dy="-2">now</text></svg>').format(
        w=width, h2=height + 14, rects=concat(rects), top=top, m=minutes)


# --- effects list -------------------------------------------------------------------

def effects_page(console: Console, request: Request, f: EffectFilter,
                 params: Mapping[str, list[str]], rows: Sequence[Any], now: datetime, *,
                 has_newer: bool, has_older: bool) -> Markup:
    from outbox.console._app import filter_query

    pairs = filter_query(f, params)
    checks = concat(
        Markup('<label class="chk"><input type="checkbox" name="status" value="{}"{}> {}'
               '</label>').format(s, Markup(" checked") if s in f.statuses else "",
                                  s.replace("_", " "))
        for s in STATUSES)

    def field(name: str, label: str, value: Any, placeholder: str) -> Markup:
        return Markup('<label>{} <input name="{}" value="{}" placeholder="{}"></label>').format(
            label, name, value or "", placeholder)

    raw_older = (params.get("older") or [""])[0]
    raw_newer = (params.get("newer") or [""])[0]
    form = Markup(
        '<form class="filters" method="get" action="{}"><div class="statuses">{}</div>'
        '<div class="fields">{}{}{}{}{}{}<button>Filter</button> <a href="{}">clear</a></div>'
        '</form>').format(
        url(request, "effects"), checks,
        field("key", "effect key starts with", f.key_prefix, "psp.charge:3fa2"),
        field("kind", "kind", f.kind, "psp.charge"),
        field("queue", "queue", f.queue, "default"),
        field("ordering_key", "ordering key", f.ordering_key, ""),
        field("older", "created more than", raw_older, "15m ago"),
        field("newer", "created less than", raw_newer, "1h ago"),
        url(request, "effects"))

    trs = []
    for r in rows:
        trs.append(Markup(
            "<tr><td class='num'><a href='{href}'>{id}</a></td><td>{status}</td>"
            "<td><a href='{href}'><code>{key}</code></a></td><td>{kind}</td><td>{queue}</td>"
            "<td>{ok}</td><td class='num'>{att}/{maxa}</td><td>{created}</td><td>{avail}</td>"
            "<td class='err'>{err}</td></tr>").format(
            href=url(request, "effect", effect_id=str(r.id)), id=r.id, status=badge(r.status),
            key=r.effect_key, kind=r.kind, queue=r.queue, ok=r.ordering_key or "",
            att=r.attempts, maxa=r.max_attempts, created=ago(r.created_at, now),
            avail=ago(r.available_at, now) if r.status == "pending" else "",
            err=(r.last_error or "")[:140]))
    table = Markup(
        "<table class='grid list'><thead><tr><th class='num'>id</th><th>status</th>"
        "<th>effect key</th><th>kind</th><th>queue</th><th>ordering key</th>"
        "<th class='num'>attempts</th><th>created</th><th>due</th><th>last error</th></tr>"
        "</thead><tbody>{}</tbody></table>").format(
        concat(trs) or Markup("<tr><td colspan='10' class='muted'>No effect matches.</td></tr>"))

    base = url(request, "effects")
    nav = [Markup('<a href="{}">⇤ newest</a>').format(with_query(base, pairs))]
    if has_newer and rows:
        nav.append(Markup('<a rel="prev" href="{}">← newer</a>').format(
            with_query(base, [*pairs, ("after", str(rows[0].id))])))
    if has_older and rows:
        nav.append(Markup('<a rel="next" href="{}">older →</a>').format(
            with_query(base, [*pairs, ("before", str(rows[-1].id))])))
    actions = Markup("")
    if not console.read_only and (not f.statuses or "failed" in f.statuses):
        redrive_pairs = [p for p in pairs if p[0] != "status"]
        actions = Markup('<a class="button" href="{}">Redrive the failed ones matching'
                         ' these filters…</a>').format(
            with_query(url(request, "redrive"), redrive_pairs))
    return Markup('{form}<div class="bar"><nav class="pager">{nav}</nav>{actions}</div>'
                  '{table}<div class="bar"><nav class="pager">{nav}</nav></div>').format(
        form=form, nav=Markup(" ").join(nav), actions=actions, table=table)


# --- one effect ---------------------------------------------------------------------

def _trace_link(console: Console, trace_id: str | None) -> Markup:
    if not trace_id:
        return Markup(DASH)
    if console.trace_url and _TRACE_ID.match(trace_id):
        href = console.trace_url.replace("{trace_id}", quote(trace_id, safe=""))
        return Markup('<a href="{}" rel="noopener noreferrer" target="_blank"><code>{}</code>'
                      '</a>').format(href, trace_id)
    return Markup("<code>{}</code>").format(trace_id)


def enqueue_trace_id(headers: Any) -> str | None:
    tp = (headers or {}).get("traceparent") if isinstance(headers, dict) else None
    if isinstance(tp, str):
        parts = tp.split("-")
        if len(parts) >= 3 and _TRACE_ID.match(parts[1]):
            return parts[1]
    return None


def effect_live(console: Console, request: Request, row: Any, attempts: Sequence[Any],
                now: datetime) -> Markup:
    facts = [
        ("status", badge(row.status)),
        ("attempts", Markup("{} of {}").format(row.attempts, row.max_attempts)),
        ("created", ago(row.created_at, now)),
        ("due" if row.status == "pending" else "available at", ago(row.available_at, now)),
    ]
    if row.retry_until:
        facts.append(("retries until", ago(row.retry_until, now)))
    if row.delivered_at:
        facts.append(("delivered", ago(row.delivered_at, now)))
    if row.finished_at:
        facts.append(("finished", ago(row.finished_at, now)))
    if row.lease_owner:
        facts.append(("leased by", Markup("<code>{}</code> until {}").format(
            row.lease_owner, ago(row.lease_expires_at, now))))
    if row.last_error:
        facts.append(("last error", Markup("<span class='err'>{}</span>").format(row.last_error)))
    dl = concat(Markup("<dt>{}</dt><dd>{}</dd>").format(k, v) for k, v in facts)
    trs = []
    for a in attempts:
        took = (a.finished_at - a.started_at).total_seconds()
        err = a.error or ""
        err_html: Markup = (Markup("<details><summary>{}…</summary><pre>{}</pre></details>")
                            .format(err[:80], err) if len(err) > 80 else
                            Markup("{}").format(err))
        trs.append(Markup(
            "<tr><td class='num'>{}</td><td>{}</td><td>{}</td><td class='num'>{}</td>"
            "<td class='num'>{}</td><td><code>{}</code></td><td>{}</td><td class='err'>{}</td>"
            "</tr>").format(a.attempt, badge(a.outcome), ago(a.started_at, now), duration(took),
                            a.http_status or "", a.worker, _trace_link(console, a.trace_id),
                            err_html))
    table = Markup(
        "<table class='grid'><thead><tr><th class='num'>#</th><th>outcome</th><th>started</th>"
        "<th class='num'>took</th><th class='num'>HTTP</th><th>worker</th><th>trace</th>"
        "<th>error</th></tr></thead><tbody>{}</tbody></table>").format(
        concat(trs) or Markup("<tr><td colspan='8' class='muted'>No attempt yet.</td></tr>"))
    return Markup('<dl class="facts">{}</dl><h2>Attempts</h2>{}').format(dl, table)


def effect_page(console: Console, request: Request, row: Any, attempts: Sequence[Any],
                actions: Sequence[Any], now: datetime, notice: str | None) -> Markup:
    note = Markup("")
    if notice in NOTICES:
        note = Markup('<p class="notice">{}</p>').format(NOTICES[notice])
    buttons = []
    if not console.read_only:
        if row.status in ("failed", "needs_review", "cancelled"):
            buttons.append(Markup('<a class="button" href="{}">Retry…</a>').format(
                url(request, "retry", effect_id=str(row.id))))
        if row.status in ("pending", "failed", "needs_review"):
            buttons.append(Markup('<a class="button danger" href="{}">Cancel…</a>').format(
                url(request, "cancel", effect_id=str(row.id))))
    ident = [
        ("effect key", Markup("<code>{}</code>").format(row.effect_key)),
        ("kind", _effects_link(request, row.kind, [("kind", row.kind)])),
        ("queue", _effects_link(request, row.queue, [("queue", row.queue)])),
    ]
    if row.ordering_key:
        ident.append(("ordering key", _effects_link(request, row.ordering_key,
                                                    [("ordering_key", row.ordering_key)])))
    trace_id = enqueue_trace_id(row.headers)
    ident.append(("enqueued in trace", _trace_link(console, trace_id)))
    ident.append(("request", Markup(
        '<a href="{}">find the idempotency key it came from</a>'
        ' <span class="muted">(effects store no reference to it; this looks it up)</span>'
        ).format(url(request, "origin", effect_id=str(row.id)))))
    ident_dl = concat(Markup("<dt>{}</dt><dd>{}</dd>").format(k, v) for k, v in ident)

    def json_block(title: str, value: Any) -> Markup:
        if value is None:
            return Markup("")
        return Markup("<section><h2>{}</h2><pre class='json'>{}</pre></section>").format(
            title, pretty_json(console.mask.apply(value)))

    audit_rows = concat(
        Markup("<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>").format(
            ago(a.at, now), a.action, badge(a.outcome), a.actor) for a in actions)
    audit_html = Markup(
        "<section><h2>Console actions</h2><table class='grid'><thead><tr><th>when</th>"
        "<th>action</th><th>outcome</th><th>who</th></tr></thead><tbody>{}</tbody></table>"
        "</section>").format(audit_rows) if actions else Markup("")
    masked = Markup("") if not console.mask.rules else Markup(
        '<p class="muted small">Masked keys: <code>{}</code></p>').format(
        ", ".join(".".join(r) for r in console.mask.rules))
    return Markup(
        '{note}<div class="bar"><dl class="facts ident">{ident}</dl>'
        '<div class="actions">{buttons}</div></div>'
        '<div id="live" data-poll="{live}" data-interval="3000">{live_html}</div>'
        '{payload}{headers}{result}{masked}{audit}').format(
        note=note, ident=ident_dl, buttons=concat(buttons),
        live=url(request, "effect_live", effect_id=str(row.id)),
        live_html=effect_live(console, request, row, attempts, now),
        payload=json_block("Payload", row.payload), headers=json_block("Headers", row.headers),
        result=json_block("Result", row.result), masked=masked, audit=audit_html)


def derived_key_names(scope: str, key: str, generation: uuid.UUID | None, kind: str,
                      effect_key: str, tries: int = 64) -> str | None:
    """The effect name under which `Claim.effect_key` gives `effect_key`, if one of the
    first `tries` positional names (or none) does; None when it cannot be shown."""
    prefix = f"{kind[:200]}:"
    if not effect_key.startswith(prefix):
        return None
    for name in [str(i) for i in range(tries)]:
        parts = [scope, key, kind, name]
        if generation is not None:
            parts.append(generation.hex)
        if hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:32] == \
                effect_key[len(prefix):]:
            return name
    return None


def origin_page(console: Console, request: Request, row: Any,
                candidates: Sequence[Any]) -> Markup:
    trs = []
    for k in candidates:
        name = derived_key_names(k.scope, k.key, k.generation, row.kind, row.effect_key)
        verdict = (Markup("<span class='badge st-delivered'>derived from it</span> "
                          "(effect #{} of its kind)").format(name) if name is not None else
                   Markup("<span class='badge st-other'>same transaction</span>"))
        trs.append(Markup(
            "<tr><td>{}</td><td><code>{}</code></td><td>{}</td><td class='num'>{}</td>"
            "<td><code>{}</code></td><td>{}</td></tr>").format(
            k.scope, k.key, badge(k.status), k.response_status or "",
            (k.fingerprint or "")[:24], verdict))
    table = Markup(
        "<table class='grid'><thead><tr><th>scope</th><th>key</th><th>status</th>"
        "<th class='num'>response</th><th>request fingerprint</th><th>link</th></tr></thead>"
        "<tbody>{}</tbody></table>").format(concat(trs)) if trs else Markup(
        "<p>No idempotency key was written in this effect's transaction: it was enqueued "
        "without a claim (or its key has been purged since).</p>")
    return Markup(
        '<p><a href="{back}">← effect #{id}</a></p>'
        '<p class="muted">Effects store no reference to the request. What is knowable: the '
        'idempotency key records written at the same transaction time as the effect '
        '(<code>created_at</code> for atomic mode, <code>completed_at</code> for phased). '
        'When the effect key was derived from one of them (<code>Claim.effect_key</code>, '
        'positional names), the console recomputes it and says so. The request itself is '
        'not stored, only its fingerprint (method, path, canonical body) and the response '
        'status. This lookup scans <code>outbox.idempotency_keys</code> (no index serves '
        'it) and stops after {ms} ms.</p>{table}').format(
        back=url(request, "effect", effect_id=str(row.id)), id=row.id, table=table,
        ms=console.origin_timeout_ms)


# --- actions ------------------------------------------------------------------------

def confirm_effect_action(console: Console, request: Request, row: Any, action: str,
                          now: datetime) -> Markup:
    if action == "retry":
        what = Markup("Retry effect <a href='{}'>#{}</a> ({}, {}): it becomes <b>pending</b>,"
                      " due now, with a fresh set of {} attempts.").format(
            url(request, "effect", effect_id=str(row.id)), row.id, row.kind,
            row.status.replace("_", " "), row.max_attempts)
        warn = Markup("")
        if row.status == "needs_review" and (row.last_error or "").startswith(
                tuple(f"{name}:" for name in KEY_RETENTION_REFUSALS)):
            warn = Markup("<p class='error'>It was not sent: its receiver may have"
                          " forgotten the effect key, and an earlier attempt may have been"
                          " applied. Retry only if you checked with the receiver that it"
                          " was not: the retry is sent as a new request.</p>")
        elif row.status == "needs_review":
            warn = Markup("<p class='error'>Its last attempt's outcome is unknown and the"
                          " handler is not declared retry-safe: retry only if the receiver"
                          " deduplicates on the effect key or you checked it was not"
                          " applied.</p>")
        if row.status not in ("failed", "needs_review", "cancelled"):
            warn = Markup("<p class='error'>It is {} now: the retry will be refused.</p>"
                          ).format(row.status.replace("_", " "))
    else:
        what = Markup("Cancel effect <a href='{}'>#{}</a> ({}, {}): no worker will deliver it."
                      ).format(url(request, "effect", effect_id=str(row.id)), row.id,
                               row.kind, row.status.replace("_", " "))
        warn = Markup("")
        if row.status not in ("pending", "failed", "needs_review"):
            warn = Markup("<p class='error'>It is {} now: the cancel will be refused"
                          " (an in-flight effect may already be applied).</p>").format(
                row.status.replace("_", " "))
        elif row.ordering_key:
            warn = Markup("<p class='muted'>Its ordering key <code>{}</code> moves on to"
                          " the next effect.</p>").format(row.ordering_key)
    return Markup(
        '<div class="confirm"><p>{what}</p>{warn}'
        '<form method="post" action="{action_url}">{csrf}'
        '<button class="{cls}">Confirm: {label}</button> <a href="{back}">back</a></form>'
        '<p class="muted small">Recorded in the audit log with your name.</p></div>').format(
        what=what, warn=warn, action_url=url(request, action, effect_id=str(row.id)),
        csrf=csrf_input(console, request), cls="danger" if action == "cancel" else "",
        label=f"{action} #{row.id}", back=url(request, "effect", effect_id=str(row.id)))


def confirm_redrive(console: Console, request: Request, f: EffectFilter,
                    params: Mapping[str, list[str]], n: int, max_id: int | None) -> Markup:
    from outbox.console._app import filter_query

    pairs = [p for p in filter_query(f, params) if p[0] != "status"]
    described = ", ".join(f"{k} = {v}" for k, v in pairs) or "no other filter"
    if not n or max_id is None:
        return Markup('<p>No failed effect matches ({}). <a href="{}">back</a></p>').format(
            described, with_query(url(request, "effects"), [("status", "failed"), *pairs]))
    hidden = concat(Markup('<input type="hidden" name="{}" value="{}">').format(k, v)
                    for k, v in pairs)
    capped = Markup(" (counted up to {:,})").format(console.bulk_cap) \
        if n >= console.bulk_cap else ""
    return Markup(
        '<div class="confirm"><p><b>{n:,}</b> failed effects{capped} match: {described}, ids'
        ' up to #{max_id}. <a href="{list}">see them</a></p>'
        '<p>Redriving makes them pending, due now, with a fresh set of attempts (oldest'
        ' first). Parked effects (needs review) are never redriven in bulk: retry them one'
        ' by one. Effects that fail after this page was shown are not included.</p>'
        '<form method="post" action="{post}">{csrf}{hidden}'
        '<input type="hidden" name="max_id" value="{max_id}">'
        '<label>at most <input name="limit" type="number" min="1" max="{cap}" value="{lim}">'
        '</label> <button>Confirm: redrive</button> <a href="{back}">back</a></form>'
        '<p class="muted small">Recorded in the audit log with your name and the ids.</p>'
        '</div>').format(
        n=n, capped=capped, described=described, max_id=max_id,
        list=with_query(url(request, "effects"), [("status", "failed"), *pairs]),
        post=url(request, "redrive"), csrf=csrf_input(console, request), hidden=hidden,
        cap=console.bulk_cap, lim=min(n, 1000),
        back=with_query(url(request, "effects"), [("status", "failed"), *pairs]))


def audit_page(console: Console, request: Request, rows: Sequence[Any], now: datetime, *,
               more: bool, highlight: int | None) -> Markup:
    trs = []
    for r in rows:
        ids = concat(Markup("<a href='{}'>#{}</a> ").format(
            url(request, "effect", effect_id=str(i)), i) for i in (r.some_ids or []))
        if r.n > len(r.some_ids or []):
            ids = ids + Markup("… ({:,} in all)").format(r.n)
        trs.append(Markup(
            "<tr class='{}'><td class='num'>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>"
            "<td>{}</td><td><code class='small'>{}</code></td></tr>").format(
            "hl" if r.id == highlight else "", r.id, ago(r.at, now), r.actor, r.action,
            badge(r.outcome), ids or Markup("<span class='muted'>none</span>"),
            json.dumps(r.request, sort_keys=True)[:300]))
    table = Markup(
        "<table class='grid'><thead><tr><th class='num'>#</th><th>when</th><th>who</th>"
        "<th>action</th><th>outcome</th><th>effects changed</th><th>asked</th></tr></thead>"
        "<tbody>{}</tbody></table>").format(
        concat(trs) or Markup("<tr><td colspan='7' class='muted'>No action yet.</td></tr>"))
    pager = Markup("")
    if more and rows:
        pager = Markup('<nav class="pager"><a rel="next" href="{}">older →</a></nav>').format(
            with_query(url(request, "audit"), [("before", str(rows[-1].id))]))
    note = Markup("")
    if highlight is not None and rows and any(r.id == highlight for r in rows):
        r = next(r for r in rows if r.id == highlight)
        note = Markup('<p class="notice">Redrive done: {:,} effects are pending again.</p>'
                      ).format(r.n) if r.action == "redrive" else Markup("")
    return Markup("{}<p class='muted'>Every retry, cancel and redrive asked in the console,"
                  " done or refused (table <code>outbox.console_actions</code>).</p>{}{}"
                  ).format(note, table, pager)
