"""The disk tier's files: one file per KV block, checksummed, written atomically.

Folder: ``<kv_offload_disk_dir>/<model identity, 64 hex digits>/``. Block files are named
``<block hash, 64 hex digits>.kvb``. A file is written as ``.tmp-<hash hex>-<pid>-<n>`` and
renamed into place, so a reader never sees a partial file under a block's name. There is no
fsync: after a power loss a renamed file may hold garbage, which its checksum turns into a
miss.

File format (little-endian; sizes in bytes)::

    off  size  field
      0     8  magic          b"KSTRKVB\\x01"
      8     4  u32 version    1
     12     4  u32 header     header size (96): offset of the payload
     16    32  model identity shared.hashing.model_identity_hash
     48    32  block hash     the block's chained name (equals the file name)
     80     8  u64 length     payload length (the store's block_bytes)
     88     4  u32 crc32      zlib.crc32 of the payload
     92     4  u32 header crc zlib.crc32 of bytes 0..91
     96     -  payload        `length` bytes: the block exactly as it sat in its pool slot

crc32 detects truncation, torn writes and bit flips (not tampering: the folder is trusted).
A file whose size, magic, version, identity, hash, length or checksums are wrong is corrupt:
reading it raises `CorruptBlock` after removing it, and the store treats it as a miss.

Startup (`scan`): in this model's folder, temporary files (left by a crash) and corrupt
headers are removed; payload checksums are checked on every read, not at startup. The
folders of other model identities are left untouched: they belong to other models, do not
count against this store's size limit, and are for the operator to remove.
"""

from __future__ import annotations

import itertools
import os
import struct
import zlib

MAGIC = b"KSTRKVB\x01"
VERSION = 1
HEADER = struct.Struct("<8sII32s32sQII")   # 96 bytes
SUFFIX = ".kvb"
TMP_PREFIX = ".tmp-"
_counter = itertools.count()


class CorruptBlock(Exception):
    """A block file failed validation (it has been removed); treat as a miss."""


def file_bytes(block_bytes: int) -> int:
    """Bytes on disk of one block file: header + payload."""
    return HEADER.size + block_bytes


def encode_header(identity: bytes, block_hash: bytes, payload) -> bytes:
    """The 96-byte header of a block file for `payload` (bytes-like)."""
    head = HEADER.pack(MAGIC, VERSION, HEADER.size, identity, block_hash, len(payload),
                       zlib.crc32(payload), 0)
    return head[:92] + struct.pack("<I", zlib.crc32(head[:92]))


def _parse_header(raw: bytes, identity: bytes, block_hash: bytes | None, length: int,
                  where: str) -> int:
    """Validate a header; returns the payload crc. Raises CorruptBlock."""
    if len(raw) < HEADER.size:
        raise CorruptBlock(f"{where}: truncated header ({len(raw)} bytes)")
    magic, ver, hsize, ident, bhash, plen, crc, hcrc = HEADER.unpack(raw[:HEADER.size])
    if magic != MAGIC or ver != VERSION or hsize != HEADER.size:
        raise CorruptBlock(f"{where}: bad magic/version ({magic!r}, {ver})")
    if zlib.crc32(raw[:92]) != hcrc:
        raise CorruptBlock(f"{where}: header checksum mismatch")
    if ident != identity:
        raise CorruptBlock(f"{where}: model identity {ident.hex()[:16]}.. is not this store's")
    if block_hash is not None and bhash != block_hash:
        raise CorruptBlock(f"{where}: block hash does not match the file name")
    if plen != length:
        raise CorruptBlock(f"{where}: payload length {plen}, expected {length}")
    return crc


class DiskTier:
    """File I/O of one model's block folder. Thread-safe (no shared mutable state).

    root: kv_offload_disk_dir; identity: 32-byte model identity; block_bytes: payload size.
    The index and the size limit live in `services.kvstore.store` (this class never decides
    what to keep).
    """

    def __init__(self, root: str, identity: bytes, block_bytes: int):
        self.identity, self.block_bytes = identity, block_bytes
        self.folder = os.path.join(root, identity.hex())
        self.file_bytes = file_bytes(block_bytes)

    def path(self, block_hash: bytes) -> str:
        """The file of a block (it may not exist)."""
        return os.path.join(self.folder, block_hash.hex() + SUFFIX)

    def scan(self) -> list[tuple[bytes, float]]:
        """(block hash, mtime in seconds) of every valid-looking block file, oldest first.

        Creates the folder if missing. Removes temporaries and files whose name, size or
        header is wrong. Raises OSError if the folder cannot be created or listed.
        """
        os.makedirs(self.folder, mode=0o700, exist_ok=True)
        out = []
        for name in os.listdir(self.folder):
            path = os.path.join(self.folder, name)
            try:
                if name.startswith(TMP_PREFIX):
                    os.unlink(path)
                    continue
                stem = name[:-len(SUFFIX)] if name.endswith(SUFFIX) else ""
                try:
                    bhash = bytes.fromhex(stem)
                except ValueError:
                    bhash = b""
                if len(bhash) != 32:
                    continue   # not ours: never touched
                st = os.stat(path)
                if st.st_size != self.file_bytes:
                    raise CorruptBlock(f"{path}: {st.st_size} bytes, expected {self.file_bytes}")
                with open(path, "rb") as fh:
                    _parse_header(fh.read(HEADER.size), self.identity, bhash, self.block_bytes, path)
                out.append((bhash, st.st_mtime))
            except CorruptBlock:
                _unlink(path)
            except FileNotFoundError:
                continue
        out.sort(key=lambda t: t[1])
        return out

    def write(self, block_hash: bytes, payload) -> None:
        """Write one block file atomically (temp name, then rename). Raises OSError (the
        temporary is removed) and ValueError for a payload of the wrong length."""
        if len(payload) != self.block_bytes:
            raise ValueError(f"payload of {len(payload)} bytes, expected {self.block_bytes}")
        tmp = os.path.join(self.folder, f"{TMP_PREFIX}{block_hash.hex()}-{os.getpid()}-{next(_counter)}")
        try:
            with open(tmp, "wb") as fh:
                fh.write(encode_header(self.identity, block_hash, payload))
                fh.write(payload)
            os.rename(tmp, self.path(block_hash))
        except BaseException:
            _unlink(tmp)
            raise

    def read_into(self, block_hash: bytes, out: memoryview) -> None:
        """Read a block's payload into `out` (block_bytes bytes, e.g. a pool slot).

        Raises CorruptBlock (after removing the file) when it fails validation, and
        FileNotFoundError when it is gone. Touches the file's mtime (LRU across restarts).
        """
        path = self.path(block_hash)
        with open(path, "rb") as fh:
            head = fh.read(HEADER.size)
            try:
                crc = _parse_header(head, self.identity, block_hash, self.block_bytes, path)
                n = fh.readinto(out)
                if n != self.block_bytes or fh.read(1):
                    raise CorruptBlock(f"{path}: payload of {n} bytes, expected {self.block_bytes}")
                if zlib.crc32(out) != crc:
                    raise CorruptBlock(f"{path}: payload checksum mismatch")
            except CorruptBlock:
                _unlink(path)
                raise
        try:
            os.utime(path)
        except OSError:
            pass

    def remove(self, block_hash: bytes) -> None:
        """Delete a block's file (missing is fine)."""
        _unlink(self.path(block_hash))


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
