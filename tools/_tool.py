"""What every tool here does first: answer ``--help`` with its docstring, and where it
needs a GPU, say so and exit 2 on a machine without one (before importing the package)."""

import sys

NO_GPU = 2


def start(doc: str, gpu: bool = True, own_help: bool = False) -> None:
    """``own_help``: the tool parses its arguments itself (argparse answers ``--help``)."""
    asked = any(a in ("-h", "--help") for a in sys.argv[1:])
    if asked and not own_help:
        print((doc or "").strip())
        sys.exit(0)
    if gpu and not asked:
        import torch

        if not torch.cuda.is_available():
            name = sys.argv[0].rsplit("/", 1)[-1]
            print(f"{name}: needs a CUDA GPU (compute capability 9.0 or newer); none is "
                  "available here", file=sys.stderr)
            sys.exit(NO_GPU)
