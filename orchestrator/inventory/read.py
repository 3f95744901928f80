"""The inventory's bytes, text and YAML tree, each bounded before it is built (see load.py for
what is refused and why): a FIFO never blocks, an alias bomb costs what its bytes cost."""

from __future__ import annotations

import errno
import os
import re
import stat
import unicodedata
from pathlib import Path
from typing import Any

import yaml

from orchestrator.errors import InventoryError
from orchestrator.inventory.fields import excerpt
from orchestrator.inventory.models import MAX_NODES

MAX_BYTES = 1 << 20
MAX_DEPTH = 32
MAX_YAML_NODES = 200_000
MAX_ALIASES = 10_000
MAX_EXPANDED_BYTES = 4 << 20  # the text of every value, aliases expanded: what the models would hold
MAX_VALUE_BYTES = 128 << 10  # one value (Linux's MAX_ARG_STRLEN: no longer one reaches a node's command line)
MAX_ERRORS_SHOWN = 10

LIMITS = (f"an inventory is at most {MAX_BYTES >> 20} MiB, {MAX_DEPTH} levels deep and "
          f"{MAX_YAML_NODES:,} YAML values or {MAX_EXPANDED_BYTES >> 20} MiB of text with aliases expanded, "
          f"with values of at most {MAX_VALUE_BYTES >> 10} KiB, at most {MAX_ALIASES:,} aliases and "
          f"{MAX_NODES:,} nodes")

# What YAML 1.1 refuses in a stream (PyYAML's Reader.NON_PRINTABLE).
_NON_PRINTABLE = re.compile("[^\x09\x0A\x0D\x20-\x7E\x85\xA0-\uD7FF\uE000-\uFFFD\U00010000-\U0010FFFF]")
# Line breaks as YAML counts them, so lines found here match libyaml's marks.
_BREAK = re.compile("\r\n|[\n\r\x85\u2028\u2029]")
_MERGE_TAG = "tag:yaml.org,2002:merge"

def _show_path(path: str | os.PathLike) -> str:
    """A path as it may appear in a one-line message: escaped if it holds unprintable text."""
    s = os.fspath(path)
    return s if s.isprintable() else repr(s)[1:-1]


def _line_col(text: str, pos: int) -> tuple[int, int]:
    line, start = 1, 0
    for m in _BREAK.finditer(text, 0, pos):
        line, start = line + 1, m.end()
    return line, pos - start + 1


def _yaml_line(mark) -> int | None:
    return mark.line + 1 if mark is not None else None


# ---------------------------------------------------------------- the file


def read_inventory_bytes(path: str | os.PathLike) -> bytes:
    """The bytes of a regular file of at most MAX_BYTES, read without ever blocking."""
    p = Path(path).expanduser()
    shown = _show_path(p)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise InventoryError(f"inventory file not found: {shown} (see inventory.example.yaml, or leave "
                             f"--inventory out to use the embedded two-local-node default)") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise InventoryError("cannot read the inventory: a symbolic link in the path points back to "
                                 "itself (symlink loop)", path=shown) from None
        raise InventoryError(f"cannot read the inventory: {e.strerror}", path=shown) from None
    except ValueError:
        raise InventoryError("cannot read the inventory: the path contains a NUL byte", path=shown) from None
    _check_regular(st, shown)
    try:
        # O_NONBLOCK: if the path was swapped for a FIFO since stat, open still returns at once.
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise InventoryError(f"cannot read the inventory: {e.strerror}", path=shown) from None
    try:
        _check_regular(os.fstat(fd), shown)
        chunks, size = [], 0
        while size <= MAX_BYTES:
            chunk = os.read(fd, MAX_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as e:
        raise InventoryError(f"cannot read the inventory: {e.strerror}", path=shown) from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > MAX_BYTES:
        raise InventoryError(f"the inventory is larger than {MAX_BYTES >> 20} MiB; {LIMITS}", path=shown)
    return data


def _check_regular(st: os.stat_result, shown: str) -> None:
    mode = st.st_mode
    if not stat.S_ISREG(mode):
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(mode)
                else "a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode)
                else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
        raise InventoryError(f"this is {kind}, not a file; give the path of an inventory YAML file", path=shown)
    if st.st_size > MAX_BYTES:
        raise InventoryError(f"the inventory is {st.st_size:,} bytes; {LIMITS}", path=shown)


def decode_inventory(data: bytes, source: str) -> str:
    """The bytes as UTF-8 text; a refusal names line and column."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        good = data[:e.start].decode("utf-8")
        line, col = _line_col(good, len(good))
        raise InventoryError(f"byte 0x{data[e.start]:02x} at column {col} is not UTF-8; an inventory is "
                             f"UTF-8 text", path=source, line=line) from None


def _check_characters(text: str, source: str) -> None:
    m = _NON_PRINTABLE.search(text)
    if m:
        line, col = _line_col(text, m.start())
        raise InventoryError(f"control character U+{ord(m.group()):04X} at column {col}; YAML allows "
                             f"only tab and line breaks here (write it as an escape in a double-quoted "
                             f"string if it is really meant)", path=source, line=line)


# ---------------------------------------------------------------- YAML, bounded


class _EventBudget:
    """Counts libyaml's events against the limits; `fail` raises at the event that crosses one.
    Each value counts as the number of values it expands to, and as the bytes of text it expands
    to (a scalar by its length: one long scalar aliased many times is as large as its copies)."""

    def __init__(self, source: str):
        self.source = source
        self.anchors: dict[str, tuple[int, int]] = {}  # anchor -> (expanded values, expanded bytes)
        self.stack: list[list] = []  # [is_mapping, children seen, expanded size, anchor, expanded bytes]
        self.total = self.aliases = self.bytes = 0

    def add_bytes(self, n: int, event, what: str) -> None:
        self.bytes += n
        if self.bytes > MAX_EXPANDED_BYTES:
            self.fail(f"{what} expands the document past {MAX_EXPANDED_BYTES >> 20} MiB of text; {LIMITS}", event)
        if self.stack:
            self.stack[-1][4] += n

    def fail(self, msg: str, event) -> None:
        raise InventoryError(msg, path=self.source, line=_yaml_line(event.start_mark))

    def end(self) -> None:
        _, _, size, anchor, nbytes = self.stack.pop()
        if anchor is not None:
            self.anchors[anchor] = (size, nbytes)
        if self.stack:
            self.stack[-1][2] += size
            self.stack[-1][4] += nbytes

    def alias(self, event, is_key: bool) -> None:
        self.aliases += 1
        name = excerpt(event.anchor)[1:-1]
        if is_key:
            self.fail(f"an alias (*{name}) cannot be a key", event)
        if event.anchor not in self.anchors:
            self.fail(f"alias *{name} refers to no complete anchor above it "
                      f"(undefined, or an anchor that contains its own alias)", event)
        if self.aliases > MAX_ALIASES:
            self.fail(f"more than {MAX_ALIASES:,} aliases; {LIMITS}", event)
        size, nbytes = self.anchors[event.anchor]
        self.total += size
        if self.total > MAX_YAML_NODES:
            self.fail(f"alias *{name} expands the document past {MAX_YAML_NODES:,} values; {LIMITS}", event)
        if self.stack:
            self.stack[-1][2] += size
        self.add_bytes(nbytes, event, f"alias *{name}")

    def value(self, event, is_key: bool) -> None:
        """A scalar, or the start of a list or mapping."""
        if event.tag is not None:
            tag = event.tag.replace("tag:yaml.org,2002:", "!!", 1)
            self.fail(f"YAML tag {excerpt(tag)} is not allowed in an inventory; write the plain "
                      f"value (quote it to make it a string)", event)
        if is_key and event.anchor is not None:
            self.fail(f"a key cannot carry an anchor (&{excerpt(event.anchor)[1:-1]})", event)
        self.total += 1
        if self.total > MAX_YAML_NODES:
            self.fail(f"more than {MAX_YAML_NODES:,} YAML values; {LIMITS}", event)
        if isinstance(event, yaml.ScalarEvent):
            nbytes = len(event.value.encode("utf-8", "surrogatepass"))
            if nbytes > MAX_VALUE_BYTES:
                self.fail(f"a value of {nbytes:,} bytes ({excerpt(event.value, 40)}); {LIMITS}", event)
            if event.anchor is not None:
                self.anchors[event.anchor] = (1, nbytes)
            if self.stack:
                self.stack[-1][2] += 1
            self.add_bytes(nbytes, event, "this value")
            return
        if is_key:
            self.fail("a key must be a plain string, not a list or a mapping", event)
        if len(self.stack) >= MAX_DEPTH:
            self.fail(f"nested more than {MAX_DEPTH} levels deep; {LIMITS}", event)
        self.stack.append([isinstance(event, yaml.MappingStartEvent), 0, 1, event.anchor, 0])


def _scan_events(text: str, source: str) -> None:
    """Walk libyaml's event stream once, refusing depth, size, alias, tag and key abuse before
    any tree is built."""
    budget = _EventBudget(source)
    for event in yaml.parse(text, Loader=yaml.CSafeLoader):
        if isinstance(event, yaml.DocumentStartEvent):
            budget.anchors.clear()
        elif isinstance(event, yaml.CollectionEndEvent):
            budget.end()
        elif isinstance(event, (yaml.ScalarEvent, yaml.AliasEvent, yaml.CollectionStartEvent)):
            stack = budget.stack
            is_key = bool(stack) and stack[-1][0] and stack[-1][1] % 2 == 0
            if stack:
                stack[-1][1] += 1
            if isinstance(event, yaml.AliasEvent):
                budget.alias(event, is_key)
            else:
                budget.value(event, is_key)


def _bad_char(s: str) -> str | None:
    for ch in s:
        if ch in "\t\n":
            continue
        if unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"):
            return ch
    return None


class _Loader(yaml.CSafeLoader):
    """libyaml's SafeLoader with keys that are unique strings and strings without control or
    format characters."""

    def construct_mapping(self, node, deep=False):
        seen: dict[str, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            line = key_node.start_mark.line + 1
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, str):
                raise InventoryError(f"key {excerpt(key_node.value)} is not a string (YAML read it as "
                                     f"{type(key).__name__}); quote it", line=line)
            if key in seen:
                raise InventoryError(f"duplicate key {excerpt(key)} (first on line {seen[key]})",
                                     line=line, key=key)
            seen[key] = line
        return super().construct_mapping(node, deep)

    def construct_yaml_str(self, node):
        value = super().construct_yaml_str(node)
        ch = _bad_char(value)
        if ch is not None:
            name = unicodedata.name(ch, "a control character")
            raise InventoryError(f"the string {excerpt(value)} holds U+{ord(ch):04X} ({name}); "
                                 f"control and invisible format characters are not allowed",
                                 line=node.start_mark.line + 1)
        return value

    def construct_yaml_int(self, node):
        try:
            return super().construct_yaml_int(node)
        except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits)
            raise InventoryError(f"the number {excerpt(node.value)} is too long",
                                 line=node.start_mark.line + 1) from None

    def construct_yaml_timestamp(self, node):
        try:
            return super().construct_yaml_timestamp(node)
        except (ValueError, OverflowError):
            raise InventoryError(f"{excerpt(node.value)} reads as a date but is not one; quote it if you "
                                 f"mean the text", line=node.start_mark.line + 1) from None


_Loader.add_constructor("tag:yaml.org,2002:str", _Loader.construct_yaml_str)
_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)
_Loader.add_constructor("tag:yaml.org,2002:timestamp", _Loader.construct_yaml_timestamp)


def _compose_and_construct(text: str, source: str) -> tuple[Any, Any]:
    """(composed root node, Python data); YAML errors become InventoryError with a line."""
    try:
        _scan_events(text, source)
        loader = _Loader(text)
        try:
            root = loader.get_single_node()
            data = loader.construct_document(root) if root is not None else None
        finally:
            loader.dispose()
    except InventoryError as e:
        if e.path:
            raise
        raise InventoryError(str(e), path=source, line=e.line, key=e.key) from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        problem = e.problem or str(e)
        if e.context and e.context not in problem:
            problem = f"{problem} ({e.context})" if e.problem else problem
        problem = problem if len(problem) <= 200 and problem.isprintable() else excerpt(problem, 200)
        if "maximum nesting depth" in problem:
            # A libyaml that caps nesting itself (the CI machine's does) stops in its scanner,
            # before the event walk above sees level 33: the same refusal in the same words.
            raise InventoryError(f"nested more than {MAX_DEPTH} levels deep; {LIMITS}",
                                 path=source, line=_yaml_line(mark)) from None
        raise InventoryError(f"YAML syntax error: {problem}", path=source, line=_yaml_line(mark)) from None
    except yaml.YAMLError as e:
        raise InventoryError(f"YAML error: {excerpt(str(e))}", path=source) from None
    except (ValueError, TypeError, OverflowError, RecursionError) as e:
        # A value PyYAML's constructors cannot build; the checks above are meant to leave none.
        raise InventoryError(f"cannot read a value: {type(e).__name__}: {excerpt(str(e))}", path=source) from None
    return root, data
