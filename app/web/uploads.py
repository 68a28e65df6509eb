"""Multipart forms that carry files: each file streams to a folder on disk as it arrives (never whole in memory),
and the upload is refused once its files pass a limit, before more is read."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, BinaryIO, Optional

import anyio
from fastapi import Request
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header

from app.core.errors import Invalid, TooLarge

if TYPE_CHECKING:  # python-multipart defines it for type checkers only
    from python_multipart.multipart import MultipartCallbacks

FIELD_BYTES = 1 << 20  # one text field (the JSON options are a few KiB)
MAX_FIELDS, MAX_FILES = 50, 100


@dataclass
class UploadedForm:
    fields: dict[str, str] = field(default_factory=dict)
    files: dict[str, Path] = field(default_factory=dict)  # the uploaded file's own name -> where it lies


def size_text(count: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "bytes" else f"{count:.1f} {unit}"
        count /= 1024
    return ""


class _Parts:
    """python-multipart's callbacks: text fields gathered, files written to ``folder`` as their bytes come."""

    def __init__(self, folder: Path, max_file_bytes: int):
        self.form, self.folder, self.max_file_bytes = UploadedForm(), folder, max_file_bytes
        self.file_bytes = 0
        self.header, self.value, self.disposition = b"", b"", b""
        self.name, self.data, self.skipping = "", bytearray(), False
        self.out: Optional[BinaryIO] = None

    def callbacks(self) -> MultipartCallbacks:
        return {"on_part_begin": self.begin, "on_header_field": self.header_field,
                "on_header_value": self.header_value, "on_header_end": self.header_end,
                "on_headers_finished": self.headers_finished, "on_part_data": self.part_data,
                "on_part_end": self.part_end}

    def begin(self) -> None:
        self.disposition, self.name, self.data, self.out, self.skipping = b"", "", bytearray(), None, False

    def header_field(self, data: bytes, start: int, end: int) -> None:
        self.header += data[start:end]

    def header_value(self, data: bytes, start: int, end: int) -> None:
        self.value += data[start:end]

    def header_end(self) -> None:
        if self.header.lower() == b"content-disposition":
            self.disposition = self.value
        self.header, self.value = b"", b""

    def headers_finished(self) -> None:
        _, options = parse_options_header(self.disposition)
        self.name = options.get(b"name", b"").decode("utf-8", "replace")
        if b"filename" not in options:
            if len(self.form.fields) >= MAX_FIELDS:
                raise Invalid(f"the form has more than {MAX_FIELDS} fields")
            return
        # Browsers send the file's own name; an empty one is a file input left empty.
        name = PurePosixPath(options[b"filename"].decode("utf-8", "replace").replace("\\", "/")).name
        if not name:
            self.skipping = True
            return
        if name in self.form.files:
            raise Invalid(f"data files: two files are named {name!r}")
        if len(self.form.files) >= MAX_FILES:
            raise Invalid(f"data files: at most {MAX_FILES}")
        path = self.folder / f"upload-{len(self.form.files)}"
        self.form.files[name] = path
        self.out = path.open("wb")

    def part_data(self, data: bytes, start: int, end: int) -> None:
        if self.skipping:
            return
        if self.out is None:
            if len(self.data) + end - start > FIELD_BYTES:
                raise Invalid(f"{self.name}: longer than {size_text(FIELD_BYTES)}")
            self.data += data[start:end]
            return
        self.file_bytes += end - start
        if self.file_bytes > self.max_file_bytes:
            raise TooLarge(f"data files: more than {size_text(self.max_file_bytes)} in all "
                           "(the portal's DEDLOC_MAX_UPLOAD_BYTES)")
        self.out.write(data[start:end])

    def part_end(self) -> None:
        if self.out is not None:
            self.out.close()
        elif not self.skipping:
            self.form.fields[self.name] = self.data.decode("utf-8", "replace")
        self.out = None

    def close(self) -> None:
        if self.out is not None:
            self.out.close()


async def read_multipart(request: Request, folder: Path, max_file_bytes: int) -> UploadedForm:
    """The form's text fields, and its files written under ``folder`` (the caller removes it). ``TooLarge`` past
    ``max_file_bytes`` of files; ``Invalid`` for a body that is not a well-formed multipart form."""
    kind, options = parse_options_header(request.headers.get("content-type", ""))
    if kind != b"multipart/form-data" or b"boundary" not in options:
        raise Invalid("send the form as multipart/form-data (it carries files)")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_file_bytes + MAX_FIELDS * FIELD_BYTES:
        raise TooLarge(f"data files: more than {size_text(max_file_bytes)} in all (the portal's "
                       "DEDLOC_MAX_UPLOAD_BYTES)")
    parts = _Parts(folder, max_file_bytes)
    parser = MultipartParser(options[b"boundary"], parts.callbacks())
    try:
        async for chunk in request.stream():
            # the callbacks write to disk: in a worker thread, so that the event loop keeps serving others
            await anyio.to_thread.run_sync(parser.write, chunk)
        parser.finalize()
    except FormParserError:
        raise Invalid("the form's data is malformed; send it again") from None
    finally:
        parts.close()
    return parts.form
