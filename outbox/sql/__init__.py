"""Every SQL statement of the project, named by what it does.

One module per table family: `keys` (idempotency keys), `effects` (enqueue, inspect,
repair, purge), `dispatch` (claim, lease, record outcomes) and `inbox` (ingestion).
Nothing outside this package writes SQL. Each statement takes an optional `now`
parameter: `coalesce(:now, now())` keeps the database clock authoritative while
letting tests inject a time (River's `@now`).
"""
