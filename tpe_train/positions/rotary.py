"""Rotary position embeddings (Su et al. 2021): queries and keys rotated by their absolute position,
so that q_i . k_j depends only on i - j."""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor

from tpe_train.positions.base import POSITIONS, PositionArgs, PositionEncoding


def check_head_dim(head_dim: int, kind: str = "rope") -> None:
    """Refuse an odd head dimension (RoPE rotates pairs of features): where the config is loaded, and
    where the encoding is built without one."""
    if head_dim % 2:
        raise ValueError(
            f"{kind} needs an even head dimension, but d_model/n_heads = {head_dim}; "
            "change model.d_model or model.n_heads"
        )


@POSITIONS.register("rope")
class RotaryPosition(PositionEncoding):
    """RoPE in the half-split layout (GPT-NeoX): pairs (x_i, x_{i + hd/2}) rotate together by the angle
    pos * base^(-2i/hd), i < hd/2.

    The angles are computed from the positions on their device, in float64 (exact for any position a
    model meets), rounded to float32 and then to the compute dtype: once per stack and batch (``memo``:
    every layer reuses them), no table sized on the host, no host sync. The rotation works in the
    projection's own (B, L, H, hd) layout, so rotated q and k keep the memory order (and the strides'
    order) of the unrotated ones: attention's kernels see one layout whatever the encoding.
    """

    settings: ClassVar[dict[str, str]] = {
        "scaling": "none | pi (positions / factor) | ntk (base * factor^(hd/(hd-2))) | yarn",
        "factor": "the context extension factor s (default 1: unchanged)",
        "original": "YaRN: the trained context length L (wavelength ramp alpha=1, beta=32)",
    }
    #: YaRN's ramp bounds (Peng et al. 2023, section 3.2, for LLaMA): rotations per original context
    yarn_alpha = 1.0
    yarn_beta = 32.0

    def __init__(self, args: PositionArgs) -> None:
        super().__init__(args)
        check_head_dim(args.head_dim)
        self.scaling, self.factor, self.original = "none", 1.0, 0

    def adapt(self, **settings: str) -> None:
        """Position interpolation (Chen et al. 2023), NTK-aware base scaling (bloc97 2023) or YaRN
        (Peng et al. 2023, with its attention temperature) by ``factor``; factor 1 is the identity."""
        super().adapt(**settings)
        scaling = settings.get("scaling", "none")
        if scaling not in ("none", "pi", "ntk", "yarn"):
            raise ValueError(f"rope.scaling={scaling!r}: choose none, pi, ntk or yarn")
        factor = self.setting(settings, "factor", float, 1.0)
        if factor < 1.0:
            raise ValueError(f"rope.factor={factor}: give a factor of at least 1")
        original = self.setting(settings, "original", int, 0)
        if scaling == "yarn" and original < 1:
            raise ValueError("rope.scaling=yarn needs rope.original=<trained context length>")
        self.scaling, self.factor, self.original = scaling, factor, original

    def inv_freq(self, device: torch.device) -> Tensor:
        """theta_i = base^(-2i/hd), i < hd/2, after the test-time scaling: (hd/2,) float64."""
        hd, s = self.args.head_dim, self.factor
        two_i = torch.arange(0, hd, 2, dtype=torch.float64, device=device)
        base = self.args.rope_base
        if self.scaling == "ntk" and s != 1.0:
            base = base * s ** (hd / (hd - 2))
        theta = 1.0 / torch.pow(base, two_i / hd)
        if self.scaling == "pi" and s != 1.0:
            theta = theta / s
        if self.scaling == "yarn" and s != 1.0:
            ratio = self.original * theta / (2 * math.pi)  # r = L / wavelength
            gamma = ((ratio - self.yarn_alpha) / (self.yarn_beta - self.yarn_alpha)).clamp(0.0, 1.0)
            theta = (1 - gamma) * theta / s + gamma * theta
        return theta

    @property
    def mscale(self) -> float:
        """YaRN's sqrt(1/t) = 0.1 ln s + 1, applied to q and k alike (logits times its square)."""
        return 0.1 * math.log(self.factor) + 1.0 if self.scaling == "yarn" else 1.0

    def cos_sin(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin of every position's angles in the half-split layout: two (L, hd) float32."""
        inv_freq = self.inv_freq(pos.device)  # (hd/2,)
        freqs = pos.to(torch.float64)[..., None] * inv_freq  # (L, hd/2), or (B, L, hd/2) augmented
        emb = torch.cat((freqs, freqs), dim=-1)  # (L, hd)
        if self.mscale != 1.0:
            return (emb.cos() * self.mscale).float(), (emb.sin() * self.mscale).float()
        return emb.cos().float(), emb.sin().float()

    def tables(self, pos: Tensor, dtype: torch.dtype, scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """cos, and the signed sin with its halves swapped, as (L, 1, hd) in ``dtype``.

        The half-split rotation is x * cos + swap(x) * s with s = (-sin, +sin) on the (first, second)
        half. swap is its own inverse, so swap(x) * s = swap(x * swap(s)), and swap(s) = (+sin, -sin)
        is what is returned: the swap then acts on a fresh dense product, as one ``roll``. A swap of
        the strided projection view itself took two slices and a ``cat`` (and in the backward two
        ``slice_backward``, each a zero-filled copy): 18 aten ops a rotation, 12 now. ``scale``: a
        factor per position and dimension, equal on the two halves (xPos), folded into both tables."""
        cos, sin = self.cos_sin(pos)
        if scale is not None:  # (L, hd) float32, the same on both halves (xPos)
            cos, sin = cos * scale, sin * scale
        half = sin.shape[-1] // 2
        swapped_signed = torch.cat((sin[..., half:], -sin[..., :half]), dim=-1)
        return cos.to(dtype)[..., None, :], swapped_signed.to(dtype)[..., None, :]

    def _rotated(self, x: Tensor, pos: Tensor) -> Tensor:
        cos, sin = self.memo("tables", (pos,), x.dtype, lambda: self.tables(pos, x.dtype))
        t = x.transpose(1, 2)  # (B, L, H, hd): the projection's layout (a view, no copy)
        return (t * cos + (t * sin).roll(t.shape[-1] // 2, dims=-1)).transpose(1, 2)

    augments: ClassVar[tuple[str, ...]] = ("shape", "cape", "randomized")

    def augmented(self, q_pos: Tensor, k_pos: Tensor, batch: int) -> tuple[Tensor, Tensor]:
        """Self-attention's positions in training under ``model.position.augment``: (batch, L), drawn
        once per batch and stack (``memo``: every layer sees the same draw), or with ``randomized``
        and ``randomized_per_layer`` once per layer, as the reference's RoPE draws them in each
        attention layer (queries and keys of a layer share the draw). Cross-attention (query and key
        positions of two sequences) keeps its positions."""
        if not self.training or q_pos is not k_pos or self.args.augment not in self.augments:
            return q_pos, k_pos
        if self.args.augment == "randomized" and self.args.randomized_per_layer:
            pos = self.train_positions(q_pos, batch)
            return pos, pos
        pos = self.memo("augment", (q_pos,), torch.float64, lambda: self.train_positions(q_pos, batch))
        return pos, pos

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        q_pos, k_pos = self.augmented(q_pos, k_pos, q.shape[0])
        q = self._rotated(q, q_pos)
        if k.shape[-2]:  # cross-attention with a cached memory passes no keys
            k = self._rotated(k, k_pos)
        return q, k


@POSITIONS.register("xpos")
class XposPosition(RotaryPosition):
    """xPos (Sun et al. 2023): RoPE with queries scaled by zeta^(i/gamma) and keys by zeta^(-j/gamma),
    so that each rotated pair's contribution to q_i . k_j decays as zeta^((i - j)/gamma), with
    zeta_k = (2k/hd + 0.4) / 1.4 for the pair k < hd/2 (low frequencies decay least) and gamma
    ``model.position.xpos_scale_base`` (512 in the paper).

    Decoder self-attention only (``causal``): the scaling is a decay only for keys at or before the
    query; for keys after it (the encoder) it grows with the distance. A symmetric decay
    zeta^(|i - j|/gamma) is no product of a per-query and a per-key scale, so it cannot ride on the
    rotation (it would take two score matrices per call, outside every fused kernel): the encoder and
    cross-attention take plain RoPE. Positions are not centred (the reference centres them against
    overflow over long documents): at translation lengths zeta^(+-n/gamma) stays within
    [0.08, 12.3] for n <= 1024. Under ``train.fp16`` the key scale overflows past a few thousand
    positions (``fp16_positions``), and a config whose sequences or translations may reach beyond
    that is refused when it loads."""

    #: no augmentation: the decoder's scaled rotation reads the positions as they are, so an augmentation
    #: would reach the encoder (plain RoPE) only; refused when the config loads rather than half applied
    augments: ClassVar[tuple[str, ...]] = ()
    #: the paper's gamma_0 of zeta_k = (2k/hd + gamma_0) / (1 + gamma_0)
    zeta_offset = 0.4
    #: in fp16 the key scale zeta^(-j/gamma) times a key element must stay below fp16's maximum: the
    #: scale is kept at or below 65504 / FP16_HEADROOM, room for key elements up to this magnitude
    FP16_HEADROOM = 256.0

    @classmethod
    def fp16_positions(cls, scale_base: float) -> int:
        """The last position whose key scale zeta_0^(-j/gamma) (zeta_0 = 0.4 / 1.4, the largest of
        the scales) stays within 65504 / ``FP16_HEADROOM``: 2,266 positions for gamma = 512."""
        zeta0 = cls.zeta_offset / (1 + cls.zeta_offset)
        return int(scale_base * math.log(65504.0 / cls.FP16_HEADROOM) / math.log(1 / zeta0))

    def zeta(self, device: torch.device) -> Tensor:
        """zeta_k of each dimension in the half-split layout: (hd,) float64."""
        hd = self.args.head_dim
        two_k = torch.arange(0, hd, 2, dtype=torch.float64, device=device)
        z = (two_k / hd + self.zeta_offset) / (1 + self.zeta_offset)
        return torch.cat((z, z))

    def decay(self, pos: Tensor, sign: float) -> Tensor:
        """zeta^(sign * pos / gamma): (L, hd) float32."""
        exponent = sign * pos.to(torch.float64)[:, None] / self.args.xpos_scale_base
        return torch.pow(self.zeta(pos.device)[None, :], exponent).float()

    def _scaled(self, x: Tensor, pos: Tensor, sign: float, key: str) -> Tensor:
        cos, sin = self.memo(key, (pos,), x.dtype, lambda: self.tables(pos, x.dtype, self.decay(pos, sign)))
        t = x.transpose(1, 2)  # (B, L, H, hd), as RoPE
        return (t * cos + (t * sin).roll(t.shape[-1] // 2, dims=-1)).transpose(1, 2)

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        if not self.args.causal:
            return super().rotate(q, k, q_pos, k_pos)
        q = self._scaled(q, q_pos, 1.0, "xpos_q")
        if k.shape[-2]:
            k = self._scaled(k, k_pos, -1.0, "xpos_k")
        return q, k
