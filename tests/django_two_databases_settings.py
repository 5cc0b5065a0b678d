"""The payments example's Django settings plus a second database, `second`
($SECOND_DATABASE_URL): `manage.py outbox_worker --database default --database second`
serves both (tests/test_fleet_runners.py)."""

import os

from dispatcher.examples.payments.django_app.settings import *  # noqa: F403
from dispatcher.examples.payments.django_app.settings import DATABASES, database_from_url

DATABASES = {**DATABASES, "second": database_from_url(os.environ["SECOND_DATABASE_URL"])}
