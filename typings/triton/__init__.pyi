"""Type stubs for the parts of triton computectx uses."""

__version__: str
