import triton  # noqa: F401

__all__: list[str] = []
