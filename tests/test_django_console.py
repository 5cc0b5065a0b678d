"""The web console served next to Django, behind Django's session (issue 13).

Django is configured by tests/test_django.py's `django_ready` fixture (once per
process); the console and Django's own ASGI app are reached through
`outbox.contrib.django.console.console_app` with Starlette's TestClient, the session
cookie coming from a real Django login (`Client.force_login`).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, text

from tests.test_django import _effect, dj, django_ready, scratch_db  # noqa: F401

with warnings.catch_warnings():  # starlette would rather have `httpx2`; httpx works
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

PREFIX = "/outbox/console"


def _session_cookie(username: str, *, staff: bool, active: bool = True) -> dict[str, str]:
    from django.conf import settings
    from django.contrib.auth import get_user_model
    from django.test import Client

    user_model = get_user_model()
    user_model.objects.filter(username=username).delete()
    user = user_model.objects.create_user(username, f"{username}@example.com", "pw",
                                          is_staff=staff, is_active=active)
    client = Client()
    client.force_login(user)
    return {settings.SESSION_COOKIE_NAME: client.cookies[settings.SESSION_COOKIE_NAME].value}


@pytest.fixture
def asgi(dj: Engine) -> Iterator[Any]:  # noqa: F811
    from outbox.contrib.django.console import console_app

    app = console_app(prefix=PREFIX)
    with TestClient(app, base_url="http://testserver") as client:
        yield client
    app.engine.dispose()  # type: ignore[attr-defined]


def _client_with(asgi: Any, cookies: dict[str, str]) -> Any:
    asgi.cookies.clear()
    for name, value in cookies.items():
        asgi.cookies.set(name, value)
    return asgi


def test_a_staff_user_gets_the_console_others_get_403(asgi: Any, dj: Engine) -> None:  # noqa: F811
    staff = _session_cookie("ops", staff=True)
    page = _client_with(asgi, staff).get(f"{PREFIX}/")
    assert page.status_code == 200, page.text[:500]
    assert f'href="{PREFIX}/effects' in page.text  # links carry the mount prefix
    assert _client_with(asgi, staff).get(PREFIX).status_code == 200  # redirected to /

    plain = _session_cookie("someone", staff=False)
    assert _client_with(asgi, plain).get(f"{PREFIX}/").status_code == 403
    inactive = _session_cookie("gone", staff=True, active=False)
    assert _client_with(asgi, inactive).get(f"{PREFIX}/").status_code == 403
    assert _client_with(asgi, {}).get(f"{PREFIX}/").status_code == 403
    forged = {"sessionid": "not-a-session"}
    assert _client_with(asgi, forged).get(f"{PREFIX}/effects").status_code == 403


def test_everything_else_is_djangos(asgi: Any, dj: Engine) -> None:  # noqa: F811
    staff = _session_cookie("ops", staff=True)
    admin = _client_with(asgi, staff).get("/admin/", follow_redirects=False)
    assert admin.status_code == 200 and "Site administration" in admin.text
    anonymous = _client_with(asgi, {}).get("/admin/", follow_redirects=False)
    assert anonymous.status_code == 302 and "/admin/login/" in anonymous.headers["location"]
    # a path that merely starts like the prefix is Django's (its 404), not the console's
    assert _client_with(asgi, staff).get("/outbox/consoles").status_code == 404


def test_a_console_retry_is_audited_under_the_django_username(asgi: Any,
                                                              dj: Engine) -> None:  # noqa: F811
    with dj.begin() as conn:
        effect = _effect(conn, "failed", attempts=3)
    client = _client_with(asgi, _session_cookie("ops", staff=True))
    confirm = client.get(f"{PREFIX}/effects/{effect}/retry")
    assert confirm.status_code == 200, confirm.text[:500]
    match = re.search(r'name="csrf" value="([^"]+)"', confirm.text)
    assert match
    done = client.post(f"{PREFIX}/effects/{effect}/retry", data={"csrf": match.group(1)},
                       follow_redirects=False)
    assert done.status_code == 303, done.text[:500]
    with dj.connect() as conn:
        status = conn.execute(text("SELECT status FROM outbox.effects WHERE id = :id"),
                              {"id": effect}).scalar_one()
        audit = conn.execute(text(
            "SELECT actor, action, outcome, effect_ids FROM outbox.console_actions "
            "ORDER BY id DESC LIMIT 1")).one()
    assert status == "pending"
    assert tuple(audit) == ("ops", "retry", "done", [effect])
    assert "ops" in client.get(f"{PREFIX}/audit").text


def test_the_admin_links_to_the_console_when_configured(dj: Engine) -> None:  # noqa: F811
    from django.contrib.auth import get_user_model
    from django.test import Client, override_settings

    user_model = get_user_model()
    user = user_model.objects.filter(username="admin").first() or \
        user_model.objects.create_superuser("admin", "admin@example.com", "pw")
    client = Client()
    client.force_login(user)
    page = client.get("/admin/outbox/effect/")
    assert page.status_code == 200 and "Open the outbox console" not in page.content.decode()
    from django.conf import settings

    with override_settings(OUTBOX={**settings.OUTBOX, "CONSOLE_URL": f"{PREFIX}/"}):
        page = client.get("/admin/outbox/effect/")
        html = page.content.decode()
        assert page.status_code == 200
        assert f'<a href="{PREFIX}/" class="viewlink">Open the outbox console</a>' in html


def test_a_bad_console_url_is_a_system_check_error(dj: Engine) -> None:  # noqa: F811
    from django.conf import settings
    from django.test import override_settings

    from outbox.contrib.django import conf

    with override_settings(OUTBOX={**settings.OUTBOX, "CONSOLE_URL": 5}):
        assert any("CONSOLE_URL" in p for p in conf.problems())
    assert not conf.problems()
