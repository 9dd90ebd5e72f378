"""A real torchtitan job (torchtitan 0.3.0, its llama3 debug model), run as its users run it:
``torchrun ... torchtitan_job.py --module torchtitan_job --config rankscope_cpu_debug [torchtitan flags]``,
through rankscope's launcher (``rankscope.integrations.torchtitan.main``, torchtitan's own ``main``).

Test-only changes to torchtitan, made here and never in the adapter, because this
machine has no GPU:

1. the device: torchtitan picks ``cuda`` when torch finds no accelerator; here it is
   ``cpu`` (``torchtitan.tools.utils.device_type`` / ``device_module``, set before the
   rest of torchtitan imports them), so its process group is gloo; the device module is
   ``torch.cpu`` with the memory-statistics calls torchtitan's memory monitor makes
   answered as "none" (a CPU keeps no such statistics);
2. the attention kernel: FlexAttention has no backward on a CPU (torch raises), so its
   kernel call (``FlexAttention.compiled_flex_attn``) is replaced by torch's
   ``scaled_dot_product_attention`` with a causal mask: the same model and weights,
   attending causally across the packed documents instead of within each one;
3. the gradient reduction: torchtitan turns FSDP's gradient division off (factor 1), which
   FSDP then reduces with ``PREMUL_SUM(1/1)``, an op gloo lacks; FSDP is told to reduce with
   ``SUM`` instead (``set_force_sum_reduction_for_comms``): the same sums;
4. ``torch.distributed.set_timeout``, which torchtitan calls after the first step and this
   torch (2.13, CPU) does not have: it is given torch's own ``_set_pg_timeout``.

The tokenizer and dataset are the tiny ones the test made (``TITAN_ASSETS``: a
``tokenizer/`` and a ``c4_test/`` of JSON lines); nothing is downloaded.

What torchtitan itself saw, for the test to compare with (``LOOP_OUT``):

* ``rank<N>.metrics.jsonl``: each ``MetricsProcessor.log`` call (step, global mean and
  max loss, grad norm, learning rate, tokens seen, and the seconds its batch generator
  spent in the data loader since the last call);
* ``rank<N>.fr.json``: the flight recorder's whole ring (torch's own dump) when training
  is over, before the Trainer closes;
* torchtitan's own structured log (``<dump folder>/structured_logs``, on by default):
  its spans ``fwd_bwd``, ``optim``, ``fetching_batch``, ``checkpoint_save``, ``eval``.

``TITAN_WITHOUT_RANKSCOPE=1``: torchtitan's own ``main``, without rankscope.
``TITAN_STRICT_CUDA=1``: rankscope's launcher under the strict double of its CUDA boundary
(tests/helpers/strict_cuda.py; every tensor taken for one on cuda:1), whose violations go to
``rank<N>.strict.json``.
``TITAN_HANG_RANK`` / ``TITAN_HANG_STEP``: that rank stops for good before that step's
forward (a rank that hangs; its peer then waits in the next collective).
"""

from __future__ import annotations

import json
import os
import time
import types
from pathlib import Path

import torch
import torchtitan.tools.utils as titan_utils


def _cpu_device_module() -> types.SimpleNamespace:
    """torch.cpu with the few CUDA-module calls torchtitan makes (its memory monitor's), answered for a CPU."""
    cpu = types.SimpleNamespace(**{name: getattr(torch.cpu, name) for name in dir(torch.cpu)
                                   if not name.startswith("_")})
    cpu.get_device_name = lambda device=None: "cpu"
    cpu.current_device = lambda: 0   # an index, as torch.cuda's (torchtitan's barrier passes it as device_ids)
    cpu.get_device_properties = lambda device=None: types.SimpleNamespace(total_memory=os.sysconf("SC_PHYS_PAGES")
                                                                          * os.sysconf("SC_PAGE_SIZE"))
    cpu.memory_stats = lambda device=None: {}
    cpu.reset_peak_memory_stats = cpu.empty_cache = lambda device=None: None
    return cpu


# (1) the device: before any other torchtitan module copies these names.
titan_utils.device_type, titan_utils.device_module = "cpu", _cpu_device_module()

import torchtitan.distributed.fsdp as titan_fsdp  # noqa: E402
from torchtitan.components.metrics import MetricsProcessor  # noqa: E402
from torchtitan.models.common.attention import FlexAttention  # noqa: E402
from torchtitan.models.llama3.config_registry import llama3_debugmodel  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402



def _causal_sdpa(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
    """(2) FlexAttention's kernel call, on a CPU: causal SDPA (no auxiliary outputs are asked for here)."""
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                           enable_gqa=enable_gqa)
    return out, types.SimpleNamespace(lse=None, max_scores=None)


FlexAttention.compiled_flex_attn = staticmethod(_causal_sdpa)
_disable_division = titan_fsdp.disable_fsdp_gradient_division


def _disable_division_with_sums(model):
    """(3) FSDP's gradient division off, reduced with SUM (gloo has no PREMUL_SUM)."""
    _disable_division(model)
    for module in model.modules():
        if isinstance(module, titan_fsdp.FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


titan_fsdp.disable_fsdp_gradient_division = _disable_division_with_sums
if not hasattr(torch.distributed, "set_timeout"):   # (4)
    from torch.distributed.distributed_c10d import _set_pg_timeout

    torch.distributed.set_timeout = _set_pg_timeout

ASSETS = Path(os.environ.get("TITAN_ASSETS", "."))


def rankscope_cpu_debug() -> Trainer.Config:
    """torchtitan's llama3 debug model, as its registry builds it, at a size a CPU trains in seconds."""
    config = llama3_debugmodel()
    config.hf_assets_path = str(ASSETS / "tokenizer")
    config.dataloader.dataset_path = str(ASSETS / "c4_test")
    config.validator.dataloader.dataset = "c4_test"
    config.validator.dataloader.dataset_path = str(ASSETS / "c4_test")
    config.training.seq_len = 64
    config.training.local_batch_size = 4
    config.training.disable_cuda_graphs = True
    # FSDP's default compute dtype is bfloat16; a CPU without bfloat16 instructions runs those matmuls
    # at ~1 GFLOP/s (a 3.5 s step here, 0.4 s in float32).
    config.training.mixed_precision_param = "float32"
    return config


def _record_torchtitans_own_figures(out: Path, rank: int) -> None:
    log = MetricsProcessor.log

    def recorded_log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        with open(out / f"rank{rank}.metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "avg_loss": global_avg_loss, "max_loss": global_max_loss,
                                "grad_norm": grad_norm, "data_loading_s": sum(self.data_loading_times),
                                "extra": {k: float(v) for k, v in (extra_metrics or {}).items()}}) + "\n")
        return log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)

    MetricsProcessor.log = recorded_log

    close = Trainer.close

    def dump_then_close(self):
        from torch._C._distributed_c10d import _dump_fr_trace_json

        (out / f"rank{rank}.fr.json").write_bytes(_dump_fr_trace_json(True, False))
        return close(self)

    Trainer.close = dump_then_close


def _hang(rank: int, at_step: int) -> None:
    forward_backward_step = Trainer.forward_backward_step

    def hanging(self, *args, **kwargs):
        if self.step >= at_step:
            print(f"rank {rank}: hanging before step {self.step}'s forward", flush=True)
            while True:
                time.sleep(3600)
        return forward_backward_step(self, *args, **kwargs)

    Trainer.forward_backward_step = hanging


if __name__ == "__main__":
    rank = int(os.environ["RANK"])
    out = Path(os.environ.get("LOOP_OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    _record_torchtitans_own_figures(out, rank)
    if os.environ.get("TITAN_HANG_RANK") == str(rank):
        _hang(rank, int(os.environ["TITAN_HANG_STEP"]))
    if os.environ.get("TITAN_WITHOUT_RANKSCOPE"):   # the same job, bare: what rankscope must not change
        import torchtitan.train

        torchtitan.train.main()
    elif os.environ.get("TITAN_STRICT_CUDA"):   # under the strict double of rankscope's CUDA boundary
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        from rankscope.integrations.torchtitan import main
        from tests.helpers.strict_cuda import StrictCuda

        cuda = StrictCuda(rank_device=1)
        try:
            with cuda:
                cuda.set_device(1)
                main()
        except AssertionError:   # the violations, written below for the test to read
            pass
        finally:
            (out / f"rank{rank}.strict.json").write_text(json.dumps(cuda.violations))
    else:
        from rankscope.integrations.torchtitan import main

        main()
