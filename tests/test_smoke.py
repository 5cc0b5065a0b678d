from sqlalchemy import Engine, text


def test_migrated(engine: Engine) -> None:
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM outbox.effects")).scalar_one() == 0
