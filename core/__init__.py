"""Pure-Python science of packbench: protocols, plans, gates, raw archives and the auditor.

Nothing here imports ray, sqlalchemy or torch, so every decision is testable in milliseconds.
"""
