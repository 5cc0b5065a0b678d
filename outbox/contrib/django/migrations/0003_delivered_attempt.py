"""Alembic revision 0006 (the delivered attempt on the effect row, and
`outbox.attempt_history`).

Each Alembic revision the library ships gets a Django migration pinning it
(outbox/contrib/django/migrations_support.py).
"""

from django.db import migrations

from outbox.contrib.django.migrations_support import downgrade_to, upgrade_to


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("outbox", "0002_business_hash")]

    operations = [
        migrations.RunPython(upgrade_to("0006"), downgrade_to("0005"), elidable=False),
        # The unmanaged Attempt model reads the whole history (a view) from now on.
        migrations.AlterModelTable(name="attempt", table='"outbox"."attempt_history"'),
    ]
