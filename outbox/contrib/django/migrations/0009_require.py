"""Alembic revision 0012 (`outbox.require`: the guard's COMMIT rides with its last write).

Each Alembic revision the library ships gets a Django migration pinning it
(outbox/contrib/django/migrations_support.py).
"""

from django.db import migrations

from outbox.contrib.django.migrations_support import downgrade_to, upgrade_to


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("outbox", "0008_first_claimed_at")]

    operations = [
        migrations.RunPython(upgrade_to("0012"), downgrade_to("0011"), elidable=False),
    ]
