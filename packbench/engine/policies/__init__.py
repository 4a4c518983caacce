"""Loader policies: how each layer's outgoing FFN weight reaches the device for a call.

Every policy hands `OutgoingLinear` a device weight in the ORIGINAL layout (hidden, ffn), and
the layer multiplies with the ordinary dense `F.linear`, exactly as stock OPT's fc2 does; rows a
policy did not refresh are finite and meet exact zeros, so logits are bit-identical to
streaming everything (`base`).

Modules, by family: `base` (the host weights, the `LoaderPolicy` protocol, the shared pieces,
`OutgoingLinear`), `dense` (resident, dense-stream), `host_gather` (the policies that read a
mask back and gather on the host), `device_gather` (the policies whose device gathers its own
rows), `int8` (dense-stream and packet over int8 weight-only outgoing rows). Each policy holds
its buffers in one object made in `activate` and dropped in `deactivate`. Import a name from
the module that defines it; which policy a condition kind builds is its runtime's business
(engine/conditions/, `RUNTIMES`, `POLICIES`).
"""
