"""Alembic environment for the FlexPipe store.

Run programmatically by :mod:`flexpipe_dag.sql.schema` (a connection in its migration transaction is
passed in ``config.attributes["connection"]``) or from the command line::

    alembic -c sql/alembic.ini upgrade head     # uses FLEXPIPE_DATABASE_URL or the SQLite default
    alembic -c sql/alembic.ini downgrade 0006   # refused when it would drop data (-x force=1 before
                                                # the command drops it)

The command line gets the same guarantees as ``flexpipe store``: one transaction, the cross-process
migration lock, and a downgrade that names what it would drop and refuses unless forced.
"""

from alembic import context
from alembic.util import CommandError

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
    from flexpipe_dag.sql.engine import make_engine
    from flexpipe_dag.sql.schema import downgrade_losses, migration_transaction

    engine = make_engine(config.get_main_option("sqlalchemy.url") or database_url())
    cmd = getattr(config.cmd_opts, "cmd", None)
    with migration_transaction(engine) as conn:
        if cmd and cmd[0].__name__ == "downgrade" and context.get_x_argument(as_dictionary=True).get("force") != "1":
            target = config.cmd_opts.revision  # type: ignore[union-attr]
            losses = downgrade_losses(conn, target)
            if losses:
                raise CommandError(f"downgrade to {target} would drop data: {'; '.join(losses)}; "
                                   "run `alembic -x force=1 downgrade ...` to drop it")
        _configure(conn)
        context.run_migrations()


if context.is_offline_mode():
    context.configure(url=config.get_main_option("sqlalchemy.url") or database_url(),
                      target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    run_migrations_online()
