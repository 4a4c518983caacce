"""The words for an archive over an audit bound, shared by the reader, verify and the plan's estimate."""

from __future__ import annotations

from pathlib import Path


def mib_to_admit(size: int) -> int:
    """The smallest `packbench audit --max-mib N` whose bounds admit `size` bytes (whole MiB, up)."""
    return max(1, -(-int(size) // (1 << 20)))


def over_bound_line(path: Path | str, size: int, bound: int, *, what: str = "is", target: str | None = None,
                    admit: int | None = None) -> str:
    """One line for an archive over an audit bound: its size, the bound, and the fix (`--max-mib`
    admitting `admit` bytes, default `size`, for an archive the user trusts). `target` is what
    `packbench audit` takes (a screen id; default `archive PATH`)."""
    target = target or f"archive {path}"
    return (f"{path} {what} {_bytes(size)}, over the audit bound of {_bytes(bound)}, so it was not read; only for "
            f"an archive you trust, audit it with `packbench audit {target} --max-mib {mib_to_admit(size if admit is None else admit)}`")


def _bytes(n: int) -> str:
    """`10193506778 bytes (9721.3 MiB)`, `1073741824 bytes (1024 MiB)`, `6941 bytes`."""
    if n < 1 << 20:
        return f"{n} bytes"
    return f"{n} bytes ({n >> 20} MiB)" if n % (1 << 20) == 0 else f"{n} bytes ({n / (1 << 20):.1f} MiB)"
