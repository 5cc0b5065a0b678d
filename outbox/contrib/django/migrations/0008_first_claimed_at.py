"""Alembic revision 0011 (an effect's first claim, for the receiver's key retention).

Each Alembic revision the library ships gets a Django migration pinning it
(outbox/contrib/django/migrations_support.py).
"""

from django.db import migrations

from outbox.contrib.django.migrations_support import downgrade_to, upgrade_to


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("outbox", "0007_watched_doorbell")]

    operations = [
        migrations.RunPython(upgrade_to("0011"), downgrade_to("0010"), elidable=False),
    ]
