"""Alembic revision 0007 (`outbox.effect_keys`: effect-key uniqueness in a table of its
own; the unique index on effects.effect_key dropped).

Each Alembic revision the library ships gets a Django migration pinning it
(outbox/contrib/django/migrations_support.py).
"""

from django.db import migrations, models

from outbox.contrib.django.migrations_support import downgrade_to, upgrade_to


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("outbox", "0003_delivered_attempt")]

    operations = [
        migrations.RunPython(upgrade_to("0007"), downgrade_to("0006"), elidable=False),
        # The unmanaged Effect model's state: the key is unique through effect_keys.
        migrations.AlterField(model_name="effect", name="effect_key",
                              field=models.TextField()),
    ]
