"""Model FLOPs and device peak FLOP/s: what MFU is computed from (docs/goodput.md).

MFU (model FLOPs utilisation) = model FLOPs per second / the device's peak
FLOP/s. The rank counts ``rankscope_model_flops_total`` (the FLOPs of its
completed steps: tokens x FLOPs per token, or samples x FLOPs per sample) and
exports ``rankscope_device_peak_flops``; Prometheus divides the rate of one by
the other (``rank:rankscope_mfu:ratio``).

This module is pure: no torch import, nothing read from a device. It holds

- ``PEAK_FLOPS``: dense tensor-core peaks per GPU model and dtype, from the
  vendor datasheets, and ``lookup_peak_flops``, which finds a GPU by the name
  NVML / ``torch.cuda.get_device_name`` reports, tolerant of its spelling;
- ``flops_per_token``: the 6·N rule, with PaLM's attention term;
- ``FlopsConfig``: what the user says about the model (``RANKSCOPE_FLOPS_*``,
  ``RANKSCOPE_MODEL_PARAMS``, ...), validated at construction.
"""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Mapping

from rankscope.contract import environment
from rankscope.contract.environment import ConfigError, setting

if TYPE_CHECKING:
    import torch

__all__ = [
    "DTYPES", "PEAK_FLOPS", "FlopsConfig", "flops_per_token", "lookup_peak_flops", "canonical_gpu", "mfu",
    "peak_table_markdown",
]

DTYPES: tuple[str, ...] = ("bf16", "fp16", "fp32", "tf32", "fp8")
"""The dtypes a peak is known for. ``fp32`` is the plain (CUDA-core) FP32 peak,
``tf32`` the tensor-core peak that FP32 matmuls reach with TF32 allowed
(``torch.set_float32_matmul_precision("high")``)."""

# Other spellings of the dtypes (torch's names included: str(torch.bfloat16) is
# "torch.bfloat16"; the prefix is dropped first).
_DTYPE_ALIASES: dict[str, str] = {
    "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32",
    "tfloat32": "tf32", "float8": "fp8", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8", "e4m3": "fp8",
}

# Peak FLOP/s per GPU model and dtype: the DENSE tensor-core figures (fp32: the
# CUDA-core figure). Datasheets print tensor-core peaks "with sparsity" (2:4
# structured sparsity, marked with an asterisk) beside or instead of the dense
# ones; a sparse figure is exactly twice the dense one and is never used here:
# dense training reaches at most the dense peak. A dtype a GPU has no tensor
# cores for (fp8 before Hopper/Ada, bf16/tf32 on Volta) is absent: no MFU.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    # NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column): FP32 67 TF, TF32 989 TF*,
    # BF16/FP16 1,979 TF*, FP8 3,958 TF* (* with sparsity; dense = half: 494.7 / 989.4 / 1,978.9).
    "H100 SXM": {"fp32": 66.9e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12, "fp8": 1978.9e12},
    # Same datasheet, H100 PCIe column: FP32 51 TF, TF32 756 TF*, BF16/FP16 1,513 TF*, FP8 3,026 TF*.
    "H100 PCIe": {"fp32": 51.2e12, "tf32": 378e12, "bf16": 756.5e12, "fp16": 756.5e12, "fp8": 1513e12},
    # Same datasheet, H100 NVL column (per GPU, the final specification; the preliminary one
    # listed a pair of cards): FP32 60 TF, TF32 835 TF*, BF16/FP16 1,671 TF*, FP8 3,341 TF*.
    "H100 NVL": {"fp32": 60e12, "tf32": 417.5e12, "bf16": 835.5e12, "fp16": 835.5e12, "fp8": 1670.5e12},
    # NVIDIA H200 Tensor Core GPU datasheet (H200 SXM column): FP32 67 TF, TF32 989 TF*,
    # BF16/FP16 1,979 TF*, FP8 3,958 TF*: the H100 SXM's GH100 compute (dense as above).
    "H200 SXM": {"fp32": 66.9e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12, "fp8": 1978.9e12},
    # Same datasheet, H200 NVL column: FP32 60 TF, TF32 835 TF*, BF16/FP16 1,671 TF*, FP8 3,341 TF*.
    "H200 NVL": {"fp32": 60e12, "tf32": 417.5e12, "bf16": 835.5e12, "fp16": 835.5e12, "fp8": 1670.5e12},
    # The Hopper parts that differ from the H100 in what they export, not in compute:
    # H800 (SXM / PCIe: the H100's interconnect cut, its tensor cores not) and the GH200
    # superchip's GPU (GH200 datasheet: FP8 3,958 TF*, BF16/FP16 1,979 TF*, TF32 989 TF*: the
    # H100 SXM's figures).
    "H800 SXM": {"fp32": 66.9e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12, "fp8": 1978.9e12},
    "H800 PCIe": {"fp32": 51.2e12, "tf32": 378e12, "bf16": 756.5e12, "fp16": 756.5e12, "fp8": 1513e12},
    "GH200": {"fp32": 66.9e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12, "fp8": 1978.9e12},
    # H20 (a Hopper part with 78 SMs for the Chinese market): FP32 44 TF, TF32 74 TF, BF16/FP16
    # 148 TF, FP8 296 TF, dense (NVIDIA publishes no English datasheet; these are the figures
    # its partners quote).
    "H20": {"fp32": 44e12, "tf32": 74e12, "bf16": 148e12, "fp16": 148e12, "fp8": 296e12},
    # NVIDIA HGX B200 specifications (8 GPUs; per GPU = 1/8): FP32 600 TF, TF32 18 PF*,
    # FP16/BF16 36 PF*, FP8 72 PF* -> per GPU dense: TF32 1.125 PF, BF16 2.25 PF, FP8 4.5 PF.
    "B200": {"fp32": 75e12, "tf32": 1.125e15, "bf16": 2.25e15, "fp16": 2.25e15, "fp8": 4.5e15},
    # NVIDIA GB200 NVL72 specifications (72 GPUs; per GPU = 1/72): FP32 5,760 TF, TF32 180 PF*,
    # FP16/BF16 360 PF*, FP8 720 PF* -> per GPU dense: TF32 1.25 PF, BF16 2.5 PF, FP8 5 PF.
    "GB200": {"fp32": 80e12, "tf32": 1.25e15, "bf16": 2.5e15, "fp16": 2.5e15, "fp8": 5e15},
    # Blackwell Ultra. HGX B300 NVL16 specifications (8 GPUs of two dies each; per GPU = 1/8):
    # FP32 600 TF, TF32 18 PF*, FP16/BF16 36 PF*, FP8 72 PF*: the B200's, except FP4 and FP64.
    # GB300 NVL72 keeps the GB200 NVL72's FP8 and BF16 figures. Both: medium confidence (no
    # per-GPU datasheet yet); RANKSCOPE_PEAK_FLOPS wins if you know better.
    "B300": {"fp32": 75e12, "tf32": 1.125e15, "bf16": 2.25e15, "fp16": 2.25e15, "fp8": 4.5e15},
    "GB300": {"fp32": 80e12, "tf32": 1.25e15, "bf16": 2.5e15, "fp16": 2.5e15, "fp8": 5e15},
    # NVIDIA A100 Tensor Core GPU datasheet: the same peaks for SXM4 and PCIe, 40 GB and 80 GB:
    # FP32 19.5 TF, TF32 156 TF (312*), BF16/FP16 312 TF (624*). No FP8. The A800 is an A100
    # with NVLink cut to 400 GB/s: the same compute.
    "A100": {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
    "A800": {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
    # NVIDIA A10 Tensor Core GPU datasheet: FP32 31.2 TF, TF32 62.5 TF (125*), BF16/FP16 125 TF (250*).
    "A10": {"fp32": 31.2e12, "tf32": 62.5e12, "bf16": 125e12, "fp16": 125e12},
    # The A10G (AWS G5) has no public NVIDIA datasheet; it is an A10 variant and AWS quotes the
    # A10's figures, used here. Its clocks may be lower: give RANKSCOPE_PEAK_FLOPS if you know better.
    "A10G": {"fp32": 31.2e12, "tf32": 62.5e12, "bf16": 125e12, "fp16": 125e12},
    # NVIDIA L4 Tensor Core GPU datasheet: FP32 30.3 TF, TF32 120 TF*, BF16/FP16 242 TF*, FP8 485 TF*.
    "L4": {"fp32": 30.3e12, "tf32": 60e12, "bf16": 121e12, "fp16": 121e12, "fp8": 242.5e12},
    # NVIDIA L40 datasheet: FP32 90.5 TF, TF32 90.5 | 181* TF, BF16/FP16 181 | 362* TF, FP8 362 | 724* TF.
    "L40": {"fp32": 90.5e12, "tf32": 90.5e12, "bf16": 181e12, "fp16": 181e12, "fp8": 362e12},
    # NVIDIA L40S datasheet: FP32 91.6 TF, TF32 183 | 366* TF, BF16/FP16 362.05 | 733* TF, FP8 733 | 1,466* TF
    # (its printed dense BF16 figure, 362.05, is not quite half of 733: the printed one is used).
    "L40S": {"fp32": 91.6e12, "tf32": 183e12, "bf16": 362.05e12, "fp16": 362.05e12, "fp8": 733e12},
    # NVIDIA Tesla V100 datasheet (SXM2, 16 and 32 GB): FP32 15.7 TF, tensor (FP16) 125 TF. Volta has
    # no sparsity, and no BF16 or TF32 tensor cores (bf16 runs emulated: no peak to compare with).
    "V100 SXM2": {"fp32": 15.7e12, "fp16": 125e12},
    # Same datasheet, V100 PCIe: FP32 14 TF, tensor 112 TF; V100S PCIe: FP32 16.4 TF, tensor 130 TF.
    "V100 PCIe": {"fp32": 14e12, "fp16": 112e12},
    "V100S PCIe": {"fp32": 16.4e12, "fp16": 130e12},
    # NVIDIA Ada GPU architecture whitepaper, GeForce RTX 4090: FP32 82.6 TF; tensor with FP32
    # accumulate (what PyTorch uses; GeForce runs it at half the FP16-accumulate rate):
    # FP16/BF16 165.2 | 330.4* TF, TF32 82.6 | 165.2* TF, FP8 330.3 | 660.6* TF.
    "RTX 4090": {"fp32": 82.6e12, "tf32": 82.6e12, "bf16": 165.2e12, "fp16": 165.2e12, "fp8": 330.3e12},
    # Same whitepaper, RTX 6000 Ada Generation (full-rate FP32 accumulate): FP32 91.1 TF,
    # FP16/BF16 364.2 | 728.5* TF, TF32 182.1 | 364.2* TF, FP8 728.5 | 1,457* TF.
    "RTX 6000 Ada": {"fp32": 91.1e12, "tf32": 182.1e12, "bf16": 364.2e12, "fp16": 364.2e12, "fp8": 728.5e12},
}

# How a reported name finds its entry, first match wins: (family, form factors,
# entry). The name is lower-cased and split into words at anything that is not a
# letter or digit ("NVIDIA A100-SXM4-80GB" -> nvidia a100 sxm4 80gb); the family
# must be one of the words (so "l4" is not found in "l40s"), each form factor a
# part of one ("pcie" in "pcie", "sxm" in "sxm5"). The most specific rows come
# first; a family with no form factor named is its SXM / default part.
_MATCH: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("h100", ("nvl",), "H100 NVL"),
    ("h100", ("pcie",), "H100 PCIe"),
    ("h100", (), "H100 SXM"),          # "NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM5 80GB"
    ("h200", ("nvl",), "H200 NVL"),
    ("h200", (), "H200 SXM"),          # "NVIDIA H200"
    ("h800", ("pcie",), "H800 PCIe"),
    ("h800", (), "H800 SXM"),          # "NVIDIA H800"
    ("gh200", (), "GH200"),            # "NVIDIA GH200 480GB" ("gh200" is its own word: not an H200)
    ("h20", (), "H20"),                # "NVIDIA H20" ("h20" is not a part of "h200": words are whole)
    ("gb200", (), "GB200"),
    ("b200", (), "B200"),
    ("gb300", (), "GB300"),
    ("b300", (), "B300"),              # "NVIDIA B300 SXM6 AC"
    ("a100", (), "A100"),              # "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe", ...
    ("a800", (), "A800"),              # "NVIDIA A800-SXM4-80GB"
    ("a10g", (), "A10G"),
    ("a10", (), "A10"),
    ("l40s", (), "L40S"),
    ("l40", (), "L40"),
    ("l4", (), "L4"),
    ("v100s", (), "V100S PCIe"),
    ("v100", ("pcie",), "V100 PCIe"),
    ("v100", (), "V100 SXM2"),         # "Tesla V100-SXM2-32GB"
    ("4090", ("rtx",), "RTX 4090"),    # "NVIDIA GeForce RTX 4090"
    ("6000", ("rtx", "ada"), "RTX 6000 Ada"),  # "NVIDIA RTX 6000 Ada Generation"
)


def peak_table_markdown() -> str:
    """``PEAK_FLOPS`` as the Markdown table of docs/goodput.md (TFLOP/s; tests/unit/test_flops.py
    checks that the document shows exactly this)."""
    lines = ["| GPU (entry) | bf16 | fp16 | tf32 | fp32 | fp8 |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for entry, peaks in PEAK_FLOPS.items():
        cells = [f"{peaks[d] / 1e12:g}" if d in peaks else "–" for d in ("bf16", "fp16", "tf32", "fp32", "fp8")]
        lines.append(f"| {entry} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def canonical_gpu(name: str | None) -> str | None:
    """The ``PEAK_FLOPS`` entry of a GPU name as NVML or torch reports it, else None.

    Case, spaces, dashes and word order do not matter: "NVIDIA H100 PCIe",
    "nvidia h100-pcie-80gb" and "H100 PCIE" are all "H100 PCIe".
    """
    if not isinstance(name, str):
        return None
    words = re.split(r"[^a-z0-9]+", name.lower())
    for family, forms, entry in _MATCH:
        if family in words and all(any(form in word for word in words) for form in forms):
            return entry
    return None


def normalise_dtype(dtype: str | torch.dtype) -> str | None:
    """``bf16``, ``fp16``, ``fp32``, ``tf32`` or ``fp8`` for any of their spellings
    (``"bfloat16"``, ``torch.float16``, ...); None if it is none of them."""
    text = str(dtype).strip().lower()
    text = text.removeprefix("torch.")
    text = _DTYPE_ALIASES.get(text, text)
    return text if text in DTYPES else None


# Streaming multiprocessors of the whole GPU, for the parts that can be split by MIG: a
# MIG instance reaches the peak in proportion to the SMs it was given (torch reports
# its count as the device's multi_processor_count).
FULL_SM_COUNT: dict[str, int] = {
    "H100 SXM": 132, "H100 PCIe": 114, "H100 NVL": 132, "H200 SXM": 132, "H200 NVL": 132, "H800 SXM": 132,
    "H800 PCIe": 114, "GH200": 132, "H20": 78, "A100": 108, "A800": 108, "B200": 148, "GB200": 152,
}
MIG_COMPUTE_SLICES = 7   # the compute slices of a MIG-capable GPU: "MIG 3g.40gb" has 3 of them


def lookup_peak_flops(gpu_name: str | None, dtype: str = "bf16", sm_count: int = 0) -> float | None:
    """Dense peak FLOP/s of the GPU called ``gpu_name`` for ``dtype``; None when the
    GPU is not in the table (MFU is then absent) or has no peak for that dtype.

    A MIG instance ("NVIDIA H100 80GB HBM3 MIG 1g.10gb") has its share of the GPU's
    peak: its ``sm_count`` over the whole GPU's, else its compute slices over seven."""
    entry = canonical_gpu(gpu_name)
    key = normalise_dtype(dtype)
    if entry is None or key is None:
        return None
    peak = PEAK_FLOPS[entry].get(key)
    if peak is None or "mig" not in re.split(r"[^a-z0-9]+", str(gpu_name).lower()):
        return peak
    full = FULL_SM_COUNT.get(entry)
    if sm_count > 0 and full:
        return peak * min(sm_count / full, 1.0)
    slices = re.search(r"\bmig\s+(\d)g\b", str(gpu_name).lower())
    return peak * int(slices.group(1)) / MIG_COMPUTE_SLICES if slices else None


def flops_per_token(model_params: float, *, attention_layers: int | None = None, model_width: int | None = None,
                    seq_len: int | None = None) -> float:
    """Training FLOPs per token of a dense transformer (forward + backward).

    ``6 * N``: each of the N parameters does a multiply-add (2 FLOPs) per
    token in the forward pass and twice that in the backward pass (gradients
    of the activations and of the weights): 2N + 4N. Kaplan et al. 2020, "Scaling
    Laws for Neural Language Models", section 2.1.

    With the layers L, model width H (d_model) and sequence length T, the
    attention scores and their weighted sum add ``12 * L * H * T`` per token
    (the Q·Kᵀ and attention·V matmuls, 2·T·H multiply-adds per layer forward,
    times 3 for forward + backward): PaLM, Chowdhery et al. 2022, appendix B,
    ``6N + 12·L·H·Q·T`` with H·Q = heads x head size = d_model. It does not
    depend on the number of heads, and counts the full T x T score matrix (a
    causal mask or FlashAttention computing only half is not subtracted, as in
    PaLM's MFU).

    >>> flops_per_token(124e6, attention_layers=12, model_width=768, seq_len=1024)
    857246208.0
    """
    per_token = 6.0 * model_params
    given = [v is not None for v in (attention_layers, model_width, seq_len)]
    if any(given):
        if not all(given):
            raise ConfigError("attention_layers, model_width and seq_len go together (the attention term "
                              "12 x layers x width x seq_len needs all three)")
        per_token += 12.0 * attention_layers * model_width * seq_len
    return per_token


def mfu(model_flops_per_second: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over the device's peak; None without a peak."""
    if not peak_flops:
        return None
    return model_flops_per_second / peak_flops


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class FlopsConfig:
    """What the user says about the model's FLOPs. Environment: ``RANKSCOPE_<FIELD>``
    (``dtype``: ``RANKSCOPE_FLOPS_DTYPE``). Give at most one of ``flops_per_token``,
    ``flops_per_sample`` and ``model_params``; without any, no model FLOPs are counted
    and MFU is absent."""

    flops_per_token: float | None = None
    """Training FLOPs (forward + backward) per token, as you computed them."""
    flops_per_sample: float | None = None
    """Training FLOPs per sample, for models without tokens (vision, ...)."""
    model_params: float | None = None
    """Parameter count N: FLOPs per token = 6 N (flops_per_token())."""
    attention_layers: int | None = None
    """With model_width and seq_len: PaLM's attention term 12 x layers x width x seq_len per token."""
    model_width: int | None = None
    """d_model (hidden size) of the attention layers."""
    seq_len: int | None = None
    """Tokens per sequence."""
    dtype: str = setting(env="RANKSCOPE_FLOPS_DTYPE", default="bf16")
    """The dtype the matmuls run in (bf16, fp16, fp32, tf32, fp8): which peak MFU divides by."""
    peak_flops: float | None = None
    """Peak FLOP/s of one device; wins over the table (an unlisted GPU, other clocks)."""

    def __post_init__(self) -> None:
        for name in ("flops_per_token", "flops_per_sample", "model_params", "peak_flops",
                     "attention_layers", "model_width", "seq_len"):
            value = getattr(self, name)
            if value is None:
                continue
            integral = name in ("attention_layers", "model_width", "seq_len")
            if not _is_number(value):
                raise ConfigError(f"must be a plain number (int or float), got {type(value).__name__} {value!r}"
                                  + (" (a tensor: pass .item())" if hasattr(value, "item") else ""), field=name)
            if not math.isfinite(value) or value <= 0:
                raise ConfigError(f"must be a finite number > 0, got {value!r}", field=name)
            if integral and value != int(value):
                raise ConfigError(f"must be a whole number, got {value!r}", field=name)
        given = [name for name in ("flops_per_token", "flops_per_sample", "model_params")
                 if getattr(self, name) is not None]
        if len(given) > 1:
            raise ConfigError(f"{' and '.join(given)} are both given: give one (FLOPs per token, FLOPs per sample, "
                              "or the parameter count for 6 x params per token)", field=given[-1])
        attention = [name for name in ("attention_layers", "model_width", "seq_len") if getattr(self, name) is not None]
        if attention and self.model_params is None:
            raise ConfigError("refines the 6 x model_params rule with the attention term: give model_params too",
                              field=attention[0])
        if attention and len(attention) < 3:
            missing = [n for n in ("attention_layers", "model_width", "seq_len") if n not in attention]
            raise ConfigError(f"the attention term 12 x layers x width x seq_len also needs {', '.join(missing)}",
                              field=attention[0])
        # A string, or a torch.dtype (str() gives "torch.bfloat16"); anything else is a mistake.
        dtype = normalise_dtype(self.dtype) if isinstance(self.dtype, str) or type(self.dtype).__name__ == "dtype" \
            else None
        if dtype is None:
            raise ConfigError(f"{self.dtype!r} is not one of {', '.join(DTYPES)}", field="dtype")
        object.__setattr__(self, "dtype", dtype)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> "FlopsConfig":
        """Explicit arguments win over ``RANKSCOPE_*`` variables, which win over defaults."""
        return environment.from_env(cls, env, **overrides)

    @property
    def per_token(self) -> float | None:
        """Training FLOPs per token: given, or from model_params (6N, + attention); None if neither."""
        if self.flops_per_token is not None:
            return float(self.flops_per_token)
        if self.model_params is not None:
            return flops_per_token(self.model_params, attention_layers=self.attention_layers,
                                   model_width=self.model_width, seq_len=self.seq_len)
        return None

    @property
    def per_sample(self) -> float | None:
        return None if self.flops_per_sample is None else float(self.flops_per_sample)

    @property
    def counts_flops(self) -> bool:
        """Whether a FLOPs figure was given (rankscope_model_flops_total is counted)."""
        return self.per_token is not None or self.per_sample is not None

    def step_flops(self, samples: float, tokens: float) -> float | None:
        """Model FLOPs of a step that processed ``samples`` and ``tokens``; None without a figure.
        A per-token figure needs the step's tokens counted (``step.count(tokens=...)``)."""
        per_token = self.per_token
        if per_token is not None:
            return per_token * tokens
        if self.flops_per_sample is not None:
            return float(self.flops_per_sample) * samples
        return None

    def peak(self, gpu_name: str | None, device_type: str = "cuda", sm_count: int = 0) -> float | None:
        """Peak FLOP/s of the rank's device for this dtype: the user's figure, else the table's
        (a MIG instance's share of it); None on a CPU (or any device that is not a GPU) and on
        a GPU the table does not know."""
        if device_type != "cuda":
            return None
        if self.peak_flops is not None:
            return float(self.peak_flops)
        return lookup_peak_flops(gpu_name, self.dtype, sm_count)


ENV_VARIABLES: tuple[str, ...] = tuple(
    (f.metadata.get("env") or (environment.PREFIX + f.name.upper(),))[0] for f in fields(FlopsConfig))
"""The variables FlopsConfig.from_env reads (documented in docs/goodput.md)."""
