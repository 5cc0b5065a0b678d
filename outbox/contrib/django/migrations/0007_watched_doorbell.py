"""Alembic revision 0010 (the doorbell rings only when no worker keeps watch).

Each Alembic revision the library ships gets a Django migration pinning it
(outbox/contrib/django/migrations_support.py).
"""

from django.db import migrations

from outbox.contrib.django.migrations_support import downgrade_to, upgrade_to


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("outbox", "0006_lock_and_read_key")]

    operations = [
        migrations.RunPython(upgrade_to("0010"), downgrade_to("0009"), elidable=False),
    ]
