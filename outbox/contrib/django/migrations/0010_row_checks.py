"""Alembic revision 0013 (each state machine's rules in one CHECK calling a function).

Each Alembic revision the library ships gets a Django migration pinning it
(outbox/contrib/django/migrations_support.py).
"""

from django.db import migrations

from outbox.contrib.django.migrations_support import downgrade_to, upgrade_to


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("outbox", "0009_require")]

    operations = [
        migrations.RunPython(upgrade_to("0013"), downgrade_to("0012"), elidable=False),
    ]
