"""Routed-expert weights in two pools (hot in HBM, cold in host memory) and the int32 row map.

Every MoE layer's routed experts live in one shared *hot pool* and one shared *cold pool* per
weight (w13 = gate and up fused ``[2I, H]``, w2 = down ``[H, I]``). The row map, int32
``[num_moe_layers, num_experts]``, says where each (layer, expert) is: ``r >= 0`` is row ``r`` of
the hot pool, ``r < 0`` is row ``-r - 1`` of the cold pool (docs/design.md §3). A placement is a row
map, never code: the model and the kernel are the same for every placement.

The unmodified path is the all-hot layout: the hot pool is the model's stacked expert tensor in
module order, so (layer, expert) is row ``layer * E + expert``.

On CUDA the cold pool is pinned host memory that kernels read in place (zero-copy over UVA): the
Triton kernel takes the pinned CPU tensor as a pointer. The pool tensors and the row map never
change address after :func:`build_pools`, so a captured CUDA graph stays valid when a placement
changes: a new placement is a write into the row map (:meth:`ExpertPools.set_row_map`), or a
move of weights plus that write (:meth:`ExpertPools.apply_placement`).

A model evaluated at many placements (the parity and bench stages) pins its cold tier once:
:func:`host_tier` copies every expert of the all-hot pools into one host allocation (pinned on
CUDA), and :meth:`ExpertPools.placed` makes each placement a compact hot pool in device memory
plus a row map whose cold entries point at that copy's row ``layer * E + expert``. Pinning is the
slow part (58 GB took 38.5 s on the H200 host, 1.5 GB/s); a placement then costs only its hot
pool's device copy.

Every row map is validated before a kernel can read through it (rows inside the pools, no row
used twice): an out-of-range read of host memory must be impossible.

Block-FP8 experts (:mod:`coldset.core.fp8`) keep their float8_e4m3fn bytes in the weight pools
and their float32 ``weight_scale_inv`` blocks in a *scale pool* beside each weight pool, indexed
by the same row map: row ``r`` of ``w13_scale_hot`` holds the scales of row ``r`` of
``w13_hot``, so a cold expert's scales live in the host tier beside its weights, and every
operation here (placing, moving, the host tier) carries both.

MXFP4 experts (:mod:`coldset.core.mxfp4`, gpt-oss as published) are laid out the same way: the
weight pools hold the packed e2m1 bytes, uint8 ``[rows, 2I, H / 2]`` and ``[rows, H, I / 2]`` (a
checkpoint's ``*_blocks`` ``[N, K / 32, 16]`` with its last two dimensions flattened, w13's rows
gate's then up's: :func:`coldset.core.mxfp4.w13_from_checkpoint`), and the scale pools their uint8
e8m0 scales ``[rows, 2I, H / 32]`` and ``[rows, H, I / 32]``, one row per weight row in the same
tier. :attr:`ExpertPools.has_scales` is what every move, copy and fill asks: a scaled expert moves
with its scales, whatever the format.

Expert biases (gpt-oss: ``w13_bias`` ``[L, E, 2I]``, gate's half then up's as w13's rows, and
``w2_bias`` ``[L, E, H]``) and the experts' :class:`~coldset.kernels.activation.Activation` are not
pooled: the biases stay on the compute device for every expert and the kernels read them by
(layer, expert id), never through the row map. They are small (2I + H values an expert: 8,640 at
gpt-oss-120b shape, 17 KB in bf16 beside a 13 MB MXFP4 expert), so keeping all of them resident
costs little and placing, moving, slot fills and the host tier never touch them; their bytes are
resident overhead (:attr:`ExpertPools.bias_bytes`), not bytes an expert carries over the link.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass, field

import numpy as np
import torch

from coldset.core import fp8, mxfp4
from coldset.core.placement import validate_row_map
from coldset.kernels.activation import SILU, Activation


class PoolAllocationError(MemoryError):
    """The host cannot give the pinned (or plain) memory the cold pool needs."""


def _check_row_map(row_map, num_hot: int, num_cold: int, num_moe_layers: int, num_experts: int) -> None:
    """Refuse a row map that reads outside the pools or uses a row twice, before any launch.

    The project's one row-map validator, :func:`coldset.core.placement.validate_row_map`; pools with
    spare rows (``build_pools(num_hot=..., num_cold=...)``, or every expert kept in both tiers so
    a placement switch is a row-map write) may leave rows unused.
    """
    validate_row_map(row_map, num_hot, num_cold, num_moe_layers, num_experts, source="row_map",
                     allow_unused_rows=num_hot + num_cold > num_moe_layers * num_experts)


@dataclass
class ExpertPools:
    """The routed experts of a whole model, as two pools plus the row map that indexes them."""

    w13_hot: torch.Tensor  # [num_hot, 2I, H], on the compute device
    w2_hot: torch.Tensor  # [num_hot, H, I]
    w13_cold: torch.Tensor  # [num_cold, 2I, H], pinned host memory on CUDA, plain on CPU
    w2_cold: torch.Tensor  # [num_cold, H, I]
    row_map: torch.Tensor  # int32 [num_moe_layers, num_experts], on the compute device
    # row_map._version when it was last validated; a kernel re-validates if it moved.
    validated_version: int = field(default=-1, repr=False, compare=False)
    # Block-FP8 experts only (None otherwise): float32 weight_scale_inv per 128 x 128 block, one
    # row per weight row in the same tier (coldset.core.fp8: w13's grid is gate's then up's).
    w13_scale_hot: torch.Tensor | None = None  # [num_hot, 2 * ceil(I / 128), ceil(H / 128)]
    w2_scale_hot: torch.Tensor | None = None  # [num_hot, ceil(H / 128), ceil(I / 128)]
    w13_scale_cold: torch.Tensor | None = None  # [num_cold, ...], in the cold pool's memory
    w2_scale_cold: torch.Tensor | None = None
    # Expert biases (both or neither), on the compute device, indexed by (layer, expert id), never by
    # row: w13_bias [L, E, 2I] (gate's half, then up's), w2_bias [L, E, H] (module doc).
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    activation: Activation = SILU
    # A slot cache's compressed fills (coldset.kernels.triton_codec_fill.ListedFill; None: fills copy the cold
    # pool's rows): set by SlotCache.build(compressed=...) on CUDA, read by triton_slots.fill's dispatch.
    compressed_fill: object | None = field(default=None, repr=False, compare=False)

    SCALE_FIELDS = ("w13_scale_hot", "w2_scale_hot", "w13_scale_cold", "w2_scale_cold")

    @property
    def has_bias(self) -> bool:
        """Whether the experts add biases after their two GEMMs (``w13_bias`` and ``w2_bias``)."""
        return self.w13_bias is not None

    @property
    def bias_bytes(self) -> int:
        """Bytes of the expert biases: resident on the compute device whatever the placement (module doc)."""
        return sum(t.numel() * t.element_size() for t in (self.w13_bias, self.w2_bias) if t is not None)

    @property
    def has_scales(self) -> bool:
        """Whether the experts carry scale pools (block-FP8 or MXFP4): what moves with an expert."""
        return self.w13_scale_hot is not None

    @property
    def expert_parts(self) -> tuple[str, ...]:
        """The pools an expert's copy moves, by name (``w13``, ``w2`` and, scaled, ``w13_scale``,
        ``w2_scale``): each is ``{name}_hot`` / ``{name}_cold``. The biases stay resident."""
        return ("w13", "w2", "w13_scale", "w2_scale") if self.has_scales else ("w13", "w2")

    @property
    def is_fp8(self) -> bool:
        """Whether the experts are block-FP8 (weights float8_e4m3fn, scales in the scale pools)."""
        return self.has_scales and self.w13_hot.dtype == fp8.FP8_DTYPE

    @property
    def is_mxfp4(self) -> bool:
        """Whether the experts are MXFP4 (packed e2m1 uint8 weights, e8m0 uint8 scale pools)."""
        return self.has_scales and self.w13_hot.dtype == torch.uint8

    def __post_init__(self) -> None:
        self.check_layout()

    def check_layout(self) -> None:
        """Refuse tensors the Triton kernel would read wrongly, naming the tensor.

        The kernel addresses an expert's matrix as ``base + row * (rows * cols)`` and its elements
        row-major, and the same row stride for the hot and the cold pool: every pool tensor and the
        row map must be contiguous (a padded, transposed or sliced view gives wrong results with no
        error otherwise), the two tiers of a weight must hold the same matrix shape and dtype.
        Called at construction and by :func:`coldset.kernels.triton_experts` before each launch
        (attribute reads only: no copy, no device sync). :meth:`all_hot` makes its inputs
        contiguous; a cold pool cannot be made contiguous here, since a copy would not be pinned.
        """
        for name in ("w13_hot", "w2_hot", "w13_cold", "w2_cold", "row_map"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"ExpertPools.{name}: expected a torch.Tensor, got {type(t).__name__}")
            if not t.is_contiguous():
                raise ValueError(
                    f"ExpertPools.{name}: shape {tuple(t.shape)} with strides {t.stride()} is not contiguous; "
                    f"the experts kernel reads pools row-major with no padding (a padded, transposed or "
                    f"sliced view would give wrong results): pass .contiguous() tensors or build the pools "
                    f"with ExpertPools.all_hot / build_pools, which copy into contiguous pools")
        for w in ("w13", "w2"):
            hot, cold = getattr(self, f"{w}_hot"), getattr(self, f"{w}_cold")
            if hot.dim() != 3 or cold.dim() != 3 or hot.shape[1:] != cold.shape[1:] or hot.dtype != cold.dtype:
                raise ValueError(f"ExpertPools.{w}_hot {tuple(hot.shape)} ({hot.dtype}) and {w}_cold "
                                 f"{tuple(cold.shape)} ({cold.dtype}) must be [rows, m, n] of one matrix shape and dtype")
        self._check_scales()
        self._check_biases()

    def _check_biases(self) -> None:
        """Both biases or neither; each contiguous, on the row map's device, ``[L, E, 2I]`` /
        ``[L, E, H]``, of a float dtype: the weights' dtype for bf16/fp16/fp32 experts (transformers
        adds them in the model dtype), bf16, fp16 or fp32 for block-FP8 experts; the activation an
        :class:`~coldset.kernels.activation.Activation`."""
        if not isinstance(self.activation, Activation):
            raise TypeError(f"ExpertPools.activation: expected an Activation, got {type(self.activation).__name__}")
        if self.w13_bias is None and self.w2_bias is None:
            return
        if self.w13_bias is None or self.w2_bias is None:
            missing = "w13_bias" if self.w13_bias is None else "w2_bias"
            raise ValueError(f"ExpertPools.{missing}: expert biases come as a pair (w13_bias and w2_bias); "
                             f"pass zeros for a projection without bias")
        L, E = self.num_moe_layers, self.num_experts
        hidden, inter = self.w2_hot.shape[1], self.w2_hot.shape[2] * (2 if self.w2_hot.dtype == torch.uint8 else 1)
        weight_dtype = self.w13_hot.dtype
        scaled = weight_dtype in (fp8.FP8_DTYPE, torch.uint8)
        allowed = (torch.bfloat16, torch.float16, torch.float32) if scaled else (weight_dtype,)
        for name, want in (("w13_bias", (L, E, 2 * inter)), ("w2_bias", (L, E, hidden))):
            b = getattr(self, name)
            if not isinstance(b, torch.Tensor):
                raise TypeError(f"ExpertPools.{name}: expected a torch.Tensor, got {type(b).__name__}")
            if tuple(b.shape) != want:
                raise ValueError(f"ExpertPools.{name}: shape {tuple(b.shape)}, expected {want} ([L, E, "
                                 f"{'2I' if name == 'w13_bias' else 'H'}] for these pools)")
            if b.dtype not in allowed:
                raise ValueError(f"ExpertPools.{name}: dtype {b.dtype}, expected one of "
                                 f"{[str(d) for d in allowed]} for {weight_dtype} experts")
            if b.dtype != self.w13_bias.dtype:
                raise ValueError(f"ExpertPools.w2_bias: dtype {b.dtype} differs from w13_bias's {self.w13_bias.dtype}")
            if b.device != self.row_map.device:
                raise ValueError(f"ExpertPools.{name}: on {b.device}, expected the compute device {self.row_map.device} "
                                 f"(biases stay resident, read by expert id)")
            if not b.is_contiguous():
                raise ValueError(f"ExpertPools.{name}: strides {b.stride()} are not contiguous; the kernels read "
                                 f"[L, E, n] row-major: pass .contiguous()")

    def _check_scales(self) -> None:
        """Scaled pools: every scale pool present, contiguous, one row per weight row, its weight's
        grid: FP8 float32 ``weight_scale_inv`` blocks (:mod:`coldset.core.fp8`), MXFP4 uint8 e8m0
        per 32 inputs of each row (:mod:`coldset.core.mxfp4`). Float pools: no scale pool and no
        float8 or packed uint8 weights (a weight without its scales would be read as if its scale
        were 1)."""
        present = [getattr(self, name) is not None for name in self.SCALE_FIELDS]
        dtype = self.w13_hot.dtype
        if not any(present):
            if fp8.FP8_DTYPE in (dtype, self.w2_hot.dtype):
                raise ValueError("ExpertPools: float8 expert weights without their weight_scale_inv pools "
                                 "(w13_scale_hot, w2_scale_hot, w13_scale_cold, w2_scale_cold)")
            if torch.uint8 in (dtype, self.w2_hot.dtype):
                raise ValueError("ExpertPools: MXFP4 (uint8 packed e2m1) expert weights without their e8m0 scale "
                                 "pools (w13_scale_hot, w2_scale_hot, w13_scale_cold, w2_scale_cold)")
            return
        if not all(present):
            missing = [n for n, p in zip(self.SCALE_FIELDS, present) if not p]
            raise ValueError(f"ExpertPools: scaled pools need all four scale pools; missing {missing}")
        if dtype == fp8.FP8_DTYPE:
            inter, hidden = self.w2_hot.shape[2], self.w2_hot.shape[1]
            grids = {"w13": (fp8.w13_scale_rows(inter), fp8.scale_grid(inter, hidden)[1]),
                     "w2": fp8.scale_grid(hidden, inter)}
            scale_dtype = torch.float32
        elif dtype == torch.uint8:  # packed e2m1: a row of K inputs is K / 2 bytes with K / 32 scales
            inter, hidden = 2 * self.w2_hot.shape[2], self.w2_hot.shape[1]
            if tuple(self.w13_hot.shape[1:]) != (2 * inter, hidden // 2):
                raise ValueError(f"ExpertPools.w13_hot: MXFP4 rows {tuple(self.w13_hot.shape[1:])}, expected "
                                 f"{(2 * inter, hidden // 2)} beside w2 {tuple(self.w2_hot.shape[1:])} ([2I, H/2], [H, I/2])")
            if hidden % mxfp4.BLOCK or inter % mxfp4.BLOCK:
                raise ValueError(f"ExpertPools: MXFP4 experts need H and I multiples of {mxfp4.BLOCK}, got H={hidden}, "
                                 f"I={inter}")
            grids = {"w13": (2 * inter, hidden // mxfp4.BLOCK), "w2": (hidden, inter // mxfp4.BLOCK)}
            scale_dtype = torch.uint8
        else:
            raise ValueError(f"ExpertPools: scale pools beside {dtype} weights: scaled experts hold block-FP8 "
                             "(float8_e4m3fn weights) or MXFP4 (uint8 packed e2m1 weights)")
        fmt = "FP8" if dtype == fp8.FP8_DTYPE else "MXFP4"
        for w in ("w13", "w2"):
            for tier in ("hot", "cold"):
                wt, st = getattr(self, f"{w}_{tier}"), getattr(self, f"{w}_scale_{tier}")
                name = f"ExpertPools.{w}_scale_{tier}"
                if wt.dtype != dtype:
                    raise ValueError(f"ExpertPools.{w}_{tier}: {fmt} pools hold {dtype} weights, got {wt.dtype}")
                if not isinstance(st, torch.Tensor) or st.dtype != scale_dtype or not st.is_contiguous():
                    raise ValueError(f"{name}: expected a contiguous {scale_dtype} tensor ({fmt} scales)")
                if tuple(st.shape) != (wt.shape[0], *grids[w]) or st.device != wt.device:
                    raise ValueError(f"{name}: shape {tuple(st.shape)} on {st.device}, expected "
                                     f"{(wt.shape[0], *grids[w])} on {wt.device} (one scale grid per row of {w}_{tier})")

    @classmethod
    def all_hot(cls, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor | None = None,
                w2_scale: torch.Tensor | None = None, *, w13_bias: torch.Tensor | None = None,
                w2_bias: torch.Tensor | None = None, activation: Activation = SILU) -> "ExpertPools":
        """Every expert in the hot pool in module order: the unmodified (reference) layout.

        ``w13`` is ``[L, E, 2I, H]`` and ``w2`` is ``[L, E, H, I]``; the pools are views of them
        when they are contiguous, and contiguous copies otherwise (a padded, transposed or sliced
        view, as vLLM's kernel tests build their weights: the kernel reads pools row-major, see
        :meth:`check_layout`). Block-FP8 experts pass their scales ``w13_scale`` ``[L, E,
        2 * ceil(I / 128), ceil(H / 128)]`` and ``w2_scale`` ``[L, E, ceil(H / 128), ceil(I / 128)]``;
        MXFP4 experts pass uint8 ``w13`` ``[L, E, 2I, H / 2]``, ``w2`` ``[L, E, H, I / 2]`` and their
        e8m0 scales ``[L, E, 2I, H / 32]``, ``[L, E, H, I / 32]`` (module doc; a scale of 255 is refused).
        Experts with biases pass ``w13_bias`` ``[L, E, 2I]`` and ``w2_bias`` ``[L, E, H]`` (kept as
        given, contiguous; module doc) and their ``activation``.
        """
        if w13.dim() != 4 or w2.dim() != 4 or w13.shape[:2] != w2.shape[:2]:
            raise ValueError(
                f"all_hot needs w13 [L, E, 2I, H] and w2 [L, E, H, I], got {tuple(w13.shape)} "
                f"and {tuple(w2.shape)}"
            )
        w13, w2 = w13.contiguous(), w2.contiguous()  # no copy when already contiguous
        num_layers, num_experts = w13.shape[:2]
        row_map = torch.arange(num_layers * num_experts, dtype=torch.int32, device=w13.device)
        pools = cls(
            w13_hot=w13.reshape(num_layers * num_experts, *w13.shape[2:]),
            w2_hot=w2.reshape(num_layers * num_experts, *w2.shape[2:]),
            w13_cold=w13.new_empty((0, *w13.shape[2:])),
            w2_cold=w2.new_empty((0, *w2.shape[2:])),
            row_map=row_map.reshape(num_layers, num_experts),
            **_scale_pools(w13_scale, w2_scale, num_layers * num_experts, w13.dtype),
            **_bias_fields(w13_bias, w2_bias, activation),
        )
        pools.validated_version = pools.row_map._version  # valid by construction
        return pools

    @property
    def num_moe_layers(self) -> int:
        return int(self.row_map.shape[0])

    @property
    def num_experts(self) -> int:
        return int(self.row_map.shape[1])

    @property
    def num_hot(self) -> int:
        return int(self.w13_hot.shape[0])

    @property
    def num_cold(self) -> int:
        return int(self.w13_cold.shape[0])

    def _require_all_hot(self, who: str) -> None:
        identity = torch.arange(self.num_hot, dtype=torch.int32, device=self.row_map.device)
        if self.num_cold or self.num_hot != self.num_moe_layers * self.num_experts \
                or not torch.equal(self.row_map.reshape(-1), identity):
            raise ValueError(f"{who} needs the all-hot layout (row = layer * E + expert)")

    def placed(self, row_map, host: "HostTier | None" = None) -> "ExpertPools":
        """These all-hot pools' experts laid out at a placement's ``row_map``.

        ``row_map`` is in the placement encoding (docs/design.md §3: hot rows ``0..num_hot-1``, cold
        rows ``-1..-num_cold``) and is validated first. The result's hot pool is a compact device
        copy of the hot experts at the rows the map gives them (``index_select`` from these
        pools); its cold pool is ``host`` (every expert, row ``layer * E + expert``, see
        :func:`host_tier`) and its row map sends each cold (layer, expert) to that row, so no host
        memory is allocated per placement and the hot/cold split is exactly the placement's.
        ``host`` defaults to a fresh host copy for this one call; a caller placing more than once
        makes it once with :func:`host_tier` and passes it. These pools must be the unmodified
        layout (:meth:`all_hot`). The result shares ``host``'s tensors: move weights in it with
        :meth:`set_row_map` maps only, never :meth:`apply_placement`, which would write into the
        shared copy. The expert biases and the activation are these pools' (the same tensors: they
        never move with a placement).
        """
        self._require_all_hot("ExpertPools.placed")
        if host is None:
            host = host_tier(self)
        host.check_matches(self)
        L, E = self.num_moe_layers, self.num_experts
        if isinstance(row_map, torch.Tensor):
            rm = row_map.detach().cpu()
        else:
            rm = torch.as_tensor(np.asarray(row_map))
        n_hot, n_cold = int((rm >= 0).sum()), int((rm < 0).sum())
        _check_row_map(rm, n_hot, n_cold, L, E)  # dtype, shape, range, each row once, every row used
        rm = rm.to(torch.int64)
        flat_idx = torch.arange(L * E, dtype=torch.int64).view(L, E)
        hot = rm >= 0
        hot_src = torch.empty(n_hot, dtype=torch.int64)
        hot_src[rm[hot]] = flat_idx[hot]  # hot row r holds (layer, expert) = divmod(hot_src[r], E)
        physical = torch.where(hot, rm, -flat_idx - 1).to(torch.int32)  # cold -> host row l*E+e
        device = self.w13_hot.device
        idx = hot_src.to(device)
        scales = {}
        if self.has_scales:
            scales = dict(w13_scale_hot=self.w13_scale_hot.index_select(0, idx),
                          w2_scale_hot=self.w2_scale_hot.index_select(0, idx),
                          w13_scale_cold=host.w13_scale, w2_scale_cold=host.w2_scale)
        pools = ExpertPools(
            w13_hot=self.w13_hot.index_select(0, idx),
            w2_hot=self.w2_hot.index_select(0, idx),
            w13_cold=host.w13,
            w2_cold=host.w2,
            row_map=physical.to(device).contiguous(),
            **scales,
            w13_bias=self.w13_bias,
            w2_bias=self.w2_bias,
            activation=self.activation,
        )
        pools.validate()
        return pools

    def expert_weights(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) of one expert, wherever it lives; for tests and the torch path."""
        row = int(self.row_map[layer, expert])
        if row >= 0:
            return self.w13_hot[row], self.w2_hot[row]
        return self.w13_cold[-row - 1], self.w2_cold[-row - 1]

    def expert_scales(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) scales of one scaled (FP8 or MXFP4) expert, from the tier its weights are in."""
        if not self.has_scales:
            raise ValueError("ExpertPools.expert_scales: these pools hold no scaled (FP8 or MXFP4) experts")
        row = int(self.row_map[layer, expert])
        if row >= 0:
            return self.w13_scale_hot[row], self.w2_scale_hot[row]
        return self.w13_scale_cold[-row - 1], self.w2_scale_cold[-row - 1]

    def _expert_tensors(self, layer: int, expert: int) -> tuple[torch.Tensor, ...]:
        """Weights then (FP8 or MXFP4) scales of one expert: what moves when the expert moves."""
        w = self.expert_weights(layer, expert)
        return (*w, *self.expert_scales(layer, expert)) if self.has_scales else w

    def validate(self, row_map=None) -> None:
        """Refuse a row map (default: the current one) that reads outside the pools or reuses a row."""
        rm = self.row_map if row_map is None else row_map
        _check_row_map(rm, self.num_hot, self.num_cold, self.num_moe_layers, self.num_experts)
        if row_map is None:
            self.validated_version = self.row_map._version

    def ensure_validated(self) -> None:
        """Validate the row map if it was written since the last validation (cheap when it was not).

        Called by the kernels before launching. Writes through :meth:`set_row_map` validate first;
        a direct in-place write bumps the tensor's version counter and is caught here.
        """
        if self.row_map._version != self.validated_version:
            self.validate()

    def set_row_map(self, new_row_map) -> None:
        """Switch placement by writing a new row map in place (same address: graphs stay valid).

        The caller guarantees the rows named hold the right experts (e.g. pools that keep every
        expert in both tiers, as the benchmark does); use :meth:`apply_placement` to move weights.
        The new map is validated before anything is written.
        """
        new = torch.as_tensor(np.asarray(new_row_map) if not isinstance(new_row_map, torch.Tensor) else new_row_map)
        self.validate(new)
        self.row_map.copy_(new.to(self.row_map.device))
        self.validated_version = self.row_map._version

    def apply_placement(self, new_row_map) -> None:
        """Move every expert into the row the new map gives it, then write the map (pools unchanged).

        Gathers all experts first (so cycles of moves are safe), validates before writing anything.
        """
        new = torch.as_tensor(np.asarray(new_row_map) if not isinstance(new_row_map, torch.Tensor) else new_row_map)
        self.validate(new)
        new_cpu = new.cpu()
        saved = [
            [tuple(t.to("cpu", copy=True) for t in self._expert_tensors(layer, expert)) for expert in range(self.num_experts)]
            for layer in range(self.num_moe_layers)
        ]
        names = self.expert_parts
        for layer in range(self.num_moe_layers):
            for expert in range(self.num_experts):
                row = int(new_cpu[layer, expert])
                tier, r = ("hot", row) if row >= 0 else ("cold", -row - 1)
                for name, t in zip(names, saved[layer][expert]):
                    getattr(self, f"{name}_{tier}")[r].copy_(t)
        self.row_map.copy_(new_cpu.to(self.row_map.device))
        self.validated_version = self.row_map._version


def host_memory_available() -> tuple[int, int | None]:
    """(MemAvailable bytes from /proc/meminfo, RLIMIT_MEMLOCK soft limit or None if unlimited)."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if available is None:  # not Linux: fall back to physical pages
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    memlock = None if soft == resource.RLIM_INFINITY else int(soft)
    return int(available), memlock


def check_host_allocation(nbytes: int, what: str, available: int | None = None) -> None:
    """Fail early, naming both sizes, if ``nbytes`` of host memory exceeds what the host can give.

    Compared with /proc/meminfo MemAvailable. RLIMIT_MEMLOCK is reported but not enforced:
    cudaHostAlloc pins through the NVIDIA driver, which that limit does not bound, so enforcing it
    would refuse allocations that succeed (many systems set it to 8 MiB).
    """
    avail, memlock = host_memory_available()
    if available is not None:
        avail = available
    if nbytes > avail:
        lock = "unlimited" if memlock is None else f"{memlock / 2**30:.2f} GiB"
        raise PoolAllocationError(
            f"{what}: needs {nbytes / 2**30:.2f} GiB ({nbytes} bytes) of host memory but only "
            f"{avail / 2**30:.2f} GiB ({avail} bytes) is available (MemAvailable; RLIMIT_MEMLOCK {lock}); "
            f"raise the residency (more experts in HBM) or free host memory"
        )


@dataclass(frozen=True)
class HostTier:
    """Every routed expert of one model once in host memory, in the all-hot order (row ``layer * E
    + expert``): the cold tier that every placement of that model shares (:meth:`ExpertPools.placed`).

    ``w13`` ``[L * E, 2I, H]`` and ``w2`` ``[L * E, H, I]`` are views of one allocation, pinned
    when the model's experts are on CUDA (kernels read it in place), plain memory otherwise.
    """

    w13: torch.Tensor
    w2: torch.Tensor
    num_moe_layers: int
    num_experts: int
    pinned: bool
    reserved_bytes: int  # what the host allocation takes (pinned blocks round up to a power of two)
    # FP8 experts: their weight_scale_inv blocks, row l * E + e, in the same host allocation
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w13, self.w2, self.w13_scale, self.w2_scale)
                   if t is not None)

    def check_matches(self, pools: "ExpertPools") -> None:
        """Refuse a tier made from another model's experts (shape or dtype differ)."""
        want = ((pools.num_moe_layers * pools.num_experts, *pools.w13_hot.shape[1:]),
                (pools.num_moe_layers * pools.num_experts, *pools.w2_hot.shape[1:]), pools.w13_hot.dtype)
        got = (tuple(self.w13.shape), tuple(self.w2.shape), self.w13.dtype)
        scales_differ = (self.w13_scale is not None) != pools.has_scales or (pools.has_scales and (
            self.w13_scale.shape[1:] != pools.w13_scale_hot.shape[1:] or self.w2_scale.shape[1:] != pools.w2_scale_hot.shape[1:]))
        if (self.num_moe_layers, self.num_experts) != (pools.num_moe_layers, pools.num_experts) or got != want \
                or scales_differ:
            raise ValueError(f"host tier w13 {got[0]}, w2 {got[1]} ({got[2]}) does not hold these pools' "
                             f"experts: w13 {want[0]}, w2 {want[1]} ({want[2]})")


def _pinned_block_bytes(nbytes: int) -> int:
    """Bytes torch's caching host allocator reserves for a pinned request of ``nbytes`` (it rounds
    each block up to a power of two unless configured otherwise): 58 GB takes 64 GiB."""
    return 1 << max(0, nbytes - 1).bit_length()


def host_tier(pools: ExpertPools, host_available_bytes: int | None = None) -> HostTier:
    """Copy every expert of the all-hot ``pools`` into one host allocation (see :class:`HostTier`).

    Pinned when the pools are on CUDA, plain memory on the CPU. The host allocation is checked
    (:func:`check_host_allocation`, against the bytes the pinned allocator really reserves) before
    anything is allocated; ``host_available_bytes`` overrides MemAvailable (for tests). One
    allocation rather than one per weight: pinned blocks round up to a power of two each.
    """
    pools._require_all_hot("host_tier")
    pin = pools.w13_hot.device.type == "cuda"
    dtype = pools.w13_hot.dtype
    if pools.w2_hot.dtype != dtype:
        raise ValueError(f"host_tier: w13 dtype {dtype} differs from w2 dtype {pools.w2_hot.dtype}")
    sources = [pools.w13_hot, pools.w2_hot]
    if pools.has_scales:  # the scales in the same allocation, after the weights (16-byte aligned)
        sources += [pools.w13_scale_hot, pools.w2_scale_hot]
    offsets, nbytes = [], 0
    for t in sources:
        nbytes = -(-nbytes // 16) * 16
        offsets.append(nbytes)
        nbytes += t.numel() * t.element_size()
    reserved = _pinned_block_bytes(nbytes) if pin else nbytes
    check_host_allocation(reserved, "pinned host tier (every routed expert)" if pin else "host tier (every routed expert)",
                          host_available_bytes)
    flat = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    views = []
    for t, off in zip(sources, offsets):
        v = flat[off:off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        v.copy_(t)
        views.append(v)
    return HostTier(w13=views[0], w2=views[1], num_moe_layers=pools.num_moe_layers, num_experts=pools.num_experts,
                    pinned=pin, reserved_bytes=reserved,
                    w13_scale=views[2] if pools.has_scales else None, w2_scale=views[3] if pools.has_scales else None)


def _host_empty(shape, dtype, pin: bool) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, pin_memory=pin)


def _check_mxfp4_scale_values(w13_scale, w2_scale) -> None:
    """Refuse an e8m0 scale of 255 (NaN in the OCP MX spec, which the kernel and transformers would
    read differently), naming the tensor: one look at the scales when pools are built."""
    for name, sc in (("w13_scale", w13_scale), ("w2_scale", w2_scale)):
        if isinstance(sc, torch.Tensor) and sc.dtype == torch.uint8 and bool((sc == 255).any()):
            raise mxfp4.Mxfp4FormatError(f"ExpertPools {name}: e8m0 scale 255 (NaN in the OCP MX spec) is not read")


def _scale_pools(w13_scale, w2_scale, rows: int, weight_dtype: torch.dtype | None = None) -> dict:
    """all_hot's scale pools from ``[L, E, ...]`` scales (both or neither); empty cold scale pools."""
    if (w13_scale is None) != (w2_scale is None):
        raise ValueError("ExpertPools: scaled (FP8, MXFP4) experts need both w13_scale and w2_scale")
    if w13_scale is None:
        return {}
    if weight_dtype == torch.uint8:
        _check_mxfp4_scale_values(w13_scale, w2_scale)
    w13_scale, w2_scale = w13_scale.contiguous(), w2_scale.contiguous()
    hot13, hot2 = w13_scale.reshape(rows, *w13_scale.shape[2:]), w2_scale.reshape(rows, *w2_scale.shape[2:])
    return dict(w13_scale_hot=hot13, w2_scale_hot=hot2, w13_scale_cold=hot13.new_empty((0, *hot13.shape[1:])),
                w2_scale_cold=hot2.new_empty((0, *hot2.shape[1:])))


def _bias_fields(w13_bias, w2_bias, activation, device=None) -> dict:
    """The pools' bias and activation fields: the biases contiguous (on ``device`` when given);
    their checks are :meth:`ExpertPools._check_biases`'s."""
    def put(b):
        if b is None or not isinstance(b, torch.Tensor):
            return b
        return (b if device is None else b.to(device)).contiguous()

    return dict(w13_bias=put(w13_bias), w2_bias=put(w2_bias), activation=activation)


def build_pools(
    w13: torch.Tensor,
    w2: torch.Tensor,
    row_map,
    device,
    num_hot: int | None = None,
    num_cold: int | None = None,
    host_available_bytes: int | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    *,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: Activation = SILU,
) -> ExpertPools:
    """Place each expert of ``w13`` ``[L, E, 2I, H]`` / ``w2`` ``[L, E, H, I]`` where ``row_map`` says.

    Hot rows go to one device allocation per weight; cold rows to pinned host memory on CUDA
    (read in place by the kernel), a plain CPU tensor on CPU. Pool sizes default to the number of
    hot / cold entries in the map; larger ``num_hot`` / ``num_cold`` leave spare rows for later
    placements. The map is validated and the host allocation checked before anything is allocated.
    ``host_available_bytes`` overrides MemAvailable (for tests). Block-FP8 experts pass their
    scales ``w13_scale`` / ``w2_scale`` ``[L, E, ...]`` (see :meth:`ExpertPools.all_hot`); each
    expert's scales go to the same tier and row as its weights. Expert biases ``w13_bias`` ``[L, E,
    2I]`` / ``w2_bias`` ``[L, E, H]`` are copied to ``device`` whole, whatever the map (module doc).
    """
    device = torch.device(device)
    if w13.dim() != 4 or w2.dim() != 4 or w13.shape[:2] != w2.shape[:2]:
        raise ValueError(
            f"build_pools needs w13 [L, E, 2I, H] and w2 [L, E, H, I], got {tuple(w13.shape)} and {tuple(w2.shape)}"
        )
    if w13.dtype != w2.dtype:
        raise ValueError(f"build_pools: w13 dtype {w13.dtype} differs from w2 dtype {w2.dtype}")
    num_layers, num_experts = w13.shape[:2]
    rm = torch.as_tensor(np.asarray(row_map)) if not isinstance(row_map, torch.Tensor) else row_map.detach().cpu()
    if rm.dtype != torch.int32:
        raise ValueError(f"row_map: dtype must be int32, got {rm.dtype}")
    if tuple(rm.shape) != (num_layers, num_experts):
        raise ValueError(f"row_map: shape {tuple(rm.shape)} does not match the weights' [L, E] = {(num_layers, num_experts)}")
    n_hot = int((rm >= 0).sum()) if num_hot is None else int(num_hot)
    n_cold = int((rm < 0).sum()) if num_cold is None else int(num_cold)
    _check_row_map(rm, n_hot, n_cold, num_layers, num_experts)

    if (w13_scale is None) != (w2_scale is None):
        raise ValueError("build_pools: scaled (FP8, MXFP4) experts need both w13_scale and w2_scale")
    scaled = w13_scale is not None
    if scaled and w13.dtype == torch.uint8:
        _check_mxfp4_scale_values(w13_scale, w2_scale)
    per_expert = (w13[0, 0].numel() + w2[0, 0].numel()) * w13.element_size()
    if scaled:
        per_expert += (w13_scale[0, 0].numel() + w2_scale[0, 0].numel()) * w13_scale.element_size()
    host_rows = n_cold + (n_hot if device.type == "cpu" else 0)
    pin = device.type == "cuda"
    check_host_allocation(
        host_rows * per_expert, "pinned cold pool" if pin else "host expert pools", host_available_bytes
    )

    w13_hot = torch.empty((n_hot, *w13.shape[2:]), dtype=w13.dtype, device=device)
    w2_hot = torch.empty((n_hot, *w2.shape[2:]), dtype=w2.dtype, device=device)
    w13_cold = _host_empty((n_cold, *w13.shape[2:]), w13.dtype, pin)
    w2_cold = _host_empty((n_cold, *w2.shape[2:]), w2.dtype, pin)
    pools_by_name = {"w13_hot": w13_hot, "w2_hot": w2_hot, "w13_cold": w13_cold, "w2_cold": w2_cold}
    sources = {"w13": w13, "w2": w2}
    if scaled:
        for name, sc in (("w13_scale", w13_scale), ("w2_scale", w2_scale)):
            pools_by_name[f"{name}_hot"] = torch.empty((n_hot, *sc.shape[2:]), dtype=sc.dtype, device=device)
            pools_by_name[f"{name}_cold"] = _host_empty((n_cold, *sc.shape[2:]), sc.dtype, pin)
            sources[name] = sc
    flat = rm.reshape(-1).tolist()
    for i, row in enumerate(flat):
        layer, expert = divmod(i, num_experts)
        tier, r = ("hot", row) if row >= 0 else ("cold", -row - 1)
        for name, src in sources.items():
            pools_by_name[f"{name}_{tier}"][r].copy_(src[layer, expert])
    pools = ExpertPools(row_map=rm.to(device=device, dtype=torch.int32).contiguous(), **pools_by_name,
                        **_bias_fields(w13_bias, w2_bias, activation, device))
    pools.validated_version = pools.row_map._version
    return pools
