"""Use cases: one function per thing a user does (submit, run a screen, audit), in one place.

The CLI, the benchmarks and the tests call these. Layer rules: this package imports `core`
freely, reaches the database only through a `db.store.Store` it is given, and reaches Ray only
through `cluster` (imported inside the functions that need it, so `packbench submit` never
imports ray or torch). It never imports sqlalchemy, ray or torch itself.
"""
