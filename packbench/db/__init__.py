"""The packbench database: SQLAlchemy models, Alembic migrations and the `Store`.

The only package (with `migrations/`) that imports SQLAlchemy or Alembic. Everything it
returns is plain data (`db.records`); every error it raises is a `core.errors.PackbenchError`.
"""
