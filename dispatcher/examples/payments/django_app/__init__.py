"""The example payments service in Django REST framework (DESIGN §8).

The same routes and answers as the FastAPI example (dispatcher/examples/payments/app.py), so a
client or test written for one works against the other unchanged:
`outbox example-api --framework django [--host H] [--port P]` (serve.py) runs it under
uvicorn (ASGI). The views (views.py) use `outbox.contrib.django`: `@idempotent` for
`POST /payments`, Django's ORM and `enqueue(connection, ...)` in the view's
transaction. Auth (auth.py) and webhook signatures reuse the FastAPI example's
`EXAMPLE_API_TOKENS` and `EXAMPLE_WEBHOOK_SECRETS` handling.
"""
