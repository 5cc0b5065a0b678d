"""The example's webhook signatures (DESIGN §8): Standard Webhooks, keyed per source.

`EXAMPLE_WEBHOOK_SECRETS=billing=whsec_<base64>,crm=whsec_<base64>` names the sources the
service accepts and each one's secret; a source named twice has two secrets (rotation:
both verify until the old one is removed). A source not listed is unknown (404); a
missing, bad or stale signature (outside 5 minutes either way) is a 401; nothing is
stored for either, and neither is parsed. Unset (or blank), the service accepts unsigned
events from any source and says so loudly at startup: a demo mode, never production.

The batch endpoint is signed like a single event: one signature over the whole raw
array, with its own `webhook-id` for the delivery.
"""

from __future__ import annotations

import logging
import os

from starlette.requests import Request

from outbox.http import check_json_media_type, read_body
from outbox.webhooks import WebhookSources

log = logging.getLogger("payments.webhooks")
ENV = "EXAMPLE_WEBHOOK_SECRETS"


def sources_from_env() -> WebhookSources:
    """The registry `EXAMPLE_WEBHOOK_SECRETS` describes; unsigned mode when it is unset."""
    spec = os.environ.get(ENV)
    if spec is None or not spec.strip():
        log.warning("%s is unset: UNSIGNED WEBHOOKS from ANY source are accepted, so anyone "
                    "who can reach /webhooks decides what the inbox holds. Never run this "
                    "in production.", ENV)
        return WebhookSources.unsigned()
    return WebhookSources.standard_webhooks(spec)


async def verified_body(sources: WebhookSources, source: str, request: Request) -> bytes:
    """The raw body, once its source is known (404) and its signature holds (401).

    Order: the source before reading anything, the signature over the bytes exactly as
    received (bounded: 413), then the media type (415); parsing (400) comes after.
    """
    sources.check_source(source)
    body = await read_body(request)
    sources.verify(source, request.headers, body)
    check_json_media_type(request)
    return body
