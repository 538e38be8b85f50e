"""Exceptions raised by the codec."""


class CodecError(ValueError):
    """Bytes that are not a valid chunk bitstream (truncated, corrupted, foreign, unsupported)."""
