"""How ``reference_golden.json`` was made: the six newer position encodings computed by their authors'
(or the closest published) code, at small sizes with fixed inputs and parameter values.

``python tests/support/reference_golden.py REFCODE OUT.json`` runs the reference files from the folder
REFCODE, laid out as ``SOURCES`` names them (each file as its repository holds it at the commit given;
the few imports a file makes of the rest of its repository are stubbed there: KERPLE's model-parallel
helpers for one rank, NeMo's ``@experimental`` as the identity and its packages as empty
``__init__.py``). This script is the record of how the file was made, not part of the test run:
``tests/test_position_reference.py`` reads the JSON only.

Inputs and parameters are decimals of at most three places drawn from a seeded generator and stored
in the JSON beside the outputs, so that the test builds exactly the float32 values the reference
code saw; outputs are rounded to 8 significant digits.
"""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

#: where each reference comes from, and the call that produced its values
SOURCES: dict[str, dict[str, str]] = {
    "kerple": {
        "repository": "chijames/KERPLE (the authors' gpt-neox fork)",
        "path": "megatron/mpu/layers.py",
        "commit": "25be3d712e96a3353b374f1f8e36b97d86f97ffa",
        "refcode": "kerple/megatron/mpu/layers.py",
        "call": "ParallelKerpleLog(neox_args) and ParallelKerplePower(neox_args) with pos_emb 'kerple_log' "
        "and 'kerple_power_ap_' (the paper's power kernel -a |m-n|^p), bias_p and bias_a set to the "
        "values stored here; forward(torch.zeros(1, H, L, L)) is the bias (0 above the diagonal)",
    },
    "sandwich": {
        "repository": "NVIDIA/NeMo",
        "path": "nemo/collections/nlp/modules/common/megatron/position_embedding/"
        "sandwich_relative_position_embedding.py",
        "commit": "8cfedd7203462cb251a914e700e5605444277561",
        "refcode": "nemo/nemo/collections/nlp/modules/common/megatron/position_embedding/"
        "sandwich_relative_position_embedding.py (and alibi_relative_position_embedding.py beside it)",
        "call": "SandwichRelativePositionEmbedding(bidirectional, H, None, hidden_size=d', max_seq_len=L)"
        "(L, L) for bidirectional True and False (False: 0 above the diagonal)",
    },
    "fire": {
        "repository": "mcleish7/arithmetic (its copy of the FIRE paper's code listing, arXiv 2310.04418)",
        "path": "cramming/architectures/embeddings.py",
        "commit": "86022a57d38c0fde46444d62e8dcbebcc0af614c",
        "refcode": "arithmetic/embeddings.py",
        "call": "FIRE(num_heads=H, mlp_width=W, init_L=L0, max_length=0).eval() with the MLP, c and "
        "L_multiplier set to the values stored here; forward(L, 'cpu') (positions 0..L-1)",
    },
    "xpos": {
        "repository": "microsoft/torchscale",
        "path": "torchscale/component/xpos_relative_position.py",
        "commit": "4d1e0e82e5adf86dd424f1463192635b73fc8efc",
        "refcode": "torchscale/xpos_relative_position.py",
        "call": "XPOS(hd, scale_base) applied as torchscale's MultiheadAttention does: "
        "k = xpos(k, offset=0, downscale=True), q = xpos(q, offset=0) (the step: the last query with "
        "offset=L-1); logits q @ k^T, features in the reference's interleaved pair layout",
    },
    "cope": {
        "repository": "facebookresearch/RAM",
        "path": "projects/cope/src/cope/context_position.py",
        "commit": "e6f051fbcfaef4cab69bf2ea1b25f500f94c0c64",
        "refcode": "ram/context_position.py",
        "call": "ContextPosSelfAttn(cfg, 0)(q, k, k, v, attn_mask=ones(L, L).tril()[None]) with pos_emb set "
        "to the table stored here, cope_nodiv False and True; q, k, v = x W^T + b split into heads "
        "(B*H, L, hd) as the repository's SelfAttn.split_heads; the output merged back to (B, L, D) "
        "and the weights attn_saved",
    },
}


def draw(gen: torch.Generator, *shape: int, scale: float = 1.0) -> list[Any]:
    """A nested list of N(0, scale^2) draws rounded to three decimals (exact inputs for both sides)."""
    values = torch.randn(*shape, generator=gen, dtype=torch.float64) * scale
    return (torch.round(values * 1000) / 1000).tolist()


def f32(values: list[Any]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def rounded(t: torch.Tensor) -> list[Any]:
    """A tensor as nested lists of floats of 8 significant digits."""

    def walk(x: Any) -> Any:
        return [walk(v) for v in x] if isinstance(x, list) else float(f"{x:.8g}")

    return walk(t.detach().double().tolist())


def load(refcode: Path, folder: str, module: str) -> Any:
    sys.path.insert(0, str(refcode / folder))
    try:
        return importlib.import_module(module)
    finally:
        sys.path.pop(0)


def kerple(refcode: Path) -> dict[str, Any]:
    torch.cuda.current_device = lambda: "cpu"  # the device of its parameters
    layers = load(refcode, "kerple", "megatron.mpu.layers")
    heads, length = 4, 9
    out: dict[str, Any] = {"heads": heads, "length": length}
    forms = {
        # tpe-train's (r1, r2): log -r1 log(1 + r2 d) is (bias_p, bias_a); power -r1 d^r2 is (bias_a, bias_p)
        "log": ("kerple_log", [0.05, 0.6, 1.2, 1.9], [0.02, 0.3, 0.75, 0.99]),
        "power": ("kerple_power_ap_", [0.05, 0.4, 0.8, 0.99], [0.05, 0.5, 1.25, 1.95]),
    }
    for form, (pos_emb, r1, r2) in forms.items():
        neox = SimpleNamespace(num_attention_heads=heads, pos_emb=pos_emb, params_dtype=torch.float32)
        module = layers.ParallelKerpleLog(neox) if form == "log" else layers.ParallelKerplePower(neox)
        p, a = (r1, r2) if form == "log" else (r2, r1)
        module.bias_p.data = f32(p)[:, None, None]
        module.bias_a.data = f32(a)[:, None, None]
        with torch.no_grad():
            bias = module(torch.zeros(1, heads, length, length))[0]
        out[form] = {"r1": r1, "r2": r2, "bias": rounded(bias)}
    return out


def sandwich(refcode: Path) -> dict[str, Any]:
    name = (
        "nemo.collections.nlp.modules.common.megatron.position_embedding.sandwich_relative_position_embedding"
    )
    module = load(refcode, "nemo", name)
    heads, dim, length = 4, 16, 10
    out: dict[str, Any] = {"heads": heads, "dim": dim, "length": length}
    for key, bidirectional in (("bidirectional", True), ("causal", False)):
        emb = module.SandwichRelativePositionEmbedding(bidirectional, heads, None, dim, max_seq_len=length)
        out[key] = rounded(emb(length, length)[0])
    return out


def fire(refcode: Path) -> dict[str, Any]:
    module = load(refcode, "arithmetic", "embeddings")
    heads, width, length, init_l, c, multiplier = 3, 5, 10, 8.0, 0.25, 0.75
    gen = torch.Generator().manual_seed(3)
    params = {
        "hidden_weight": draw(gen, width, 1),
        "hidden_bias": draw(gen, width, scale=0.5),
        "out_weight": draw(gen, heads, width),
        "out_bias": draw(gen, heads, scale=0.5),
    }
    ref = module.FIRE(num_heads=heads, mlp_width=width, init_L=init_l, max_length=0).eval()
    ref.mlp[0].weight.data, ref.mlp[0].bias.data = f32(params["hidden_weight"]), f32(params["hidden_bias"])
    ref.mlp[2].weight.data, ref.mlp[2].bias.data = f32(params["out_weight"]), f32(params["out_bias"])
    ref.c.data, ref.L_multiplier.data = torch.tensor(c), torch.tensor(multiplier)
    with torch.no_grad():
        bias = ref(length, "cpu")[0]
    meta = {"heads": heads, "width": width, "length": length, "init_L": init_l, "c": c}
    return {**meta, "multiplier": multiplier, **params, "bias": rounded(bias)}


def xpos(refcode: Path) -> dict[str, Any]:
    module = load(refcode, "torchscale", "xpos_relative_position")
    rows, length, hd, scale_base = 3, 12, 8, 16.0
    gen = torch.Generator().manual_seed(4)
    q, k = draw(gen, rows, length, hd), draw(gen, rows, length, hd)
    xp = module.XPOS(hd, scale_base)
    k_rot = xp(f32(k), offset=0, downscale=True)
    q_rot = xp(f32(q), offset=0, downscale=False)
    step = xp(f32(q)[:, -1:], offset=length - 1, downscale=False)
    meta = {"rows": rows, "length": length, "head_dim": hd, "scale_base": scale_base}
    logits, step_logits = q_rot @ k_rot.transpose(-1, -2), step @ k_rot.transpose(-1, -2)
    return {**meta, "q": q, "k": k, "logits": rounded(logits), "step_logits": rounded(step_logits)}


def cope(refcode: Path) -> dict[str, Any]:
    module = load(refcode, "ram", "context_position")
    batch, heads, hd, length = 2, 2, 4, 7
    d = heads * hd
    gen = torch.Generator().manual_seed(5)
    inputs = {"x": draw(gen, batch, length, d)}
    for name in ("q", "k", "v"):
        inputs[f"w{name}"], inputs[f"b{name}"] = draw(gen, d, d, scale=0.7), draw(gen, d, scale=0.3)
    table = draw(gen, hd, length + 1)

    def split(t: torch.Tensor) -> torch.Tensor:  # (B, L, D) -> (B*H, L, hd)
        return t.view(batch, length, heads, hd).transpose(1, 2).reshape(batch * heads, length, hd)

    x = f32(inputs["x"])
    q, k, v = (split(x @ f32(inputs[f"w{n}"]).T + f32(inputs[f"b{n}"])) for n in ("q", "k", "v"))
    cases: dict[str, Any] = {}
    for case, npos, nodiv in (
        ("divide", length + 1, False),
        ("nodiv", length + 1, True),
        ("clamped", 4, False),
    ):
        cfg = SimpleNamespace(
            drop=0.0, cope_layers=1, pos_emb="cope", cope_npos=npos, block_size=length, head_dim=hd,
            cope_sep_key=False, cope_val_gates=False, cope_nodiv=nodiv,
        )  # fmt: skip
        attn = module.ContextPosSelfAttn(cfg, 0).eval()
        attn.pos_emb.data = f32(table)[None, :, :npos]
        with torch.no_grad():
            out = attn(q, k, k, v, attn_mask=torch.ones(length, length).tril()[None])
        merged = out.view(batch, heads, length, hd).transpose(1, 2).reshape(batch, length, d)
        weights = attn.attn_saved.view(batch, heads, length, length)
        cases[case] = {
            "npos": npos,
            "divide": not nodiv,
            "output": rounded(merged),
            "weights": rounded(weights),
        }
    meta = {"batch": batch, "heads": heads, "head_dim": hd, "length": length}
    return {**meta, **inputs, "table": table, "cases": cases}


def main(refcode: Path, out: Path) -> None:
    torch.manual_seed(0)  # the reference modules draw initial values that are then overwritten
    golden = {
        "about": "tests/support/reference_golden.py: values of the reference implementations",
        "torch": torch.__version__.split("+")[0],
        "sources": {name: {k: v for k, v in s.items() if k != "refcode"} for name, s in SOURCES.items()},
        "kerple": kerple(refcode),
        "sandwich": sandwich(refcode),
        "fire": fire(refcode),
        "xpos": xpos(refcode),
        "cope": cope(refcode),
    }
    # one line per source and per encoding: readable keys, a file of a few hundred lines
    sources = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in golden.pop("sources").items())
    rest = [f" {json.dumps(k)}: {json.dumps(v)}" for k, v in golden.items()]
    out.write_text("{\n" + ",\n".join([*rest, f' "sources": {{\n{sources}\n }}']) + "\n}\n")
    print(f"wrote {out} ({math.ceil(out.stat().st_size / 1024)} KiB)")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
