"""The outbox schema, created by the Alembic revisions up to 0004 (the same as `outbox
migrate`), and the admin's unmanaged models over it (state only, no DDL).

Why a Django migration that runs ours (outbox/contrib/django/migrations_support.py):
`manage.py migrate` is how a Django project creates every table, including the test
databases Django's test runner builds; a separate command would be the one step a
deploy or a test run forgets. Not atomic: Alembic runs in its own connection and
transaction, exactly as `outbox migrate` does.
"""

from django.db import migrations, models

from outbox.contrib.django.migrations_support import downgrade_to, upgrade_to


class Migration(migrations.Migration):

    initial = True
    atomic = False

    dependencies: list[tuple[str, str]] = []

    operations = [
        migrations.RunPython(upgrade_to("0004"), downgrade_to("base"), elidable=False),
        migrations.CreateModel(
            name='Attempt',
            fields=[
                ('id', models.BigIntegerField(primary_key=True, serialize=False)),
                ('attempt', models.IntegerField()),
                ('worker', models.TextField()),
                ('started_at', models.DateTimeField()),
                ('finished_at', models.DateTimeField()),
                ('outcome', models.TextField(choices=[
                    ('delivered', 'delivered'), ('retry', 'retry'), ('failed', 'failed'),
                    ('lease_lost', 'lease lost'), ('ambiguous', 'ambiguous')])),
                ('http_status', models.IntegerField(blank=True, null=True)),
                ('error', models.TextField(blank=True, null=True)),
                ('trace_id', models.TextField(blank=True, null=True)),
            ],
            options={
                'verbose_name': 'attempt',
                'db_table': '"outbox"."attempts"',
                'ordering': ('effect_id', 'attempt', 'id'),
                'managed': False,
            },
        ),
        migrations.CreateModel(
            name='Effect',
            fields=[
                ('id', models.BigIntegerField(primary_key=True, serialize=False)),
                ('effect_key', models.TextField(unique=True)),
                ('kind', models.TextField()),
                ('payload', models.JSONField()),
                ('headers', models.JSONField(default=dict)),
                ('ordering_key', models.TextField(blank=True, null=True)),
                ('queue', models.TextField(default='default')),
                ('status', models.TextField(choices=[
                    ('pending', 'pending'), ('in_flight', 'in flight'),
                    ('delivered', 'delivered'), ('failed', 'failed'),
                    ('cancelled', 'cancelled'), ('needs_review', 'needs review')],
                    default='pending')),
                ('attempts', models.IntegerField(default=0)),
                ('max_attempts', models.IntegerField(default=25)),
                ('available_at', models.DateTimeField()),
                ('retry_until', models.DateTimeField(blank=True, null=True)),
                ('lease_owner', models.TextField(blank=True, null=True)),
                ('lease_token', models.UUIDField(blank=True, null=True)),
                ('lease_expires_at', models.DateTimeField(blank=True, null=True)),
                ('created_at', models.DateTimeField()),
                ('delivered_at', models.DateTimeField(blank=True, null=True)),
                ('finished_at', models.DateTimeField(blank=True, null=True)),
                ('last_error', models.TextField(blank=True, null=True)),
                ('result', models.JSONField(blank=True, null=True)),
            ],
            options={
                'verbose_name': 'effect',
                'db_table': '"outbox"."effects"',
                'ordering': ('-id',),
                'managed': False,
            },
        ),
        migrations.CreateModel(
            name='IdempotencyKey',
            fields=[
                ('generation', models.UUIDField(primary_key=True, serialize=False)),
                ('scope', models.TextField()),
                ('key', models.TextField()),
                ('fingerprint', models.TextField()),
                ('status', models.TextField(choices=[
                    ('processing', 'processing'), ('completed', 'completed')])),
                ('lock_token', models.UUIDField(blank=True, null=True)),
                ('locked_at', models.DateTimeField(blank=True, null=True)),
                ('lock_expires_at', models.DateTimeField(blank=True, null=True)),
                ('response_status', models.IntegerField(blank=True, null=True)),
                ('response_headers', models.JSONField(blank=True, null=True)),
                ('response_body', models.BinaryField(blank=True, null=True)),
                ('created_at', models.DateTimeField()),
                ('completed_at', models.DateTimeField(blank=True, null=True)),
                ('expires_at', models.DateTimeField()),
            ],
            options={
                'verbose_name': 'idempotency key',
                'db_table': '"outbox"."idempotency_keys"',
                'ordering': ('-created_at',),
                'managed': False,
            },
        ),
    ]
