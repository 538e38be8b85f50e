"""Exceptions raised by the codec."""


class CodecError(ValueError):
    """Bytes that are not a valid chunk bitstream (truncated, corrupted, foreign, unsupported)."""


class ShapeMismatch(CodecError):
    """A well-formed header whose tensor shape is not the one the caller expects.

    Raised from the header alone, before the checksum or the payload is read, so
    a forged header cannot make the parse allocate for a tensor nobody asked for.
    """


class StreamError(CodecError):
    """An entropy-coded stream that passed every check of the parse but did not decode.

    Only a stream forged under a valid CRC gets this far; it is found while
    decoding (the rANS state does not end where the encoder started), so after
    a backend has written to its output. ``chunk`` is the position of the
    first such chunk in the decoded batch: the chunks before it decoded fine.
    """

    def __init__(self, message: str, chunk: int = 0) -> None:
        super().__init__(message)
        self.chunk = chunk
