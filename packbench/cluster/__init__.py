"""Ray side of packbench: the only package that imports ray.

Layer rules: imports `core` and (inside the worker actor) `engine`; never `service`, `db` or
`cli`. It offers transports that use cases are handed: `pool.RayPool` (the dispatcher's
`WorkerPool`), audit and re-execution fan-out (`audit`, `reexecute`).
"""
