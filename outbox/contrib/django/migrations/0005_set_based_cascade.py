"""Alembic revision 0008 (an effect's key and attempts deleted with it by statement-level
triggers, not per-row foreign-key cascades).

Each Alembic revision the library ships gets a Django migration pinning it
(outbox/contrib/django/migrations_support.py).
"""

from django.db import migrations

from outbox.contrib.django.migrations_support import downgrade_to, upgrade_to


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("outbox", "0004_effect_keys")]

    operations = [
        migrations.RunPython(upgrade_to("0008"), downgrade_to("0007"), elidable=False),
    ]
