"""A packbench MoE checkpoint as a GGUF file for llama.cpp (bench/llamacpp_device.sh).

  python -m bench.llamacpp_gguf --model DIR --llama SRC --out FILE.gguf [--outtype f16]

packbench's synthetic checkpoints hold config.json and safetensors, no tokenizer; llama.cpp's
`convert_hf_to_gguf.py` needs one. This writes a beside-folder of links to the checkpoint's files
(the checkpoint itself is not touched: its content digest is what protocols pin) plus a 256-piece
SentencePiece `tokenizer.model` trained here on random letters; the converter pads the vocabulary
to config.json's `vocab_size` with `[PAD]` tokens, so every id the model knows is a token
(llama-bench feeds random ids; no text is tokenized). Mixtral's converter takes the SentencePiece
path by itself; Qwen3-MoE's and OLMoE's go to the GPT-2 BPE path, which identifies a tokenizer's
pre-tokenizer by a hash of its output and refuses an unknown one ("BPE pre-tokenizer was not
recognized"), so they are pointed at the SentencePiece path instead (`set_vocab`). The weights
convert as the converter converts them; nothing else is changed.

Needs `sentencepiece`, torch, numpy and llama.cpp's own `gguf-py` (taken from SRC).
"""

from __future__ import annotations

import argparse
import io
import random
import runpy
import sys
from pathlib import Path

PIECES = 256


def write_tokenizer(path: Path, *, seed: int = 0) -> None:
    """A SentencePiece BPE model of at most PIECES pieces (unk 0, bos 1, eos 2) at `path`."""
    import sentencepiece as spm

    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    lines = [" ".join("".join(rng.choice(letters) for _ in range(rng.randint(1, 8))) for _ in range(20))
             for _ in range(2000)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=PIECES,
                                   model_type="bpe", hard_vocab_limit=False, unk_id=0, bos_id=1, eos_id=2,
                                   minloglevel=2)
    path.write_bytes(model.getvalue())


def beside(model: Path, out: Path) -> Path:
    """`out`: links to every file of checkpoint `model`, and a tokenizer.model."""
    out.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        link = out / f.name
        if f.is_file() and not link.exists():
            link.symlink_to(f.resolve())
    write_tokenizer(out / "tokenizer.model")
    return out


def convert(model: Path, *, llama: Path, out: Path, outtype: str) -> None:
    """Run llama.cpp's converter in this process on the tokenized beside-folder of `model`."""
    src = beside(model, out.with_suffix(".hf"))
    script = llama / "convert_hf_to_gguf.py"
    sys.path[:0] = [str(llama), str(llama / "gguf-py")]
    from conversion.base import TextModel  # llama.cpp's converter package, from SRC

    TextModel.set_vocab = lambda self: self._set_vocab_sentencepiece()  # module docstring
    sys.argv = [str(script), str(src), "--outtype", outtype, "--outfile", str(out)]
    runpy.run_path(str(script), run_name="__main__")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--llama", type=Path, required=True, help="llama.cpp's source folder")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--outtype", default="f16")
    a = ap.parse_args(argv)
    convert(a.model, llama=a.llama, out=a.out, outtype=a.outtype)


if __name__ == "__main__":
    main()
