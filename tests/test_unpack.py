"""transfer/unpack.py: a tar stream unpacked as it arrives, from a pipe read forward only."""

import hashlib
import io
import os
import tarfile

from orchestrator.transfer.unpack import Unpacker


def _tar(members, fmt=tarfile.PAX_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_every_file_lands_with_its_digest_whatever_the_sizes_names_and_pieces(tmp_path):
    long_dir = "node-runs/" + "k" * 120 + "@node1"  # past ustar's 100 bytes: a pax header first
    files = {"a/empty": b"", "a/block": os.urandom(512), "a/odd": os.urandom(1_000_003),
             f"{long_dir}/log": b"line\n" * 1000, "b/c/d/last": os.urandom(70_000)}
    members = [("a", None)] + list(files.items())
    for fmt in (tarfile.PAX_FORMAT, tarfile.GNU_FORMAT):
        dest = tmp_path / str(fmt)
        dest.mkdir()
        u = Unpacker(dest, checksums=True)
        data = _tar(members, fmt)
        for i in range(0, len(data), 4093):
            u.feed(data[i:i + 4093])
        assert u.close() is None
        for name, body in files.items():
            assert (dest / name).read_bytes() == body, name
            assert u.digests[dest / name] == hashlib.sha256(body).hexdigest()
        assert (u.files, u.bytes, u.stream_bytes) == (len(files), sum(map(len, files.values())), len(data))


def test_a_stream_cut_inside_a_file_or_between_headers_is_an_error_not_a_short_file(tmp_path):
    data = _tar([("x", os.urandom(300_000)), ("y", b"after")])
    for cut in (100, 512 + 150_000, len(data) - 2048 + 100):
        dest = tmp_path / f"cut{cut}"
        dest.mkdir()
        u = Unpacker(dest)
        u.feed(data[:cut])
        if cut < len(data) - 2048:
            assert u.close() is not None, cut
        else:  # only the end-of-archive blocks are missing: every file is whole
            assert u.close() is None and (dest / "y").read_bytes() == b"after"
