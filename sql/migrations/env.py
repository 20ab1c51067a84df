"""Alembic environment for the FlexPipe store.

Run programmatically by :func:`sql.engine.migrate` (a connection is passed in
``config.attributes["connection"]``) or from the command line::

    alembic -c sql/alembic.ini upgrade head     # uses FLEXPIPE_DATABASE_URL or the SQLite default
"""

from alembic import context
from sqlalchemy import create_engine

from flexpipe_dag.core.settings import database_url
from flexpipe_dag.sql.models import Base

config = context.config
target_metadata = Base.metadata


def _configure(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",  # SQLite needs batch ALTERs
        compare_type=True,
    )


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = create_engine(config.get_main_option("sqlalchemy.url") or database_url())
    with engine.connect() as conn:
        _configure(conn)
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    context.configure(url=config.get_main_option("sqlalchemy.url") or database_url(),
                      target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    run_migrations_online()
