"""Submitting: freeze a protocol, check its model and prompts, store it and queue a screen."""

import getpass
from pathlib import Path

from cluster.screen import screen_prompts
from core import protocol as protocol_mod
from core.errors import ProtocolError
from engine.checkpoint import read_config
from engine.shapes import SHAPES


def enqueue(store, path: Path) -> int:
    """Validate and freeze `path`, store the protocol (idempotent) and queue a new screen.

    Everything that can be checked before a worker is asked for is checked here: the model
    directory exists and is an OPT checkpoint (a synthetic model is generated on the worker),
    the prompt file matches its frozen hash, prompt ids lie inside the vocabulary.
    """
    frozen = protocol_mod.load(path)
    model_dir = frozen.model_dir()
    if model_dir is None:
        vocab = SHAPES[frozen.body["model"]["synth"]["shape"]]["vocab"]
    else:
        vocab = read_config(model_dir)["vocab_size"]
    prompt_file = frozen.prompt_file()
    try:
        screen_prompts(frozen.body, vocab=vocab, model_dir=model_dir, prompt_file=prompt_file)
    except ValueError as e:
        raise ProtocolError(f"protocol field `prompts`: {e}") from None
    protocol_id = store.put_protocol(sha256=frozen.sha256, name=frozen.name, canonical_json=frozen.canonical.decode())
    return store.create_screen(protocol_id=protocol_id, submitter=submitter(),
                               model_dir=None if model_dir is None else str(model_dir),
                               prompt_file=None if prompt_file is None else str(prompt_file))


def submitter() -> str:
    """Who queued the screen, as the operating system names them."""
    try:
        return getpass.getuser()
    except Exception:  # no user name in some containers
        return "unknown"
