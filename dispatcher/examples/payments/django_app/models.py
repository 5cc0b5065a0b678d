"""The example's `payments.payments` table (dispatcher/examples/payments/schema.py creates it)."""

from __future__ import annotations

from django.db import models


class Payment(models.Model):
    id = models.BigAutoField(primary_key=True)  # GENERATED ALWAYS AS IDENTITY
    amount = models.BigIntegerField()
    currency = models.TextField()
    customer = models.TextField()
    status = models.TextField(default="pending")
    idempotency_key = models.TextField(null=True)
    owner = models.TextField(null=True)

    class Meta:
        managed = False
        db_table = '"payments"."payments"'

    def as_json(self) -> dict[str, object]:
        """The answer's fields, in the FastAPI example's order."""
        return {"id": self.id, "amount": self.amount, "currency": self.currency,
                "customer": self.customer, "status": self.status}
