"""Alembic environment and revisions for the packbench schema.

This package is data as much as code: `db.migrate` points Alembic's `script_location` at
this directory (`env.py`, `script.py.mako`, `versions/*.py`), so it must ship in the wheel.
Nothing here is imported by the application except through Alembic.
"""
