"""Outputs of the seven older encodings at a fixed seed: full pass and incremental decoding, sdpa and
explicit. ``golden_positions.pt`` holds them as computed by the code before the position interface was
widened for keys (revision b3977b6): ``python tests/support/golden_positions.py OUT.pt`` in a checkout
of that revision, with ``tests`` on the path, on an Intel Xeon with PyTorch's kernels.
tests/test_position_kernels.py compares the current code with it within fp32 rounding (another
processor's kernels sum in another order)."""

from __future__ import annotations

import sys

import torch

from support.models import tiny_model

KINDS = ["none", "sinusoidal", "learned", "shaw", "t5", "alibi", "rope", "shaw+values"]


def outputs() -> dict[str, torch.Tensor]:
    out = {}
    for kind in KINDS:
        for backend in ("sdpa", "explicit"):
            torch.manual_seed(0)
            model = tiny_model(kind.split("+")[0], shaw_values=kind == "shaw+values", attention=backend)
            g = torch.Generator().manual_seed(1)
            src, tgt = torch.randint(3, 40, (2, 7), generator=g), torch.randint(3, 40, (2, 5), generator=g)
            src[1, 5:] = 0
            with torch.no_grad():
                out[f"{kind}/{backend}"] = model(src, tgt)
                memory = model.encode(src)
                cache = model.new_cache()
                steps = [model.decode(tgt[:, i : i + 1], memory, cache) for i in range(5)]
                out[f"{kind}/{backend}/steps"] = torch.cat(steps, dim=1)
    return out


if __name__ == "__main__":
    torch.save(outputs(), sys.argv[1])
