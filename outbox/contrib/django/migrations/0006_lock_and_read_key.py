"""Alembic revision 0009 (the atomic guard's lock and key read in one function call).

Each Alembic revision the library ships gets a Django migration pinning it
(outbox/contrib/django/migrations_support.py).
"""

from django.db import migrations

from outbox.contrib.django.migrations_support import downgrade_to, upgrade_to


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("outbox", "0005_set_based_cascade")]

    operations = [
        migrations.RunPython(upgrade_to("0009"), downgrade_to("0008"), elidable=False),
    ]
