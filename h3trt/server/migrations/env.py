"""Alembic's environment for the job store: the caller (store.migrate) hands over an open connection."""

from alembic import context

from h3trt.server.store import metadata

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=metadata, render_as_batch=connection.dialect.name == "sqlite")
with context.begin_transaction():
    context.run_migrations()
