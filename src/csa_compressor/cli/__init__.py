"""The command line: ``python -m csa_compressor {info,bench,check,report}`` (main.py), the
side-by-side benchmark (bench.py) and the numerics gate (check.py)."""
