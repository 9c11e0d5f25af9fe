"""The README's "adding a position encoding" example works as written, and the generic contract
tests accept it: it registers, decodes incrementally like the full pass, and breaks permutation
equivariance."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from support.models import tiny_model

from tpe_train.positions import base

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_position_example_registers_and_decodes_incrementally() -> None:
    text = README.read_text()
    block = re.search(r"## Adding a position encoding.*?```python\n(.*?)```", text, re.S)
    assert block is not None
    namespace = {name: getattr(base, name) for name in dir(base)}
    exec(block.group(1), namespace)
    try:
        assert "linear_bias" in base.POSITIONS
        model = tiny_model("linear_bias")
        src = torch.randint(3, 40, (2, 7))
        tgt = torch.randint(3, 40, (2, 5))
        memory = model.encode(src)
        full = model.decode(tgt, memory)
        cache = model.new_cache()
        steps = [model.decode(tgt[:, i : i + 1], memory, cache) for i in range(5)]
        torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
        perm = torch.tensor([3, 1, 2, 0, 4, 5, 6])
        assert not torch.allclose(model.encode(src[:, perm]).states, memory.states[:, perm], atol=1e-4)
        flex = tiny_model("linear_bias", attention="flex")  # its score_mod, against explicit attention
        flex.load_state_dict(model.state_dict())
        with torch.no_grad():
            torch.testing.assert_close(flex.decode(tgt, flex.encode(src)), full, atol=1e-5, rtol=1e-5)
    finally:
        base.POSITIONS._entries.pop("linear_bias", None)
