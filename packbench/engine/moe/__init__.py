"""Mixture-of-Experts models, CPU-first: each layer's experts stay in host memory and a loader
policy decides, per call and layer, which experts move to the device (docs/engine.md, "MoE").

`families` (what a transformers MoE family is called and where its experts live), `host`
(the experts in host memory), `policies` (resident, dense-stream, expert packet,
phase-switched at expert granularity), `model` (`CpuFirstMoE`), `synth` (routing-calibrated
synthetic checkpoints) and `stats` (routing traces for `packbench model stats`).

Layer rule: engine. Imports torch and transformers, never ray or sqlalchemy.
"""
