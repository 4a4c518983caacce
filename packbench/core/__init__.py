"""packbench's science and evidence: protocols, plans, gates, the raw archive and the auditor.

Nothing here imports ray, sqlalchemy or torch, and nothing here imports another packbench
package: the screen driver (service), the worker (engine) and an auditor on any node share it
with numpy, yaml and the standard library alone. That is why the archive's writer and reader
live here, below both service and engine, though they do file I/O.

Pure (values in, values out; testable in milliseconds): ``canonical``, ``dispersion``,
``dates``, ``errors``, ``estimate``, ``fidelity``, ``gates``, ``metrics``, ``passes``, ``record``, ``registry``, ``serving``,
``text``, ``workloads``; ``archive.layout`` / ``archive.zipformat`` / ``archive.problems``;
``protocol`` but for ``freeze.load`` and ``prompt_files``; ``plan`` for generator and inline
prompts; ``reexecute``'s draw and comparisons.

File and process I/O, each at one edge:

- reads files: ``archive.reader`` / ``archive.verify`` (bounded, never extracting),
  ``audit.audit_archive``, ``reexecute.read_archived`` / ``read_logits``,
  ``report.read_screen``, ``protocol.freeze.load`` and ``protocol.prompt_files`` (the YAML
  and prompt files), ``plan.prompts`` of file prompts;
- writes files: ``archive.writer`` (pwritev + fsync per episode: evidence before the
  database row), ``provenance`` (signing keys and detached signatures; it imports
  ``cryptography`` inside the functions that sign or check, so nothing else pays for it; its
  ``checkpoint_digest`` reads a checkpoint directory);
- reads the process environment or runs a process: ``settings`` (``os.environ``, read once by
  the CLI), ``source`` (hashes the engine's and core's sources and asks ``git`` which commit
  made them: a screen's source freeze).
"""
