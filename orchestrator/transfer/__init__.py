"""Moving a tree of files to every node: what is shipped (files), the tar stream (archive), the
node-to-node relay (chain) and progress in bytes (progress).

One result per node (`SyncResult`) and one for the whole push (`SyncReport`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SyncResult:
    node: str
    method: str  # relay | tar | rsync | skip
    ok: bool
    detail: str  # what was done, or why it failed
    bytes: int = 0  # bytes of the stream (or of the files rsync sent) that reached the node
    seconds: float = 0.0
    files: int = 0  # files (and links) written on the node, when it reports them

    @property
    def error(self) -> str | None:
        return None if self.ok else self.detail

    def to_json(self) -> dict:
        return {"name": self.node, "ok": self.ok, "method": self.method, "bytes": self.bytes,
                "seconds": round(self.seconds, 3), "error": self.error}


@dataclass(frozen=True)
class SyncReport:
    results: list[SyncResult]  # one per inventory node, rank order
    seconds: float
    tree_bytes: int  # size of the files shipped
    files: int
    bytes_sent: int  # bytes that left this machine (tar streams + what rsync reported sending)
    notes: list[str] = field(default_factory=list)  # fallbacks and method choices, one line each

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    def to_json(self) -> dict:
        return {"ok": self.ok, "seconds": round(self.seconds, 3), "files": self.files,
                "tree_bytes": self.tree_bytes, "bytes_sent": self.bytes_sent, "notes": self.notes,
                "nodes": [r.to_json() for r in self.results]}
