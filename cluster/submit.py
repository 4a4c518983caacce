"""Submitting: freeze a protocol, check its model exists, store it and queue a screen."""

from pathlib import Path

from cluster.screen import submitter
from core import protocol as protocol_mod
from core.errors import ProtocolError
from core.plan import prompts
from engine.checkpoint import read_config


def enqueue(store, path: Path) -> int:
    """Validate and freeze `path`, store the protocol (idempotent) and queue a new screen.

    Everything that can be checked before a worker is asked for is checked here: the model
    directory exists and is an OPT checkpoint, prompt ids lie inside its vocabulary.
    """
    frozen = protocol_mod.load(path)
    model_dir = frozen.model_dir()
    config = read_config(model_dir)
    try:
        prompts(frozen.body, vocab=config["vocab_size"])
    except ValueError as e:
        raise ProtocolError(f"protocol field `prompts`: {e}") from None
    protocol_id = store.put_protocol(sha256=frozen.sha256, name=frozen.name, canonical_json=frozen.canonical.decode())
    return store.create_screen(protocol_id=protocol_id, submitter=submitter(), model_dir=str(model_dir))
