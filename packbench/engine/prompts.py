"""Text prompts (a protocol's text_file) encoded by the checkpoint's own tokenizer, offline."""

from collections.abc import Callable
from pathlib import Path

from packbench.core.errors import CheckpointError

# The files a Hugging Face tokenizer is loaded from: any one set of them will do. Without any,
# AutoTokenizer still "loads" from config.json alone and encodes every text to zero tokens
# (seen with transformers on a synthetic checkpoint), so the files are checked first.
TOKENIZER_FILES: tuple[tuple[str, ...], ...] = (
    ("tokenizer.json",),
    ("vocab.json", "merges.txt"),  # byte-level BPE: OPT, GPT-2
    ("tokenizer.model",),  # SentencePiece
    ("vocab.txt",),  # WordPiece
)


def _fix(model_dir: Path) -> str:
    return (f"copy the model's tokenizer files (tokenizer.json, or vocab.json + merges.txt) into {model_dir}, "
            f"or give the prompts as token ids (prompts.token_file or prompts.token_ids)")


def tokenizer_for(model_dir: Path) -> Callable[[list[str]], list[list[int]]]:
    """texts -> token-id lists with the tokenizer files in `model_dir` (never downloads).

    Pass the result as `tokenize` to core.plan.prompts. OPT's tokenizer starts every text with
    BOS (</s>, id 2), as the model saw in training. Raises CheckpointError, in one line naming
    the missing files and the fix, when `model_dir` has no tokenizer (a synthetic checkpoint
    has none) or its tokenizer encodes a text to no tokens.
    """
    model_dir = Path(model_dir)
    if not any(all((model_dir / name).is_file() for name in names) for names in TOKENIZER_FILES):
        synthetic = " (a synthetic checkpoint has none)" if (model_dir / "config.json").is_file() else ""
        raise CheckpointError(
            f"text_file prompts need the checkpoint's tokenizer, and {model_dir} has no tokenizer files{synthetic}: "
            f"no tokenizer.json, vocab.json + merges.txt, tokenizer.model or vocab.txt; {_fix(model_dir)}"
        )
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as e:
        cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{model_dir} has no usable tokenizer ({cause}); text_file prompts need the checkpoint's "
            f"tokenizer files (tokenizer.json, or vocab.json + merges.txt); or write token ids to a token_file"
        ) from None

    def encode(texts: list[str]) -> list[list[int]]:
        out = [list(tok(text)["input_ids"]) for text in texts]
        for i, (text, ids) in enumerate(zip(texts, out)):
            if text.strip() and not ids:
                raise CheckpointError(f"the tokenizer in {model_dir} encodes text prompt {i} to no tokens "
                                      f"(a tokenizer without a vocabulary?); {_fix(model_dir)}")
        return out

    return encode
