"""A signature path next to an archive that is there but is not a regular file.

Bug caught: `check_signature` said "unsigned (no a.zip.sig next to the archive)" when a
directory or FIFO stood at that path, sending the user to look for a file that was plainly
there. Now it says the thing there is not a regular file (still unsigned: nothing is read)."""

from __future__ import annotations

import os

import pytest

from packbench.core.provenance import check_signature


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_signature_path_that_is_not_a_file_says_so(tmp_path, kind):
    sig = tmp_path / "a.zip.sig"
    sig.mkdir() if kind == "directory" else os.mkfifo(sig)
    check = check_signature(sig, archive_sha256="0" * 64, manifest_sha256=None, trusted=[b"\0" * 32])
    assert check.status == "unsigned" and not check.valid
    assert check.line == ("signature: unsigned (a.zip.sig next to the archive is not a regular file; "
                          "put the .sig file the signer wrote there)")


def test_a_missing_signature_is_still_named_missing(tmp_path):
    check = check_signature(tmp_path / "a.zip.sig", archive_sha256="0" * 64, manifest_sha256=None, trusted=[])
    assert check.line == "signature: unsigned (no a.zip.sig next to the archive)"
