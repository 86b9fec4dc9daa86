"""The README's example runs as written (its GPU half where there is a GPU), and so does
the module example of docs/usage.md."""

import os
import re

import pytest
import torch

README = os.path.join(os.path.dirname(__file__), "..", "README.md")
USAGE = os.path.join(os.path.dirname(__file__), "..", "docs", "usage.md")


def test_readme_cpu_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", open(README).read(), re.S)
    scope = {}
    exec(compile(blocks[0], "README.md", "exec"), scope)  # noqa: S102
    assert "torch.Size([26, 128])" in capsys.readouterr().out
    assert scope["kv"].grad is not None and torch.isfinite(scope["kv"].grad).all()
    assert scope["ape"].grad.abs().sum() > 0


@pytest.mark.gpu
def test_readme_gpu_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", open(README).read(), re.S)
    scope = {}
    exec(compile(blocks[0], "README.md", "exec"), scope)  # noqa: S102
    assert scope["out"].is_cuda and scope["out"].shape == (26, 128)
    assert torch.isfinite(scope["kv"].grad).all() and scope["kv"].grad.is_cuda


def test_readme_module_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", open(USAGE).read(), re.S)
    scope = {}
    exec(compile(blocks[0], "docs/usage.md", "exec"), scope)  # noqa: S102
    assert "torch.Size([25, 128]) [0, 9, 9, 24]" in capsys.readouterr().out
    assert torch.isfinite(scope["x"].grad).all() and scope["x"].grad.abs().sum() > 0
    assert all(p.grad is not None for p in scope["m"].parameters())
