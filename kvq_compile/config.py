"""KVQConfig: what each layer's Key and Value quantizer does, validated, with the papers' presets.

A config is model independent; `KVQConfig.resolve(num_layers)` turns it into one `LayerSpec` per
attention layer (per-layer bit widths and XQuant's code sharing depend on the layer count).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

SUPPORTED_BITS = (1, 2, 3, 4, 8, 16)  # 16 means "not quantized": kept in the cache dtype


class Axis(str, Enum):
    """Which statistics a quantization group shares.

    CHANNEL: per-channel statistics over tokens (a group is `group_size` tokens of one channel).
    TOKEN:   per-token statistics over channels (a group is `group_size` channels of one token).
    """

    CHANNEL = "channel"
    TOKEN = "token"


class Grouping(str, Enum):
    """Where a group lies relative to the attention matmul that reads it (InnerQ's terms).

    INNER: the group runs along the matmul's reduction dimension (Keys grouped over channels,
           Values grouped over tokens), so one scale multiplies a whole partial dot product.
    OUTER: the group runs along the output dimension (KIVI: per-channel Keys, per-token Values).
    """

    INNER = "inner"
    OUTER = "outer"


class Symmetry(str, Enum):
    """SYMMETRIC: zero-point 0, range [-absmax, absmax], one bit spent on the sign: 2^B - 1 levels with zero
    among them (InnerQ, int8's -127..127; `reference.level_count`). ASYMMETRIC: range [min, max], 2^B levels.
    HYBRID (InnerQ): each group picks the lower-L1-error of symmetric `bits`-bit levels and
    asymmetric `bits-1`-bit levels; the choice is stored as a per-group mask."""

    SYMMETRIC = "symmetric"
    ASYMMETRIC = "asymmetric"
    HYBRID = "hybrid"


class Levels(str, Enum):
    """UNIFORM: 2^bits evenly spaced levels on [-1, 1]. NORMAL_FLOAT: NormalFloat-style quantiles of a
    normal distribution on [-1, 1] (KVQuant's uncalibrated non-uniform default). A calibrated codebook
    replaces the NORMAL_FLOAT levels per layer through `KVQConfig.codebooks`."""

    UNIFORM = "uniform"
    NORMAL_FLOAT = "normal_float"


def _fix(msg: str) -> ValueError:
    return ValueError(msg)


def _is_int(x) -> bool:
    """An int and not a bool (JSON edited by hand gives 4.0; True would pass as 1)."""
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class QuantizerSpec:
    """One tensor's (Key's or Value's) quantizer.

    bits: 1, 2, 3, 4, 8, or 16 (16 = stored unquantized in the cache dtype).
    axis: see `Axis`.
    group_size: elements per group along the group's direction. None means the whole direction:
        for TOKEN, all `head_dim` channels of a token; for CHANNEL, one static range per channel fixed
        from the first appended chunk (the prefill; a chunked prefill's later chunks widen it while no token
        has left the recent window: `store.append_side`), as KVQuant's offline per-channel Key scaling does
        when no calibration is loaded.
    symmetry: see `Symmetry`.
    levels: see `Levels`.
    outlier_fraction: dense-and-sparse outliers (KVQuant): this fraction of each token vector's
        entries (at least one when > 0) is kept exactly in the cache dtype with its channel index.
    range_scale: static per-channel ranges only: their half-width is multiplied by this, so that the
        levels sit inside the prefill's min/max (the CalibQuant reference code uses 0.5 for Keys and 0.3 for
        Values; values beyond the shrunk range clamp to the outer levels).
    """

    bits: int = 16
    axis: Axis = Axis.TOKEN
    group_size: int | None = 32
    symmetry: Symmetry = Symmetry.ASYMMETRIC
    levels: Levels = Levels.UNIFORM
    outlier_fraction: float = 0.0
    range_scale: float = 1.0

    def __post_init__(self):
        object.__setattr__(self, "axis", Axis(self.axis))
        object.__setattr__(self, "symmetry", Symmetry(self.symmetry))
        object.__setattr__(self, "levels", Levels(self.levels))
        if not _is_int(self.bits) or self.bits not in SUPPORTED_BITS:
            raise _fix(f"bits={self.bits!r} is not supported: use one of {SUPPORTED_BITS} (an int; 16 = unquantized)")
        if self.group_size is not None and not _is_int(self.group_size):
            raise _fix(f"group_size={self.group_size!r} must be an int, or None for the whole axis")
        if self.group_size is not None and self.group_size <= 0:
            raise _fix(f"group_size={self.group_size} must be a positive integer, or None for the whole axis")
        if not 0.0 <= self.outlier_fraction < 0.5:
            raise _fix(f"outlier_fraction={self.outlier_fraction} must lie in [0, 0.5); use 0.01 for KVQuant's 1%")
        if not 0.0 < self.range_scale <= 1.0:
            raise _fix(f"range_scale={self.range_scale} must lie in (0, 1]; use 1 to keep the observed range")
        if self.range_scale != 1.0 and not (self.axis is Axis.CHANNEL and self.group_size is None):
            raise _fix("range_scale applies to static per-channel ranges only: set axis=channel and "
                       "group_size=None, or range_scale=1")
        if self.symmetry is Symmetry.HYBRID and self.bits < 2:
            raise _fix("symmetry=hybrid needs bits >= 2 (its asymmetric branch uses bits-1); use symmetric at 1 bit")
        if self.levels is Levels.NORMAL_FLOAT and self.symmetry is Symmetry.HYBRID:
            raise _fix("levels=normal_float cannot be combined with symmetry=hybrid; use uniform levels")
        if self.symmetry is Symmetry.HYBRID and self.axis is Axis.CHANNEL and self.group_size is None:
            # a static range is fixed once per channel, so there is no per-group choice to make (the codes were
            # written with 2^B asymmetric levels and read back as (B-1)-bit ones)
            raise _fix("symmetry=hybrid needs groups: set a group_size, or use asymmetric/symmetric static ranges")

    @property
    def quantized(self) -> bool:
        return self.bits < 16

    @property
    def tokens_per_group(self) -> int:
        """How many consecutive tokens must exist before a group can be quantized."""
        if self.axis is Axis.CHANNEL and self.group_size is not None:
            return self.group_size
        return 1

    def grouping(self, tensor: str) -> Grouping:
        """INNER or OUTER for `tensor` in {"key", "value"}: Keys reduce over channels, Values over tokens."""
        reduces_over = Axis.TOKEN if tensor == "key" else Axis.CHANNEL
        # A TOKEN-axis group runs over channels; it is inner when the matmul reduces over channels.
        along = Axis.TOKEN if self.axis is Axis.TOKEN else Axis.CHANNEL
        return Grouping.INNER if along is reduces_over else Grouping.OUTER

    def check_head_dim(self, head_dim: int) -> None:
        if self.quantized and self.axis is Axis.TOKEN and self.group_size is not None and head_dim % self.group_size:
            raise _fix(f"group_size={self.group_size} must divide head_dim={head_dim} for per-token groups; "
                       f"use a divisor of {head_dim} or group_size=None")


@dataclass(frozen=True)
class LayerSpec:
    """The resolved quantizers of one attention layer.

    share_key_codes_from / share_value_codes_from: XQuant cross-layer sharing. This layer stores no
    codes for that tensor; it dequantizes the named earlier layer's codes with its own scale and zero.
    """

    key: QuantizerSpec
    value: QuantizerSpec
    share_key_codes_from: int | None = None
    share_value_codes_from: int | None = None


@dataclass
class KVQConfig:
    """A KV-cache quantization scheme for every attention layer of a model.

    key, value: the default quantizers. layer_bits: per-layer bit overrides {layer: (k_bits, v_bits)}.
    sink, recent: fp16 windows (in the cache dtype): the first `sink` tokens and the last `recent`
        tokens stay exact; a token is quantized when it leaves the recent window and its group is full.
    keys_before_rope: store Keys before rotary embedding and re-apply RoPE after dequantization (KVQuant).
    key_norm: InnerQ per-channel Key normalization: Keys are divided by sqrt(per-channel absmax) of the
        first appended chunk (widened as the static ranges are) before quantization; the factor is folded back
        into the query.
    softmax_tau: CalibQuant (tau1, tau2): the attention logits of each query row, range [gamma, delta],
        are mapped linearly onto [gamma + tau1, delta - tau2] before softmax. Softmax is shift invariant,
        so this is a per-row temperature t = 1 - (tau1 + tau2) / (delta - gamma). Both taus are finite and >= 0.
        A row whose range is narrower than tau1 + tau2 gets t < 0: the map, as the paper defines it, inverts that
        row's order (seen on near-uniform rows of SmolLM2 with the preset's (0, 3); the kernels do the same).
    eta: XQuant data-free calibration per bit width {bits: eta}: the range of each asymmetric uniform
        group shrinks by eta of its width on both sides (z' = z + eta*s*(2^B-1), s' = (1-2*eta)*s).
    share_key_codes_from_layer / share_value_codes_from_layer: XQuant sharing starts at this layer
        index: every odd layer >= it reuses the preceding even layer's codes (None = no sharing).
    codebooks: calibrated non-uniform levels {"<layer>.key" | "<layer>.value": [2^bits floats in [-1, 1]]}.
    """

    name: str = "custom"
    key: QuantizerSpec = field(default_factory=QuantizerSpec)
    value: QuantizerSpec = field(default_factory=QuantizerSpec)
    sink: int = 0
    recent: int = 0
    keys_before_rope: bool = False
    key_norm: bool = False
    softmax_tau: tuple[float, float] | None = None
    eta: dict[int, float] = field(default_factory=dict)
    layer_bits: dict[int, tuple[int, int]] = field(default_factory=dict)
    share_key_codes_from_layer: int | None = None
    share_value_codes_from_layer: int | None = None
    codebooks: dict[str, list[float]] = field(default_factory=dict)
    # Layer-count-relative rule used by the XQuant preset: (kq, vq, km, vm, reference_layers).
    xquant_pattern: tuple[int, int, int, int, int] | None = None

    def __post_init__(self):
        if isinstance(self.key, dict):
            self.key = QuantizerSpec(**self.key)
        if isinstance(self.value, dict):
            self.value = QuantizerSpec(**self.value)
        self.eta = {int(b): float(e) for b, e in self.eta.items()}
        for i, b in self.layer_bits.items():
            if not isinstance(b, (tuple, list)) or len(b) != 2:
                raise _fix(f"layer_bits[{i}]={b!r} must be a pair (key bits, value bits), e.g. (4, 2)")
        self.layer_bits = {int(i): tuple(b) for i, b in self.layer_bits.items()}
        if self.softmax_tau is not None:
            self.softmax_tau = tuple(float(t) for t in self.softmax_tau)
        if self.xquant_pattern is not None:
            self.xquant_pattern = tuple(int(x) for x in self.xquant_pattern)
        self.validate()
        # at construction only: the store serves any window (the tests set others on built configs), whole groups
        # are KIVI's residual as the papers configure it
        for q in (self.key, self.value):
            if q.quantized and q.tokens_per_group > 1 and self.recent % q.tokens_per_group:
                raise _fix(f"recent={self.recent} must be a multiple of the token group_size={q.group_size} "
                           f"(KIVI: the residual must hold whole groups); use recent="
                           f"{(self.recent // q.tokens_per_group + 1) * q.tokens_per_group}")

    def validate(self) -> None:
        """The checks of construction, again (`check_model` calls it: a field set after construction, as
        `dataclasses.replace` does not, is checked there). Raises ValueError naming the fix."""
        if not isinstance(self.key, QuantizerSpec) or not isinstance(self.value, QuantizerSpec):
            raise _fix("key and value must be QuantizerSpec (or dicts of its fields at construction)")
        if not _is_int(self.sink) or not _is_int(self.recent) or self.sink < 0 or self.recent < 0:
            raise _fix(f"sink={self.sink!r} and recent={self.recent!r} must be ints >= 0")
        if self.softmax_tau is not None:
            tau = tuple(self.softmax_tau)
            if len(tau) != 2 or not all(isinstance(t, (int, float)) and 0.0 <= t < float("inf") for t in tau):
                raise _fix(f"softmax_tau={self.softmax_tau!r} must be a pair of finite numbers >= 0 (tau1, tau2), "
                           "e.g. (0, 3)")
        if self.xquant_pattern is not None:
            if len(self.xquant_pattern) != 5 or self.xquant_pattern[4] <= 0:
                raise _fix(f"xquant_pattern={self.xquant_pattern!r} must be (kq, vq, km, vm, reference_layers) "
                           "with reference_layers > 0")
            if self.share_key_codes_from_layer is not None or self.share_value_codes_from_layer is not None:
                raise _fix("xquant_pattern sets the code sharing itself; leave share_key_codes_from_layer and "
                           "share_value_codes_from_layer None, or set xquant_pattern=None and the layers by hand")
        for f in ("share_key_codes_from_layer", "share_value_codes_from_layer"):
            v = getattr(self, f)
            if v is not None and (not _is_int(v) or v < 0):
                raise _fix(f"{f}={v!r} must be a layer index >= 0, or None for no sharing")
        if self.key_norm and not self.key.quantized:
            raise _fix("key_norm (InnerQ) normalizes quantized Keys: set key bits < 16 or key_norm=False")
        if any(self.eta.values()) and not any(
                q.symmetry is Symmetry.ASYMMETRIC and q.levels is Levels.UNIFORM for q in (self.key, self.value)):
            raise _fix(f"eta={self.eta} shrinks asymmetric uniform groups only, and this config's Keys and Values "
                       "are neither: drop eta")
        for name, table in self.codebooks.items():
            layer, _, tensor = name.partition(".")
            if not layer.isdigit() or tensor not in ("key", "value"):
                raise _fix(f"codebook name {name!r} must be '<layer>.key' or '<layer>.value', e.g. '0.key'")
            vals = list(table)
            if not all(isinstance(x, (int, float)) and -1.0 <= x <= 1.0 for x in vals) or \
                    any(a >= b for a, b in zip(vals, vals[1:])):
                raise _fix(f"codebook {name} must hold increasing finite levels in [-1, 1] (nearest-level coding "
                           "assumes them sorted)")
        for bits, eta in self.eta.items():
            if bits not in SUPPORTED_BITS:
                raise _fix(f"eta is given for bits={bits}; use one of {SUPPORTED_BITS}")
            if not 0.0 <= eta < 0.5:
                raise _fix(f"eta={eta} for {bits}-bit groups is outside [0, 0.5): XQuant's eta shrinks the range "
                           f"by eta on each side, so use 0 <= eta < 0.5 (the paper's grid: 1-bit 1/6, 2-bit 0.045)")
        for i, (kb, vb) in self.layer_bits.items():
            for b in (kb, vb):
                if b not in SUPPORTED_BITS:
                    raise _fix(f"layer_bits[{i}] has bits={b}; use one of {SUPPORTED_BITS}")
        if self.keys_before_rope and not self.key.quantized:
            raise _fix("keys_before_rope only matters for quantized keys; set key bits < 16 or keys_before_rope=False")
        if self.key_norm and self.keys_before_rope:
            raise _fix("key_norm (InnerQ) and keys_before_rope (KVQuant) cannot be combined; pick one")

    def eta_for(self, q: QuantizerSpec) -> float:
        """XQuant's eta for this quantizer: it applies to asymmetric uniform groups only."""
        if q.symmetry is Symmetry.ASYMMETRIC and q.levels is Levels.UNIFORM:
            return self.eta.get(q.bits, 0.0)
        return 0.0

    # ---- per-layer resolution --------------------------------------------------------------
    def resolve(self, num_layers: int) -> list[LayerSpec]:
        """One LayerSpec per attention layer, in graph order."""
        if num_layers <= 0:
            raise _fix(f"num_layers={num_layers} must be positive")
        bad = [i for i in self.layer_bits if not 0 <= i < num_layers]
        if bad:
            raise _fix(f"layer_bits names layers {bad} but the model has {num_layers} attention layers")
        k_share, v_share = self.share_key_codes_from_layer, self.share_value_codes_from_layer
        bits = {}
        if self.xquant_pattern is not None:
            kq, vq, km, vm, ref = self.xquant_pattern
            scale = lambda x: int(round(x * num_layers / ref))  # noqa: E731
            kq, vq, km, vm = scale(kq), scale(vq), scale(km), scale(vm)
            bits = {i: (1 if i >= kq else 2, 1 if i >= vq else 2) for i in range(num_layers)}
            k_share, v_share = km, vm
        bits.update(self.layer_bits)
        specs = []
        for i in range(num_layers):
            kb, vb = bits.get(i, (self.key.bits, self.value.bits))
            key = dataclasses.replace(self.key, bits=kb) if kb != self.key.bits else self.key
            value = dataclasses.replace(self.value, bits=vb) if vb != self.value.bits else self.value
            share_k = self._share_source(i, k_share, key, specs, "key")
            share_v = self._share_source(i, v_share, value, specs, "value")
            specs.append(LayerSpec(key, value, share_k, share_v))
        return specs

    @staticmethod
    def _share_source(i, start, spec, earlier, tensor):
        if start is None or i < max(start, 1) or i % 2 == 0 or not spec.quantized:
            return None
        src = getattr(earlier[i - 1], tensor)
        if src != spec:  # different bits or scheme: codes are not interchangeable
            return None
        if spec.outlier_fraction > 0 or spec.symmetry is Symmetry.HYBRID:
            raise _fix("cross-layer code sharing needs plain uniform/codebook groups: use outlier_fraction=0 "
                       "and a non-hybrid symmetry")
        return i - 1

    def check_model(self, num_layers: int, head_dim: int, max_len: int) -> list[LayerSpec]:
        """Validate against a model's geometry and resolve; raises ValueError naming the fix."""
        self.validate()
        if self.sink + self.recent > max_len:
            raise _fix(f"sink={self.sink} + recent={self.recent} exceeds the cache length {max_len}; "
                       f"shorten the windows or allocate a longer cache")
        specs = self.resolve(num_layers)
        for s in specs:
            s.key.check_head_dim(head_dim)
            s.value.check_head_dim(head_dim)
        for name, table in self.codebooks.items():
            layer, tensor = name.split(".")
            if int(layer) >= num_layers:
                raise _fix(f"codebook {name} names layer {layer}, but the model has {num_layers} attention layers: "
                           "a calibration of another model? calibrate this one")
            q = getattr(specs[int(layer)], tensor)
            if not q.quantized or q.levels is not Levels.NORMAL_FLOAT:
                raise _fix(f"codebook {name} is for non-uniform levels, but layer {layer}'s {tensor} quantizer is "
                           f"{'unquantized' if not q.quantized else q.levels.value}: set levels=normal_float there "
                           "or drop the codebook")
            if len(table) != 2 ** q.bits:
                raise _fix(f"codebook {name} has {len(table)} levels; a {q.bits}-bit quantizer needs {2 ** q.bits}")
        if self.codebooks:   # a calibration covers every layer with non-uniform levels, or it is another model's
            named = {int(name.split(".")[0]) for name in self.codebooks}
            missing = [i for i, sp in enumerate(specs) if i not in named and any(
                q.quantized and q.levels is Levels.NORMAL_FLOAT for q in (sp.key, sp.value))]
            if missing:
                raise _fix(f"codebooks name layers {sorted(named)}, but not layers {missing[:6]}"
                           f"{' ...' if len(missing) > 6 else ''} of this {num_layers}-layer model, which have "
                           "non-uniform levels too: a calibration of another model? calibrate this one (or drop the "
                           "codebooks for NormalFloat levels)")
        return specs

    def equivalent_bits(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int,
                        batch: int = 1, dtype_bytes: int = 2) -> float:
        """True bits per cached K/V element: every byte the store allocates (codes, scales, zero-points, outliers,
        fp16 windows, RoPE tables, codebooks; a hybrid group's choice is the sign of its scale, no bytes of its own)
        over 2*layers*batch*heads*len*dim. An odd length's padding row (`Geometry.rows`) is allocated, so it counts:
        fp16 then gives 16 (len + 1) / len."""
        from .store import model_store_bytes

        nbytes = model_store_bytes(self, num_layers, batch, num_kv_heads, max_len, head_dim, dtype_bytes)
        return nbytes * 8 / (2 * num_layers * batch * num_kv_heads * max_len * head_dim)

    # ---- serialization ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k in ("key", "value"):
            d[k] = {f: (v.value if isinstance(v, Enum) else v) for f, v in d[k].items()}
        d["eta"] = {str(b): e for b, e in self.eta.items()}
        d["layer_bits"] = {str(i): list(b) for i, b in self.layer_bits.items()}
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "KVQConfig":
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise _fix(f"unknown KVQConfig fields {sorted(unknown)}")
        return cls(**d)

    @classmethod
    def from_json(cls, s: str) -> "KVQConfig":
        return cls.from_dict(json.loads(s))

    @classmethod
    def preset(cls, name: str) -> "KVQConfig":
        """A named preset; see `kvq_compile.presets` for what each one follows."""
        from .presets import PRESETS

        if name not in PRESETS:
            raise _fix(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
        cfg = PRESETS[name]()
        cfg.name = name
        return cfg
