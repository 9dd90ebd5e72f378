"""rankscope.flops: the peak-FLOPS table, FLOPs per token and FlopsConfig (docs/goodput.md).

Pure functions and one dataclass: no torch, no device. The expected values are
computed by hand in the comments.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest

from rankscope import flops
from rankscope.contract.environment import ConfigError
from rankscope.flops import FlopsConfig, canonical_gpu, flops_per_token, lookup_peak_flops

H100_SXM = "NVIDIA H100 80GB HBM3"


def test_gpt2_small_on_an_h100_by_hand():
    """GPT-2 small: N = 124M parameters, 12 layers x 768 wide, 1024-token sequences.

    6 N                 = 6 x 124,000,000            =   744,000,000
    12 L H T            = 12 x 12 x 768 x 1024       =   113,246,208
    FLOPs per token     = 744,000,000 + 113,246,208  =   857,246,208
    at 400,000 tokens/s per GPU: 857,246,208 x 4e5   = 342.8984832e12 FLOP/s
    H100 SXM (NVML: "NVIDIA H100 80GB HBM3") bf16 dense peak: 989.4e12 FLOP/s
    MFU                 = 342.8984832 / 989.4        = 0.34657 (34.7%)
    (6 N alone: 744e6 x 4e5 / 989.4e12 = 0.30079.)
    """
    config = FlopsConfig(model_params=124e6, attention_layers=12, model_width=768, seq_len=1024)
    assert config.per_token == 857_246_208
    peak = config.peak(H100_SXM)
    assert peak == 989.4e12
    assert flops.mfu(config.per_token * 400_000, peak) == pytest.approx(0.346572, abs=1e-6)
    assert flops.mfu(FlopsConfig(model_params=124e6).per_token * 400_000, peak) == pytest.approx(0.300788, abs=1e-6)
    # A step of 8 sequences of 1024 tokens: 8,192 x 857,246,208 = 7.0225609e12 FLOPs.
    assert config.step_flops(samples=8, tokens=8192) == 8192 * 857_246_208


def test_six_n_rule_and_attention_term():
    assert flops_per_token(1e9) == 6e9
    # 7B-like: 32 layers x 4096 wide x 4096 tokens: 12 x 32 x 4096 x 4096 = 6,442,450,944 on top of 6 x 7e9.
    assert flops_per_token(7e9, attention_layers=32, model_width=4096, seq_len=4096) == 42e9 + 6_442_450_944
    with pytest.raises(ConfigError, match="go together"):
        flops_per_token(1e9, attention_layers=12)


def test_flops_per_sample_counts_samples_not_tokens():
    config = FlopsConfig(flops_per_sample=4.1e9)        # e.g. a ResNet-50 at 224 px: ~4.1 GFLOPs forward x 3
    assert config.per_token is None and config.per_sample == 4.1e9
    assert config.step_flops(samples=256, tokens=0) == 256 * 4.1e9
    assert FlopsConfig(flops_per_token=2e9).step_flops(samples=4, tokens=1000) == 2e12


def test_no_figure_counts_nothing():
    config = FlopsConfig()
    assert not config.counts_flops
    assert config.step_flops(samples=8, tokens=8192) is None
    assert FlopsConfig(model_params=1e6).counts_flops


@pytest.mark.parametrize("name,entry", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"),
    ("NVIDIA H100 SXM5 80GB", "H100 SXM"),
    ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H100 NVL", "H100 NVL"),
    ("NVIDIA H200", "H200 SXM"),
    ("NVIDIA H200 NVL", "H200 NVL"),
    ("NVIDIA A100-SXM4-80GB", "A100"),
    ("NVIDIA A100-SXM4-40GB", "A100"),
    ("NVIDIA A100-PCIE-40GB", "A100"),
    ("NVIDIA A100 80GB PCIe", "A100"),
    ("NVIDIA A10G", "A10G"),
    ("NVIDIA A10", "A10"),
    ("NVIDIA L4", "L4"),
    ("NVIDIA L40", "L40"),
    ("NVIDIA L40S", "L40S"),
    ("Tesla V100-SXM2-32GB", "V100 SXM2"),
    ("Tesla V100-SXM2-16GB", "V100 SXM2"),
    ("Tesla V100-PCIE-32GB", "V100 PCIe"),
    ("Tesla V100S-PCIE-32GB", "V100S PCIe"),
    ("NVIDIA B200", "B200"),
    ("NVIDIA GB200", "GB200"),
    ("NVIDIA B300 SXM6 AC", "B300"),
    ("NVIDIA GB300", "GB300"),
    ("NVIDIA H800", "H800 SXM"),
    ("NVIDIA H800 PCIe", "H800 PCIe"),
    ("NVIDIA GH200 480GB", "GH200"),
    ("NVIDIA GH200 144G HBM3e", "GH200"),
    ("NVIDIA H20", "H20"),
    ("NVIDIA A800-SXM4-80GB", "A800"),
    ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "H100 SXM"),
    ("NVIDIA GeForce RTX 4090", "RTX 4090"),
    ("NVIDIA RTX 6000 Ada Generation", "RTX 6000 Ada"),
])
def test_nvml_names_find_their_entry(name, entry):
    assert canonical_gpu(name) == entry


@pytest.mark.parametrize("spelling", [
    "NVIDIA H100 PCIe", "nvidia h100 pcie", "NVIDIA  H100   PCIE", "NVIDIA H100-PCIe-80GB", "H100 PCIe", "h100_pcie",
])
def test_spelling_variants_of_one_gpu(spelling):
    assert canonical_gpu(spelling) == "H100 PCIe"
    assert lookup_peak_flops(spelling, "bf16") == 756.5e12


@pytest.mark.parametrize("name", [
    "NVIDIA H2000", "Quadro RTX 6000", "NVIDIA RTX A6000", "Tesla T4", "AMD Instinct MI300X",
    "", "cpu", None,
])
def test_unknown_gpu_has_no_peak(name):
    assert canonical_gpu(name) is None
    assert lookup_peak_flops(name, "bf16") is None
    assert FlopsConfig(model_params=1e9).peak(name) is None


def test_families_do_not_match_inside_other_names():
    """"l4" is not the L40S, "a10" not the A100 or A10G, "b200" not the GB200."""
    assert canonical_gpu("NVIDIA L40S") == "L40S"
    assert canonical_gpu("NVIDIA A100-SXM4-80GB") == "A100"
    assert canonical_gpu("NVIDIA GB200") == "GB200"


def test_peaks_are_dense_figures_per_dtype():
    """Spot checks against the datasheets' dense figures (half of the sparse ones)."""
    assert lookup_peak_flops(H100_SXM, "fp8") == 1978.9e12          # 3,958 TF with sparsity / 2
    assert lookup_peak_flops(H100_SXM, "tf32") == 494.7e12          # 989 TF with sparsity / 2
    assert lookup_peak_flops(H100_SXM, "fp32") == 66.9e12
    assert lookup_peak_flops("NVIDIA A100-SXM4-80GB", "bf16") == 312e12
    assert lookup_peak_flops("NVIDIA A100-SXM4-80GB", "fp8") is None  # Ampere has no FP8 tensor cores
    assert lookup_peak_flops("Tesla V100-SXM2-32GB", "fp16") == 125e12
    assert lookup_peak_flops("Tesla V100-SXM2-32GB", "bf16") is None  # Volta has no BF16 tensor cores
    assert lookup_peak_flops("NVIDIA B200", "bf16") == 2.25e15       # HGX B200 36 PF* / 8 GPUs / 2
    for entry, peaks in flops.PEAK_FLOPS.items():
        assert set(peaks) <= set(flops.DTYPES), entry
        assert all(v > 0 for v in peaks.values()), entry
        if "bf16" in peaks and "fp8" in peaks:
            # (the L40S datasheet prints 362.05 dense BF16 beside 733 dense FP8: 1.2% off)
            assert peaks["fp8"] == pytest.approx(2 * peaks["bf16"], rel=0.015), entry
        if "bf16" in peaks and "tf32" in peaks:
            assert peaks["tf32"] <= peaks["bf16"], entry


def test_every_entry_is_reachable_by_a_name():
    assert {entry for _, _, entry in flops._MATCH} == set(flops.PEAK_FLOPS)


def test_user_peak_wins_and_cpu_has_none():
    config = FlopsConfig(flops_per_token=1e9, peak_flops=500e12)
    assert config.peak(H100_SXM) == 500e12                 # over the table
    assert config.peak("NVIDIA H800") == 500e12            # and where the table knows nothing
    assert config.peak(H100_SXM, device_type="cpu") is None
    assert FlopsConfig(flops_per_token=1e9).peak(None, device_type="cpu") is None


def test_dtype_selects_the_peak_and_accepts_torch_spellings():
    assert FlopsConfig(dtype="fp8").peak(H100_SXM) == 1978.9e12
    assert FlopsConfig(dtype="bfloat16").dtype == "bf16"
    assert FlopsConfig(dtype="torch.float16").dtype == "fp16"
    assert FlopsConfig(dtype=" TF32 ").dtype == "tf32"
    assert FlopsConfig().dtype == "bf16"


@pytest.mark.parametrize("kwargs,message", [
    ({"flops_per_token": -1.0}, "flops_per_token: must be a finite number > 0"),
    ({"flops_per_token": 0}, "flops_per_token: must be a finite number > 0"),
    ({"flops_per_sample": math.nan}, "flops_per_sample: must be a finite number > 0"),
    ({"model_params": math.inf}, "model_params: must be a finite number > 0"),
    ({"peak_flops": -5e12}, "peak_flops: must be a finite number > 0"),
    ({"flops_per_token": "1e9"}, "flops_per_token: must be a plain number"),
    ({"flops_per_token": True}, "flops_per_token: must be a plain number"),
    ({"flops_per_token": 1e9, "flops_per_sample": 4e9}, "flops_per_token and flops_per_sample are both given"),
    ({"flops_per_token": 1e9, "model_params": 1e8}, "flops_per_token and model_params are both given"),
    ({"attention_layers": 12, "model_width": 768, "seq_len": 1024}, "attention_layers: .* give model_params too"),
    ({"model_params": 1e8, "attention_layers": 12}, "also needs model_width, seq_len"),
    ({"model_params": 1e8, "attention_layers": 12.5, "model_width": 768, "seq_len": 1024},
     "attention_layers: must be a whole number"),
    ({"dtype": "int8"}, "dtype: 'int8' is not one of bf16, fp16, fp32, tf32, fp8"),
    ({"dtype": 16}, "dtype: 16 is not one of"),
])
def test_bad_values_raise_config_error_naming_the_field(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        FlopsConfig(**kwargs)


def test_a_tensor_instead_of_a_number_is_refused_with_a_hint():
    class FakeTensor:   # what matters is the type: not a number, has .item() (torch is not imported here)
        def item(self) -> float:
            return 1e9

        def __repr__(self) -> str:
            return "tensor(1.0000e+09)"

    with pytest.raises(ConfigError, match=r"flops_per_token: must be a plain number .*got FakeTensor.*pass \.item\(\)"):
        FlopsConfig(flops_per_token=FakeTensor())


def test_numpy_and_integer_numbers_are_accepted():
    np = pytest.importorskip("numpy")
    config = FlopsConfig(model_params=np.int64(124_000_000), attention_layers=np.int64(12), model_width=768,
                         seq_len=1024)
    assert config.per_token == 857_246_208
    assert FlopsConfig(flops_per_token=np.float32(2.0e9)).per_token == pytest.approx(2e9)


def test_from_env_reads_every_variable():
    env = {"RANKSCOPE_MODEL_PARAMS": "124e6", "RANKSCOPE_ATTENTION_LAYERS": "12", "RANKSCOPE_MODEL_WIDTH": "768",
           "RANKSCOPE_SEQ_LEN": "1024", "RANKSCOPE_FLOPS_DTYPE": "fp16", "RANKSCOPE_PEAK_FLOPS": "7.5e14"}
    config = FlopsConfig.from_env(env)
    assert config == FlopsConfig(model_params=124e6, attention_layers=12, model_width=768, seq_len=1024,
                                 dtype="fp16", peak_flops=7.5e14)
    assert config.per_token == 857_246_208
    assert FlopsConfig.from_env({"RANKSCOPE_FLOPS_PER_TOKEN": "2e9"}).per_token == 2e9
    assert FlopsConfig.from_env({"RANKSCOPE_FLOPS_PER_SAMPLE": "4.1e9"}).per_sample == 4.1e9
    assert FlopsConfig.from_env({}) == FlopsConfig()
    assert set(flops.ENV_VARIABLES) == {
        "RANKSCOPE_FLOPS_PER_TOKEN", "RANKSCOPE_FLOPS_PER_SAMPLE", "RANKSCOPE_MODEL_PARAMS",
        "RANKSCOPE_ATTENTION_LAYERS", "RANKSCOPE_MODEL_WIDTH", "RANKSCOPE_SEQ_LEN", "RANKSCOPE_FLOPS_DTYPE",
        "RANKSCOPE_PEAK_FLOPS"}


def test_from_env_explicit_values_win_and_empty_variables_are_unset():
    env = {"RANKSCOPE_FLOPS_PER_TOKEN": "2e9", "RANKSCOPE_FLOPS_DTYPE": ""}
    assert FlopsConfig.from_env(env, flops_per_token=3e9).per_token == 3e9
    assert FlopsConfig.from_env(env).dtype == "bf16"


@pytest.mark.parametrize("env,message", [
    ({"RANKSCOPE_FLOPS_PER_TOKEN": "lots"}, "RANKSCOPE_FLOPS_PER_TOKEN='lots' is not a number"),
    ({"RANKSCOPE_SEQ_LEN": "1024.5"}, "RANKSCOPE_SEQ_LEN='1024.5' is not a number"),
    ({"RANKSCOPE_FLOPS_PER_TOKEN": "-1"}, "RANKSCOPE_FLOPS_PER_TOKEN: must be a finite number > 0"),
    ({"RANKSCOPE_FLOPS_DTYPE": "int4"}, "RANKSCOPE_FLOPS_DTYPE: 'int4' is not one of"),
    ({"RANKSCOPE_PEAK_FLOPS": "0"}, "RANKSCOPE_PEAK_FLOPS: must be a finite number > 0"),
    ({"RANKSCOPE_FLOPS_PER_TOKEN": "1e9", "RANKSCOPE_FLOPS_PER_SAMPLE": "1e9"},
     "RANKSCOPE_FLOPS_PER_SAMPLE: flops_per_token and flops_per_sample are both given"),
    ({"RANKSCOPE_SEQ_LEN": "1024"}, "RANKSCOPE_SEQ_LEN: refines the 6 x model_params rule"),
])
def test_from_env_errors_name_the_variable(env, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        FlopsConfig.from_env(env)


def test_importing_flops_does_not_import_torch():
    code = "import sys, rankscope.flops; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"



def test_docs_show_the_peak_table():
    """docs/goodput.md shows exactly PEAK_FLOPS (regenerate it: .venv/bin/python deploy/generate.py)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "goodput.md").read_text()
    block = text.split("<!-- peak-flops:start -->\n", 1)[1].split("\n<!-- peak-flops:end -->", 1)[0]
    assert block == flops.peak_table_markdown()
    for variable in flops.ENV_VARIABLES:
        assert f"`{variable}`" in text, variable


def test_a_mig_instance_gets_its_share_of_the_peak():
    """A MIG slice reaches the peak in proportion to its SMs (torch's multi_processor_count
    for the instance); without that count, its compute slices out of seven."""
    full = lookup_peak_flops("NVIDIA H100 80GB HBM3", "bf16")
    assert lookup_peak_flops("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "bf16", sm_count=16) == pytest.approx(full * 16 / 132)
    assert lookup_peak_flops("NVIDIA H100 80GB HBM3 MIG 3g.40gb", "bf16") == pytest.approx(full * 3 / 7)
    assert lookup_peak_flops("NVIDIA A100-SXM4-40GB MIG 7g.40gb", "bf16", sm_count=98) == pytest.approx(312e12 * 98 / 108)
    assert lookup_peak_flops("NVIDIA H100 80GB HBM3", "bf16", sm_count=16) == full   # not MIG: the whole GPU
    assert FlopsConfig(model_params=1e9).peak("NVIDIA H100 80GB HBM3 MIG 2g.20gb", "cuda", 32) == \
        pytest.approx(full * 32 / 132)
