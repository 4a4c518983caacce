"""What can be wrong with a raw archive: ``Problem`` (what ``verify`` finds) and the reader's
internal member error. Pure."""

from __future__ import annotations

from dataclasses import dataclass

# What verify() can find. Every kind but "too-large" (the archive as a whole) names a member:
# the one that is missing, extra, altered, unreadable, unsafe, duplicated, a symlink or of the
# wrong size; "incomplete" and "manifest" name manifest.json.
PROBLEM_KINDS = ("incomplete", "manifest", "too-large", "duplicate", "unsafe", "symlink", "extra", "size",
                 "unreadable", "altered", "missing", "layout")


@dataclass(frozen=True)
class Problem:
    """One finding of ``ArchiveReader.verify``.

    ``member`` is the name exactly as the zip entry or the manifest holds it (None only for
    "too-large"); ``message`` is the one printable line packbench has always printed for it
    (audit digests cover it, so its text never changes).
    """

    member: str | None
    kind: str
    message: str

    def __post_init__(self) -> None:
        if self.kind not in PROBLEM_KINDS:
            raise ValueError(f"problem kind {self.kind!r} is not one of {', '.join(PROBLEM_KINDS)}")

    def __str__(self) -> str:
        return self.message


class MemberError(Exception):
    """Internal: a member could not be read.

    ``phrase`` is a verb phrase completing "member NAME ...", ``cause`` the short cause used in
    verify()'s "unreadable member NAME: cause" line, ``fix`` the advice.
    """

    def __init__(self, name: str, phrase: str, fix: str, cause: str | None = None):
        super().__init__(phrase)
        self.name = name
        self.phrase = phrase
        self.fix = fix
        self.cause = cause if cause is not None else phrase
