"""Alembic revision 0005 (`idempotency_keys.business_hash` and its partial index).

Each Alembic revision the library ships gets a Django migration pinning it, so
`manage.py migrate` keeps the outbox schema where this version of pg-outbox needs it
(outbox/contrib/django/migrations_support.py).
"""

from django.db import migrations

from outbox.contrib.django.migrations_support import downgrade_to, upgrade_to


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("outbox", "0001_outbox_schema")]

    operations = [
        migrations.RunPython(upgrade_to("0005"), downgrade_to("0004"), elidable=False),
    ]
