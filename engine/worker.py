"""The plain worker class behind the Ray GPU actor (cluster/worker.py wraps it, nothing more).

It loads one checkpoint CPU-first, then runs planned episodes one at a time and returns each
as a record (plain dict + a numpy logits array). An episode that raises (an out-of-memory under
the allowance, say) comes back as a failed record with its cause; the worker stays usable.
"""

import os
import platform
import time
import traceback
from pathlib import Path

import torch

from core.metrics import episode_totals
from engine.episode import run_episode
from engine.model import CpuFirstModel
from engine.shapes import dtype_of

MIB = 1 << 20


def environment(device: torch.device) -> dict:
    """What the archive manifest says about where a screen ran."""
    env = {
        "host": platform.node(),
        "pid": os.getpid(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "",
        "device": str(device),
        "gpu": "",
        "gpu_index": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        "driver": "",
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        try:
            import pynvml

            pynvml.nvmlInit()
            env["driver"] = pynvml.nvmlSystemGetDriverVersion()
        except Exception:  # NVML missing: the driver is unknown, not fatal
            env["driver"] = "unknown"
    return env


class Worker:
    def __init__(self, device: str | None = None) -> None:
        self.t_entry = time.perf_counter()
        # Under Ray, CUDA_VISIBLE_DEVICES holds only the assigned GPU: it is index 0 here.
        self.device = torch.device(device or ("cuda:0" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", 0)
        self.model: CpuFirstModel | None = None
        self.conditions: dict[str, str] = {}

    def describe(self) -> dict:
        return environment(self.device)

    def load(self, body: dict, model_dir: str) -> dict:
        """Build the CPU-first model for a frozen protocol and impose its allowance on CUDA."""
        if self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            # Caps PyTorch's allocator only; the CUDA context (~0.5 GiB) comes on top (shared/ray.md).
            torch.cuda.set_per_process_memory_fraction(min(1.0, body["allowance_mib"] * MIB / total), self.device)
        self.model = CpuFirstModel(Path(model_dir), dtype=dtype_of(body["dtype"]), device=self.device)
        self.conditions = {c["name"]: c["policy"] for c in body["conditions"]}
        self.continuation = body["continuation_tokens"]
        s = self.model.start
        return {"read_s": s.read_s, "place_s": s.place_s, "device_param_bytes": s.device_param_bytes,
                "host_outgoing_bytes": s.host_outgoing_bytes, "vocab": self.model.vocab,
                "entry_to_loaded_s": time.perf_counter() - self.t_entry}

    def run(self, entry: dict, prompt: list[int]) -> dict:
        """One planned episode -> record (see core/gates.py for the fields the gates read)."""
        assert self.model is not None, "load() first"
        record = {"plan_index": entry["index"], "condition": entry["condition"], "role": entry["role"],
                  "prompt": entry["prompt"], "policy": self.conditions[entry["condition"]]}
        t0 = time.perf_counter()
        try:
            self.model.use(record["policy"])
            out = run_episode(self.model, prompt, continuation=self.continuation)
        except Exception as e:  # recorded, never retried into a pass
            return {**record, "status": "failed", "error": f"{type(e).__name__}: {e}",
                    "traceback": traceback.format_exc(limit=5), "episode_s": time.perf_counter() - t0,
                    "logits": None}
        calls = [c.to_dict() for c in out.calls]
        return {**record, "status": "ok", "error": None, "tokens": out.tokens, "wall_s": out.wall_s,
                **episode_totals(calls),
                "memory": {"peak_allocated_bytes": out.peak_allocated_bytes, "peak_sampled_bytes": None,
                           "kv_bytes": out.kv_bytes, "policy_device_bytes": self.model.slot.policy.device_bytes(),
                           "host_outgoing_bytes": self.model.host.host_bytes},
                "calls": calls, "logits": out.logits}
