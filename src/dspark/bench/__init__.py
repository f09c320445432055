"""H200 benchmarks of the kernel families: ``python -m dspark.bench`` (or ``dspark bench``)."""
