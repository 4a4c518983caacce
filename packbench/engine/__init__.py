"""torch + transformers side of packbench: CPU-first OPT, loader policies, ledger, episodes."""
