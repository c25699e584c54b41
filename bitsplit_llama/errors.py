"""The project's exceptions.

Every error the library raises on purpose derives from :class:`BitsplitError`. Messages are written
for the person at the terminal: they name the file, tensor or option, the bad value and what was
expected, in one line. The CLI prints ``str(exc)`` and exits 1; usage errors exit 2.
"""

from __future__ import annotations


class BitsplitError(Exception):
    """Root of the hierarchy: catch this to catch everything bitsplit raises deliberately."""


class InputError(BitsplitError):
    """A file or value given by the user cannot be used (missing, unreadable, wrong kind)."""


class InvalidOptionError(InputError, ValueError):
    """An option has a value outside its allowed range or set (``ValueError`` for API callers)."""


class GGUFFormatError(InputError):
    """A file is not a well-formed GGUF: bad magic, truncated, absurd header fields, unknown types."""


class UnsupportedModelError(InputError):
    """A well-formed GGUF that this tool or llama.cpp cannot handle (architecture, tensor type)."""


class MismatchError(InputError):
    """Base and residual do not belong together (other model, other base, other shapes)."""


class OutputError(BitsplitError):
    """Output cannot be written: it exists already, the directory is not writable, the disk is full."""


class NativeError(BitsplitError):
    """The native library could not be built or loaded, or returned an error status."""


class ContextLimitError(InputError):
    """A prompt (plus what is asked to be generated) does not fit in the context."""


class BusyError(BitsplitError, RuntimeError):
    """A model object is already in use by another call (calls on one model are not interleaved)."""


class ContextWindowError(ContextLimitError, ValueError):
    """A prompt longer than the context: a ContextLimitError, and the ValueError llama_cpp.Llama raises."""
