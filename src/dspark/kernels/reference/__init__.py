"""Pure-PyTorch reference backend: the executable specification of the kernel contracts."""
