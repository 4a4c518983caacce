"""How long a planned screen will take, from what earlier screens measured on the same device.

A transfer floor at the GPU's copy rate says nothing about a CPU screen (one the floor put at
">= 1.896 s" took 293-301 s), so `protocol plan` prefers measured rates: every ok episode the
database holds of the same model and dtype, per condition, on the same accelerator kind (its
GPU's name), or on this very host for the CPU. Its rate is seconds of episode wall per generated
token; a planned episode generates `continuation_tokens`. Pure functions over plain rows, apart
from `device_here` (reads /proc) and `earlier_episodes` (reads the database).
"""

from __future__ import annotations

import platform
from pathlib import Path
from statistics import median

CPU = "cpu"


def device_here() -> str:
    """This machine's accelerator kind as attempts record it (`NVIDIA H200`), or `cpu`; read from
    the NVIDIA driver's /proc files, so neither torch nor NVML is imported."""
    gpus = Path("/proc/driver/nvidia/gpus")
    for info in sorted(gpus.glob("*/information")) if gpus.is_dir() else []:
        for line in info.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Model" and value.strip():
                return value.strip()
    return CPU


def model_key(protocol, *, model_dir: Path | None = None) -> str:
    """What identifies a protocol's model among earlier episodes: `synth:<shape>`, or the
    checkpoint's resolved directory (`model_dir`, as submit stores it in each screen), not the
    spelling of model.path (`../models/x` and `/abs/models/x` are one checkpoint)."""
    synth = protocol.model.synth
    if synth is not None:
        return f"synth:{synth.shape}"
    return str(model_dir) if model_dir is not None else str(protocol.model.path)


def comparable(rows: list[dict], *, model: str, dtype: str, device: str, host: str) -> list[dict]:
    """The rows whose time predicts this screen's: ok episodes with tokens and a wall, of the same
    model and dtype, on the same accelerator kind (the CPU: on the same host)."""
    def same_device(r: dict) -> bool:
        kind = r.get("gpu_name") or CPU
        return kind == device and (device != CPU or r.get("host") == host)

    return [r for r in rows if r.get("status") == "ok" and (r.get("n_tokens") or 0) > 0 and (r.get("wall_s") or 0) > 0
            and model in (r.get("model"), r.get("model_dir")) and r.get("dtype") == dtype and same_device(r)]


def measured_estimate(rows: list[dict], *, planned: dict[str, int], tokens: int) -> dict:
    """Per planned condition (name -> episodes), its measured seconds per generated token (the
    median over the earlier episodes of that condition) and the time of its episodes, each
    generating `tokens`; `total_s` is None unless every condition has a rate."""
    conditions, measured = [], 0
    for name, episodes in planned.items():
        own = [r["wall_s"] / r["n_tokens"] for r in rows if r["condition"] == name]
        measured += len(own)
        rate = median(own) if own else None
        conditions.append({"condition": name, "episodes": episodes, "measured_episodes": len(own),
                           "s_per_token": rate, "episode_s": None if rate is None else rate * tokens,
                           "total_s": None if rate is None else rate * tokens * episodes})
    known = all(c["s_per_token"] is not None for c in conditions)
    return {"measured_episodes": measured, "conditions": conditions,
            "total_s": sum(c["total_s"] for c in conditions) if known and conditions else None}


def earlier_episodes(db_url: str | None, *, model: str, dtype: str) -> tuple[list[dict], str | None]:
    """The database's episodes of `model` in `dtype` as plain dicts, and why none were read
    (no database file, one not at the newest schema, one that does not answer), else None.
    A SQLite file that does not exist is not created."""
    from packbench.cli.common import open_store
    from packbench.core.errors import PackbenchError
    from packbench.core.settings import DEFAULT_DB_URL

    url = db_url or DEFAULT_DB_URL
    if url.startswith("sqlite:///") and "?" not in url and not Path(url[len("sqlite:///"):]).is_file():
        return [], f"no database at {url}"
    try:
        from packbench.db.queries import ResultFilter

        store = open_store(url)
        rows = store.results(ResultFilter(model=model, dtype=dtype, status="ok"))
    except PackbenchError as e:
        return [], f"database not read ({e})"
    return [r._asdict() for r in rows], None


def this_host() -> str:
    return platform.node()
