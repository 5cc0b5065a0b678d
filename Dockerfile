# One image for every app service in docker-compose.yml (migrate, api, worker, beat,
# psp): the package installed with pip, its commands on PATH (`outbox`, `celery`).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# Dependencies first (cached while only the code changes): the metadata alone is
# enough for pip to resolve them, then the real install below is quick.
COPY pyproject.toml README.md ./
RUN python -c "import tomllib; print('\\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > /tmp/requirements.txt
RUN pip install -r /tmp/requirements.txt

COPY outbox ./outbox
COPY dispatcher ./dispatcher
COPY examples ./examples
COPY migrations ./migrations
RUN pip install --no-deps . \
    && useradd --create-home --uid 10001 outbox \
    && chown outbox:outbox /app

# Not root. /app is writable for `celery beat`'s schedule file.
USER outbox

EXPOSE 8000 8081
CMD ["outbox", "--help"]
