"""Type stubs for ``triton.knobs`` (process-wide settings read from the environment)."""

class _RuntimeKnobs:
    interpret: bool

runtime: _RuntimeKnobs
