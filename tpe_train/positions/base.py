"""The position-encoding interface: one module, three hooks with identity defaults.

Attention calls the hooks an encoding defines and never branches on its name:

- ``embed(x, pos)``: added to the token embeddings (sinusoidal, learned absolute).
- ``rotate(q, k, q_pos, k_pos)``: a rotation of queries and keys (RoPE).
- ``attn_bias(q, q_pos, k_pos)``: additive attention logits (T5 buckets, ALiBi, Shaw's relative keys).

An encoding whose logits need the keys too (CoPE) defines ``key_bias(q, k, q_pos, k_pos, keep)``, which
attention calls in place of ``attn_bias``.

What attention calls follows from what a class defines: defining ``attn_bias``, ``key_bias`` or
``value_term`` (or inheriting one) sets ``has_bias``, ``needs_keys`` or ``needs_weights``, which attention
reads (``PositionEncoding.__init_subclass__``). A class that declares one of these flags against its
hooks, or another impossible combination, is refused with a TypeError when it is defined: for an
encoding of the user's own package, when its entry point is imported.

FlexAttention takes the same logit term as a ``score_mod`` (``score_mod(q, q_pos, k_pos)``): a function
of one score and its (batch, head, query index, key index) that never builds the dense (B, H, Lq, Lk)
bias. The base class derives it from ``attn_bias`` (correct for any encoding, dense); encodings whose
term is a lookup (T5's table by bucket, ALiBi's slope by distance, Shaw's q.R^T by clipped distance)
override it with that lookup.

Positions are 1-D ``long`` tensors that carry their offset, so incremental decoding with a KV cache
sees exactly the positions of the full pass. They stay on the device: no hook reads a position back
to the host (no ``int(pos[-1])``), so a step never waits for the GPU and compiles without graph breaks.
Encodings that need the attention weights themselves (Shaw's relative values) define ``value_term``;
attention then computes its weights explicitly (an instance may turn ``needs_weights`` off in its
``__init__``: Shaw without relative values).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar, TypeVar

import torch
from torch import Tensor, nn

from tpe_train.positions.augment import AUGMENTS, TEST_SEED, augment_positions, decode_draw, eval_draw
from tpe_train.positions.registry import Registry

#: FlexAttention's score_mod: (score, batch, head, q_idx, kv_idx) -> modified score (0-d tensors)
ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]

T = TypeVar("T")


#: what ``randomized_test``, the test-time setting of an encoding that takes ``randomized``, does
RANDOMIZED_TEST_SETTING = (
    "true: draw self-attention's positions at test time as in training (trained with "
    "model.position.augment=randomized); false: positions 0, 1, 2, ..."
)
#: what ``shift``, the test-time setting of an encoding that takes ``shape``, does
SHIFT_SETTING = (
    "K >= 0: self-attention's positions K, K+1, ... at test time instead of 0, 1, ... (SHAPE's shift "
    "invariance: a model trained with model.position.augment=shape scores alike for any K up to "
    "augment_max_shift)"
)


@dataclass(frozen=True, kw_only=True)
class PositionArgs:
    """Everything an encoding may need; each class reads the fields it uses."""

    d_model: int
    n_heads: int
    causal: bool  # decoder self-attention (True) or encoder / bidirectional (False)
    max_positions: int = 1024  # rows of the learned absolute table
    shaw_clip: int = 16  # Shaw et al.: relative distances clipped to [-k, k]
    shaw_values: bool = False  # Shaw et al.: also add relative value embeddings
    t5_buckets: int = 32  # T5 relative-attention buckets
    t5_max_distance: int = 128  # T5: distances beyond this share the last bucket
    rope_base: float = 10000.0  # RoPE frequency base
    augment: str = "none"  # training-time position augmentation: none, shape, cape, randomized
    augment_max_shift: int = 500  # shape: offsets k ~ U{0..K}
    cape_shift: float = 5.0  # cape: global shift ~ U[-S, S]
    cape_jitter: float = 0.5  # cape: per-position jitter ~ U[-e, e]
    cape_scale: float = 1.03  # cape: scale, log-uniform in [1/s, s]
    randomized_range: int = 1024  # randomized: positions drawn from {0..R-1}
    randomized_per_layer: bool = True  # randomized on rope: a fresh draw in every layer (the reference's)
    randomized_test: bool = True  # randomized: self-attention's positions drawn at test time too (reference)
    sandwich_dim: int = 128  # Sandwich: d', the width of the sinusoidal embeddings whose product is the bias
    fire_width: int = 32  # FIRE: hidden units of the MLP f
    fire_threshold: float = 512.0  # FIRE: initial L of the normaliser psi(max(L, i))
    xpos_scale_base: float = 512.0  # xPos: gamma, the distance over which the decay is zeta
    cope_positions: int = 64  # CoPE: columns of the position table (larger counts take the last)
    cope_divide: bool = True  # CoPE: q.e[p] divided by sqrt(hd) with q.k, as the authors' code by default

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


#: flag -> hook: attention calls the hook when the flag is set, and the class's hooks set the flag
HOOK_FLAGS = {"has_bias": "attn_bias", "needs_keys": "key_bias", "needs_weights": "value_term"}
#: the values of ``PositionEncoding.tp_split``
TP_SPLITS = ("heads", "positions", "replicated")


class PositionEncoding(nn.Module):
    """Base class: identity hooks. Subclasses override what they need."""

    #: one instance per layer (Shaw) rather than one shared by all layers of a stack
    per_layer: ClassVar[bool] = False
    #: attention computes its weights explicitly and calls ``value_term``: set for a class that defines
    #: ``value_term``; an instance may turn it off in ``__init__`` (Shaw without relative values)
    needs_weights: bool = False
    #: attention calls ``attn_bias`` (otherwise it keeps the fused causal path): set for a class that
    #: defines ``attn_bias``
    has_bias: ClassVar[bool] = False
    #: ``attn_bias`` depends on the positions only (not on the values of ``q``) and one module serves every
    #: layer of a stack (T5, ALiBi): attention folds it into its dense mask once per batch and attention
    #: kind and shares that mask, and its backward, across the layers
    shared_bias: ClassVar[bool] = False
    #: the logit term needs the keys as well as the queries (CoPE): attention calls ``key_bias``; set for
    #: a class that defines ``key_bias``
    needs_keys: ClassVar[bool] = False
    #: how tensor parallelism treats this encoding's tables: "heads" (one column per head, narrowed by
    #: ``keep_heads``), "positions" (an absolute table split along positions) or "replicated"
    tp_split: ClassVar[str] = "replicated"
    #: training-time position augmentations this encoding applies (``positions/augment.py``)
    augments: ClassVar[tuple[str, ...]] = ()
    #: why this encoding has no exported form (CTranslate2, transformers): the exporters' refusal quotes
    #: it (an encoding of the user's own package may say what it would take); None: the default reason
    export_note: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Set ``has_bias``, ``needs_keys`` and ``needs_weights`` from the hooks the class defines (its
        own or inherited); a TypeError, naming the class and the fix, for one that declares them
        against its hooks or combines what attention cannot serve."""
        super().__init_subclass__(**kwargs)
        for flag, hook in HOOK_FLAGS.items():
            defined = defines(cls, hook)
            if flag not in cls.__dict__:
                setattr(cls, flag, defined)
            elif cls.__dict__[flag] != defined:
                raise TypeError(refusal(cls, flag_contradiction(flag, hook, cls.__dict__[flag], defined)))
        why = combination_error(cls)
        if why is not None:
            raise TypeError(refusal(cls, why))

    def __init__(self, args: PositionArgs) -> None:
        super().__init__()
        self.args = args
        self.shift = 0  # test-time offset of self-attention's positions (``adapt``: shift=K)
        # Global indices of the heads this module serves; a tensor-parallel plan narrows it.
        self.heads: list[int] = list(range(args.n_heads))

    @property
    def max_length(self) -> int | None:
        """Longest sequence this encoding can represent (``None``: unbounded)."""
        return None

    def train_positions(self, pos: Tensor, batch: int) -> Tensor:
        """The positions a hook uses: ``pos`` itself in evaluation, in decoding and without
        augmentation; in training with ``args.augment`` among ``augments``, (batch, L) positions
        drawn by ``augment_positions`` (a fresh draw at each call)."""
        a = self.args
        if not self.training or a.augment not in self.augments:
            return pos
        return augment_positions(
            pos,
            batch,
            a.augment,
            max_shift=a.augment_max_shift,
            cape_shift=a.cape_shift,
            cape_jitter=a.cape_jitter,
            cape_scale=a.cape_scale,
            randomized_range=a.randomized_range,
        )

    def train(self, mode: bool = True) -> PositionEncoding:
        """As ``nn.Module.train``; entering evaluation also restarts the generator of the test-time
        draws (``randomized_test``), so every evaluation draws the same positions."""
        if not mode:
            self.__dict__.pop("_test_gen", None)
        return super().train(mode)

    def trained_randomized(self) -> bool:
        """Whether this encoding takes ``randomized`` and was trained with it."""
        return self.args.augment == "randomized" and "randomized" in self.augments

    def draws_at_test(self) -> bool:
        """Whether self-attention's positions are drawn in evaluation and decoding: ``randomized``
        with ``randomized_test``, for an encoding that takes it, out of training."""
        return not self.training and self.trained_randomized() and self.args.randomized_test

    def _test_generator(self) -> torch.Generator:
        gen: torch.Generator | None = self.__dict__.get("_test_gen")
        if gen is None:
            gen = torch.Generator().manual_seed(TEST_SEED + int(self.args.causal))
            self.__dict__["_test_gen"] = gen
        return gen

    def test_positions(self, pos: Tensor) -> Tensor:
        """Self-attention's positions for a batch whose (L,) positions are ``pos`` (0..L-1): ``pos``
        itself (plus a test-time ``shift``), or where ``draws_at_test`` a sorted draw of L from 0..R-1
        shared by the batch."""
        if not self.draws_at_test():
            return pos + self.shift if self.shift else pos
        return eval_draw(pos.shape[0], self.args.randomized_range, self._test_generator()).to(pos.device)

    def decode_positions(self, expected: int, limit: int, device: torch.device) -> Tensor | None:
        """The decoder's self-attention positions (limit,) for incremental decoding of up to ``limit``
        steps from a source of ``expected`` tokens, or None (0, 1, 2, ...): where ``draws_at_test``,
        ``augment.decode_draw``; with a test-time ``shift``, shift, shift + 1, ..."""
        if not self.draws_at_test():
            return torch.arange(limit, device=device) + self.shift if self.shift else None
        return decode_draw(expected, limit, self.args.randomized_range, self._test_generator()).to(device)

    def embed(self, x: Tensor, pos: Tensor) -> Tensor:
        """x: (B, L, D) scaled token embeddings; pos: (L,) -> (B, L, D)."""
        return x

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        """q: (B, H, Lq, hd), k: (B, H, Lk, hd) -> rotated (q, k)."""
        return q, k

    def attn_bias(self, q: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor | None:
        """Additive logits broadcastable to (B, H, Lq, Lk) for the heads in ``self.heads``, or ``None``.

        ``q`` is the (B, H, Lq, hd) query (content-dependent biases use it).
        """
        return None

    def key_bias(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, keep: Tensor | None) -> Tensor:
        """For ``needs_keys`` encodings: the additive logits (B, H, Lq, Lk) from queries (B, H, Lq, hd)
        and keys (B, H, Lk, hd); ``keep`` (B, 1, 1, Lk) is False at padded keys. Every backend takes it
        (flex as a lookup in it); encodings without ``needs_keys`` never see the keys."""
        raise NotImplementedError

    def score_mod(self, q: Tensor, q_pos: Tensor, k_pos: Tensor) -> ScoreMod | None:
        """``attn_bias`` as FlexAttention's ``score_mod``: ``score + bias[b, h, q_idx, kv_idx]``, or None.

        ``q_idx`` and ``kv_idx`` index the query and key tensors; ``q_pos[q_idx]`` and
        ``k_pos[kv_idx]`` are their positions (offsets included). ``h`` is the local head, i.e.
        ``self.heads[h]`` globally. This default materialises the dense bias once per call; encodings
        override it with a lookup that does not.
        """
        if not self.has_bias:
            return None
        bias = self.attn_bias(q, q_pos, k_pos)  # (1|B, h, Lq, Lk)
        if bias is None:
            return None
        bias = bias.expand(q.shape[0], -1, q.shape[2], k_pos.shape[0])

        def mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return score + bias[b, h, q_idx, kv_idx].to(score.dtype)

        return mod

    def memo(self, key: str, positions: tuple[Tensor, ...], dtype: torch.dtype, build: Callable[[], T]) -> T:
        """``build()``, built once per batch and reused by every layer of the stack: kept while the same
        position tensors (by identity: a ``Mask`` passes the same ones to every layer) and compute dtype
        come back, replaced at the next batch. Terms of the positions only (no gradient, no state).
        Not kept inside compiled code, where the compiler fuses the recomputation instead."""
        if torch.compiler.is_compiling():
            return build()
        memo: dict[str, tuple[tuple[Tensor, ...], torch.dtype, Any]] = self.__dict__.setdefault("_memo", {})
        hit = memo.get(key)
        if (
            hit is not None
            and hit[1] == dtype
            and len(hit[0]) == len(positions)
            and all(a is b for a, b in zip(hit[0], positions, strict=True))
        ):
            value: T = hit[2]
            return value
        value = build()
        memo[key] = (positions, dtype, value)
        return value

    def head_dims(self) -> dict[str, int]:
        """For ``tp_split = "heads"``: the dimension of each parameter (by name) that holds one entry per
        head, narrowed by ``keep_heads``; a parameter not named serves every head (each rank keeps all
        of it, its gradient summed over the group). Default: every parameter, along its last dimension."""
        return {name: param.dim() - 1 for name, param in self.named_parameters()}

    def keep_heads(self, heads: list[int]) -> None:
        """Serve only the global heads ``heads`` (a tensor-parallel rank's share): per-head tables and
        constants keep only their rows, computed from the global indices. Head-agnostic encodings
        only record the list."""
        self.heads = list(heads)

    #: test-time settings ``adapt`` accepts, each with its meaning (empty: none)
    settings: ClassVar[dict[str, str]] = {}

    def adapt(self, **settings: str) -> None:
        """Change this encoding of a trained model at test time, without new parameters in its state
        dict (length extrapolation: RoPE scaling, ALiBi slope scale, T5 buckets, learned interpolation).
        Values are given as text and read by the encoding; an unknown name raises a ValueError naming
        the valid ones. The identity setting (factor 1) leaves outputs bitwise unchanged. An encoding
        trained with ``randomized`` also takes ``randomized_test=true|false`` (``draws_at_test``)."""
        known = dict(self.settings)
        if self.trained_randomized():
            known["randomized_test"] = RANDOMIZED_TEST_SETTING
        if "shape" in self.augments:
            known["shift"] = SHIFT_SETTING
        unknown = sorted(set(settings) - set(known))
        if unknown:
            valid = ", ".join(sorted(known)) or "none"
            raise ValueError(
                f"{type(self).__name__} has no test-time setting {', '.join(unknown)} (valid: {valid})"
            )
        if "randomized_test" in settings:
            value = settings["randomized_test"].lower()
            if value not in ("true", "false"):
                raise ValueError(f"position setting randomized_test={value!r}: give true or false")
            self.args = replace(self.args, randomized_test=value == "true")
        if "shift" in settings:
            shift = self.setting(settings, "shift", int, 0)
            if shift < 0:
                raise ValueError(f"position setting shift={shift}: give an offset of 0 or more")
            self.shift = shift
        if self.shift and self.trained_randomized() and self.args.randomized_test:
            raise ValueError(
                "position setting shift: this model draws its positions at test time (trained with "
                "augment=randomized); add randomized_test=false to shift positions 0, 1, 2, ..."
            )
        self.__dict__.pop("_memo", None)  # terms built before the change are stale

    @staticmethod
    def setting(settings: dict[str, str], name: str, cast: Callable[[str], T], default: T) -> T:
        """``settings[name]`` read by ``cast`` (``default`` when absent); ValueError names a bad one."""
        if name not in settings:
            return default
        try:
            return cast(settings[name])
        except ValueError:
            raise ValueError(
                f"position setting {name}={settings[name]!r}: not a valid {cast.__name__}"
            ) from None

    def value_term(self, weights: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """weights: (B, H, Lq, Lk) attention probabilities -> (B, H, Lq, hd) added to the output."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"heads={len(self.heads)}"


POSITIONS: Registry[type[PositionEncoding]] = Registry("position encoding")


def defines(cls: type, hook: str) -> bool:
    """Whether ``cls`` defines ``hook`` itself or inherits it from a class other than the base."""
    return getattr(cls, hook) is not getattr(PositionEncoding, hook)


def refusal(cls: type, why: str) -> str:
    """The TypeError's text: the class by module and name, then why and the fix."""
    return f"position encoding class {cls.__module__}.{cls.__qualname__}: {why}"


def flag_contradiction(flag: str, hook: str, declared: object, defined: bool) -> str:
    """Why a class's own ``flag = declared`` cannot stand beside its hooks, and the fix."""
    if defined:
        return (
            f"it sets {flag} = {declared!r} but defines {hook}, and {flag} follows from {hook} (attention "
            f"calls {hook} because the class defines it); remove the {flag} line"
        )
    return (
        f"it sets {flag} = {declared!r} but defines no {hook}, and {flag} follows from {hook} (attention "
        f"calls {hook} because the class defines it); remove the {flag} line, or define {hook}"
    )


def combination_error(cls: type[PositionEncoding]) -> str | None:
    """Why attention cannot serve this combination of hooks and class attributes (None: it can)."""
    if cls.has_bias and cls.needs_keys:
        return (
            "it defines both attn_bias and key_bias, but attention calls key_bias in place of attn_bias "
            "(and of score_mod); return the whole logit term from key_bias and remove attn_bias"
        )
    if defines(cls, "score_mod") and not cls.has_bias:
        return (
            "it defines score_mod but no attn_bias: score_mod is attn_bias's term for the flex backend, "
            "and the sdpa and explicit backends call attn_bias; define attn_bias too (score_mod is "
            "optional: the base class derives it from attn_bias)"
        )
    if cls.shared_bias and not cls.has_bias:
        return (
            "it sets shared_bias = True but defines no attn_bias, the term shared_bias shares across "
            "layers; define attn_bias (a term of the positions only) or remove the shared_bias line"
        )
    if cls.shared_bias and cls.per_layer:
        return (
            "it sets both shared_bias (one module serves every layer of a stack) and per_layer (each "
            "layer has its own); remove one of the two lines"
        )
    if cls.tp_split not in TP_SPLITS:
        return f"it sets tp_split = {cls.tp_split!r}, not one of {', '.join(TP_SPLITS)}; choose one"
    unknown = [a for a in cls.augments if a not in AUGMENTS[1:]]
    if unknown or isinstance(cls.augments, str):
        return (
            f"it sets augments = {cls.augments!r}, not a tuple of {', '.join(AUGMENTS[1:])}; list the "
            "augmentations the encoding applies, or none"
        )
    return None


def relative_distance(q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """(Lq, Lk) matrix of j - i (key position minus query position)."""
    return k_pos[None, :] - q_pos[:, None]


def build_position(kind: str, args: PositionArgs) -> PositionEncoding:
    """Instantiate the encoding registered as ``kind``."""
    return POSITIONS.get(kind)(args)


def head_index(heads: list[int], device: torch.device) -> Tensor:
    return torch.tensor(heads, dtype=torch.long, device=device)
