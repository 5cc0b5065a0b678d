# One image for every app service in docker-compose.yml (migrate, api, worker, beat,
# psp), built from uv.lock: the versions the tests ran, nothing resolved at build time
# (`--locked` fails the build if uv.lock is stale). Every base is pinned to an exact
# version tag. Two stages: uv installs the project into /app/.venv (not editable, so
# the virtualenv stands alone); the runtime stage copies only that virtualenv, with no
# uv, no compiler, no sources, and runs as a non-root user.

FROM ghcr.io/astral-sh/uv:0.13.9 AS uv

FROM python:3.11.14-slim-bookworm AS build
COPY --from=uv /uv /usr/local/bin/uv
ENV UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy \
    UV_PYTHON_DOWNLOADS=never \
    UV_PYTHON=/usr/local/bin/python3.11 \
    UV_PROJECT_ENVIRONMENT=/app/.venv
WORKDIR /src

# Dependencies first (cached while only the code changes), exactly as locked.
COPY pyproject.toml uv.lock README.md ./
RUN uv sync --locked --no-dev --no-install-project

COPY outbox ./outbox
COPY dispatcher ./dispatcher
COPY migrations ./migrations
RUN uv sync --locked --no-dev --no-editable

FROM python:3.11.14-slim-bookworm
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/app/.venv/bin:$PATH
RUN useradd --create-home --uid 10001 outbox
COPY --from=build /app/.venv /app/.venv
WORKDIR /app
# Not root. /app is writable for `celery beat`'s schedule file.
RUN chown outbox:outbox /app
USER outbox

EXPOSE 8000
CMD ["outbox", "--help"]
