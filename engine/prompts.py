"""Text prompts (a protocol's text_file) encoded by the checkpoint's own tokenizer, offline."""

from collections.abc import Callable
from pathlib import Path

from core.errors import CheckpointError


def tokenizer_for(model_dir: Path) -> Callable[[list[str]], list[list[int]]]:
    """texts -> token-id lists with the tokenizer files in `model_dir` (never downloads).

    Pass the result as `tokenize` to core.plan.prompts. OPT's tokenizer starts every text with
    BOS (</s>, id 2), as the model saw in training.
    """
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as e:
        cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{model_dir} has no usable tokenizer ({cause}); text_file prompts need the checkpoint's "
            f"tokenizer files (tokenizer.json, or vocab.json + merges.txt); or write token ids to a token_file"
        ) from None
    return lambda texts: [list(tok(text)["input_ids"]) for text in texts]
