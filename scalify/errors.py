"""Errors a user can act on; the CLI prints them as one line and exits with code 2."""


class ScalifyError(Exception):
    """Base class: bad input, not a failed verification."""


class ConfigError(ScalifyError):
    """A config file or field is malformed; the message names the file and the field path."""


class CaptureError(ScalifyError):
    """A program could not be captured (unknown op, untracked tensor); the message names the op."""


class DataDependentRead(CaptureError):
    """A program reads a value computed from its data into Python (an MoE router's token
    counts): capture samples such reads on real numbers and tries again (sampled_reads.py)."""


class ShapeError(ScalifyError):
    """Declared placements or captured shapes do not fit together."""
