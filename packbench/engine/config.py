"""config.json of a local OPT checkpoint, checked without importing torch (submit reads it)."""

import json
import math
import re
import stat
import struct
from pathlib import Path

from packbench.core.errors import CheckpointError
from packbench.core.text import one_line, show


def read_config(model_dir: Path) -> dict:
    """config.json of an OPT checkpoint, or a one-line CheckpointError naming the fix."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        if model_dir.exists() or model_dir.is_symlink():  # a file (or a dangling link): never synthesise over it
            raise CheckpointError(f"model path {model_dir} is not a directory; point model.path at a Hugging Face "
                                  f"OPT checkpoint directory (the folder holding config.json)")
        raise CheckpointError(
            f"model directory {model_dir} does not exist; create one with "
            f"`packbench model synth --out {model_dir}` or set model.path to a local OPT checkpoint"
        )
    path = model_dir / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir} is a directory without config.json, not a model checkpoint; point "
                              f"model.path at a Hugging Face OPT directory (or `packbench model synth --out DIR`)")
    config = _json(path)
    _finite(config, path)
    from packbench.core.moe import FAMILIES

    if isinstance(config.get("model_type"), str) and config["model_type"] in FAMILIES:  # engine/moe/ runs it
        return _moe(config, path)
    if config.get("model_type") != "opt":
        raise CheckpointError(
            f"{model_dir} is a {show(config.get('model_type'))} model; packbench supports OPT (model_type 'opt') and the "
            f"MoE families {', '.join(FAMILIES)}"
        )
    for key, most in OPT_INTEGERS.items():
        value = config.get(key, OPT_DEFAULTS.get(key))
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
            raise CheckpointError(f"{path}: {key} is {show(value)}, not an integer in 1..{most}; fix config.json")
    if config["hidden_size"] % config["num_attention_heads"]:
        raise CheckpointError(f"{path}: hidden_size {config['hidden_size']} is not a multiple of num_attention_heads "
                              f"{config['num_attention_heads']}; fix config.json")
    pad = config.get("pad_token_id", OPT_DEFAULTS["pad_token_id"])
    if pad is not None and (isinstance(pad, bool) or not isinstance(pad, int) or not 0 <= pad < config["vocab_size"]):
        raise CheckpointError(f"{path}: pad_token_id is {show(pad)}, not a token id below vocab_size "
                              f"{config['vocab_size']}; fix config.json")
    for key in ("torch_dtype", "dtype"):
        if not isinstance(config.get(key, ""), (str, type(None))):
            raise CheckpointError(f"{path}: {key} is {show(config[key])}, not a dtype name; fix config.json")
    if not config.get("do_layer_norm_before", True):
        raise CheckpointError(
            f"{model_dir} is a post-LayerNorm OPT (do_layer_norm_before=false, like OPT-350m); only pre-LN OPT is "
            f"supported: {OTHER_OPT}"
        )
    if config.get("activation_function", "relu") != "relu":
        raise CheckpointError(
            f"{model_dir} uses activation {show(config.get('activation_function'))}; exact packets need ReLU"
        )
    if config.get("word_embed_proj_dim", config["hidden_size"]) != config["hidden_size"]:
        raise CheckpointError(f"{model_dir} projects embeddings (word_embed_proj_dim {show(config['word_embed_proj_dim'])} "
                              f"!= hidden_size {config['hidden_size']}, like OPT-350m); unsupported: {OTHER_OPT}")
    return config


# The fix for OPT-350m's layout (post-LN, projected embeddings): every other published OPT runs.
OTHER_OPT = "use another OPT size (opt-125m, opt-1.3b and up are pre-LN, without a projection)"


# The integers an OPT config.json gives the model's shape, each bounded far above any real OPT's
# (OPT-175B: 12,288 hidden, 49,152 ffn, 96 layers and heads, 2,048 positions, 50,272 tokens):
# a value outside them (`num_hidden_layers: -1`, `max_position_embeddings: 2**62`, 3 heads of a
# 64-wide model) was passed to torch or transformers, which raised their own errors (exit 70), or
# built a million layers for minutes. Every real OPT config.json has all of them; the two with
# defaults take engine/opt_weights.py's (transformers' OPTConfig's).
OPT_INTEGERS = {"hidden_size": 1 << 16, "vocab_size": 1 << 22, "num_hidden_layers": 4096, "num_attention_heads": 4096,
                "ffn_dim": 1 << 20, "max_position_embeddings": 1 << 20}
OPT_DEFAULTS = {"max_position_embeddings": 2048, "pad_token_id": 1}


def _moe(config: dict, path: Path) -> dict:
    """An MoE config.json: every key the byte arithmetic reads is a positive integer."""
    from packbench.core.moe import FAMILIES, config_experts

    f = FAMILIES[config["model_type"]]
    # transformers reads either name as the other (each family's attribute_map): two counts that
    # differ gave the model the last one written, and packbench's byte arithmetic its family's key.
    both = [config[k] for k in ("num_experts", "num_local_experts") if k in config]
    if len(both) == 2 and both[0] != both[1]:
        raise CheckpointError(f"{path}: num_experts is {show(both[0])} and num_local_experts {show(both[1])}, two "
                              f"names of one expert count; keep one ({f['experts']}); fix config.json")
    bounds = {**MOE_INTEGERS, f["experts"]: MOE_INTEGERS["experts"], f["intermediate"]: MOE_INTEGERS["intermediate"]}
    for key in ("hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads", "num_experts_per_tok",
                f["experts"], f["intermediate"], "max_position_embeddings"):
        value = config_experts(config) if key == f["experts"] else config.get(key)
        if key == "max_position_embeddings" and key not in config:
            continue  # transformers' default for the family
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckpointError(f"{path}: {key} is {show(value)}, not a positive integer; fix config.json")
        # Values transformers builds from without a word and fails on later: a million layers
        # (built for minutes), 2**40 experts or hidden units (an allocation of petabytes, exit 70).
        if value > bounds[key]:
            raise CheckpointError(f"{path}: {key} is {value}, more than {bounds[key]}; fix config.json")
    # k above the experts (torch.topk's "selected index k out of range" in the first call), a
    # negative head_dim (a tensor of negative size), kv heads that do not divide the heads.
    if config["num_experts_per_tok"] > config_experts(config):
        raise CheckpointError(f"{path}: num_experts_per_tok {config['num_experts_per_tok']} is more than the "
                              f"{config_experts(config)} experts; fix config.json")
    if config.get("num_key_value_heads") is None and config["model_type"] in KV_HEADS_DEFAULT:
        # transformers builds Mixtral with 8 and Qwen3-MoE with 4 KV heads where the key is left out (and
        # refuses null): the byte arithmetic took the attention heads, so the plan and the allowance check
        # priced another model than the one that loads.
        if "num_key_value_heads" in config:
            raise CheckpointError(f"{path}: num_key_value_heads is None, not a positive integer; give the KV "
                                  f"heads or drop the key (then {KV_HEADS_DEFAULT[config['model_type']]}, "
                                  f"transformers' default); fix config.json")
        config = {**config, "num_key_value_heads": KV_HEADS_DEFAULT[config["model_type"]]}
    for key in ("head_dim", "num_key_value_heads"):
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 16):
            raise CheckpointError(f"{path}: {key} is {show(value)}, not a positive integer; fix config.json")
    if config.get("head_dim") is None:
        # transformers' Qwen3-MoE and OLMoE attention read a head_dim key even when it is null (None ** -0.5:
        # TypeError, exit 70); without one, and Mixtral's null, it is hidden_size // num_attention_heads,
        # which a width that is no multiple of the heads floors (to 0 for more heads than hidden units:
        # ZeroDivisionError) away from the checkpoint's tensors.
        if "head_dim" in config and config["model_type"] not in NULL_HEAD_DIM:
            raise CheckpointError(f"{path}: head_dim is None, not a positive integer; give the attention heads' width "
                                  f"or drop the key (then hidden_size / num_attention_heads); fix config.json")
        if config["hidden_size"] % config["num_attention_heads"]:
            raise CheckpointError(f"{path}: hidden_size {config['hidden_size']} is not a multiple of "
                                  f"num_attention_heads {config['num_attention_heads']}, and no head_dim says the "
                                  f"heads' width; fix config.json")
    if config["num_attention_heads"] % (config.get("num_key_value_heads") or config["num_attention_heads"]):
        raise CheckpointError(f"{path}: num_attention_heads {config['num_attention_heads']} is not a multiple of "
                              f"num_key_value_heads {config['num_key_value_heads']}; fix config.json")
    if config["model_type"] == "qwen3_moe":
        _qwen3_sparse_layers(config, path)
    return config


# The integers an MoE config.json gives the model's shape, each bounded far above any real MoE's
# (DeepSeek-V3: 7,168 hidden, 256 experts; Mixtral-8x22B: 16,384 expert width; Qwen3: 151,936
# tokens, 262,144 positions); OPT's bounds where the two share a key.
MOE_INTEGERS = {**OPT_INTEGERS, "experts": 1 << 16, "intermediate": 1 << 20, "num_experts_per_tok": 1 << 16,
                "max_position_embeddings": 1 << 30}
# transformers' KV heads where config.json leaves the key out (MixtralConfig, Qwen3MoeConfig; OLMoE's is
# the attention heads): tests/cli/test_hostile_checkpoints.py holds them equal to the installed classes'.
KV_HEADS_DEFAULT = {"mixtral": 8, "qwen3_moe": 4}
NULL_HEAD_DIM = ("mixtral",)  # families whose config class reads `head_dim: null` as hidden / heads


def _qwen3_sparse_layers(config: dict, path: Path) -> None:
    """Qwen3-MoE's choice of MoE layers (transformers: layer i has experts iff i is not in
    `mlp_only_layers` and (i + 1) % `decoder_sparse_step` == 0): a step of 0 raised
    ZeroDivisionError in the worker, and a model with no MoE layer at all (every layer listed,
    or a step beyond the depth) failed its screen with a bare StopIteration."""
    step, dense = config.get("decoder_sparse_step", 1), config.get("mlp_only_layers", [])
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise CheckpointError(f"{path}: decoder_sparse_step is {show(step)}, not a positive integer; fix config.json")
    dense = [] if dense is None else dense
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise CheckpointError(f"{path}: mlp_only_layers is {show(dense)}, not a list of layer indices; fix config.json")
    if not any(i not in dense and (i + 1) % step == 0 for i in range(config["num_hidden_layers"])):
        raise CheckpointError(f"{path}: no layer of the {config['num_hidden_layers']} has experts (mlp_only_layers "
                              f"{show(dense)}, decoder_sparse_step {step}): a dense model, with no experts for "
                              f"packbench's MoE loaders to move; give a checkpoint with at least one MoE layer")
    # A layer without experts holds a dense MLP of intermediate_size (core/moe.py shape_of_config
    # counts its bytes): a string there was multiplied into the device part (TypeError, exit 70).
    width = config.get("intermediate_size")
    dense = [i for i in range(config["num_hidden_layers"]) if i in dense or (i + 1) % step]
    if dense and (isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= MOE_INTEGERS["intermediate"]):
        raise CheckpointError(f"{path}: intermediate_size is {show(width)}, not an integer in "
                              f"1..{MOE_INTEGERS['intermediate']} (the width of the dense MLP of layer {dense[0]}, which "
                              f"has no experts); fix config.json")


MAX_CONFIG_BYTES = 1 << 20  # an OPT config.json is ~1 KB
MAX_INDEX_BYTES = 64 << 20  # a sharded checkpoint's index: ~100 bytes a tensor (Mixtral-8x7B: ~100 KB)


def check_weight_files(model_dir: Path, *, moe: bool) -> None:
    """The weight files the checkpoint's reader opens are there, or a one-line CheckpointError
    naming the fix. OPT is read from every *.safetensors file (engine/checkpoint.py); an MoE
    checkpoint by transformers, which also reads pytorch_model.bin. A sharded checkpoint
    (model.safetensors.index.json, pytorch_model.bin.index.json, read when no single file is
    there) must hold every shard its index lists: a missing one surfaced as transformers'
    OSError or FileNotFoundError (exit 70), or for OPT as tensors lacking with no file named."""
    model_dir = Path(model_dir)
    if not (model_dir / "model.safetensors").is_file():
        for name in ("model.safetensors.index.json",) + (("pytorch_model.bin.index.json",) if moe else ()):
            if (model_dir / name).exists():
                shards = _check_shards(model_dir, model_dir / name)
                if moe and name.endswith(".safetensors.index.json"):
                    _check_expert_tensors(model_dir, shards)
                return
    if (model_dir / "model.safetensors").is_file() and moe:
        _check_expert_tensors(model_dir, [model_dir / "model.safetensors"])
    if any(model_dir.glob("*.safetensors")) or (moe and (model_dir / "pytorch_model.bin").is_file()):
        return
    if not moe and any(model_dir.glob("pytorch_model*.bin")):  # an older OPT export
        raise CheckpointError(f"{model_dir} holds pytorch_model.bin, packbench reads OPT from *.safetensors only; "
                              f"convert it: transformers' OPTForCausalLM.from_pretrained(DIR).save_pretrained(DIR) "
                              f"writes model.safetensors")
    what = "*.safetensors or pytorch_model.bin files" if moe else "*.safetensors files"
    raise CheckpointError(f"{model_dir} has no {what}, packbench reads {'those' if moe else 'safetensors only'}; "
                          f"copy the checkpoint's weights there (transformers' save_pretrained writes safetensors)")


def _check_shards(model_dir: Path, index: Path) -> None:
    from packbench.core.files import read_json_object

    try:
        weight_map = read_json_object(index, limit=MAX_INDEX_BYTES).get("weight_map")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{index} cannot be read as a checkpoint index ({one_line(str(e))[:120]}); copy the "
                              f"checkpoint again") from None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise CheckpointError(f"{index} has no weight_map of tensor names to file names; copy the checkpoint again")
    missing = sorted(f for f in set(weight_map.values()) if not (model_dir / f).is_file())
    if missing:
        raise CheckpointError(f"{model_dir} lacks {len(missing)} of the {len(set(weight_map.values()))} shards "
                              f"{index.name} lists (first: {show(missing[0])}); copy the whole checkpoint again")
    return [model_dir / f for f in sorted(set(weight_map.values()))]


# One expert's tensor in the published layout of an MoE checkpoint (Mixtral's
# `model.layers.0.block_sparse_moe.experts.3.w1.weight`, Qwen3-MoE's and OLMoE's
# `model.layers.0.mlp.experts.3.gate_proj.weight`): transformers stacks a layer's experts into one
# fused tensor as it loads.
EXPERT_TENSOR = re.compile(r"(.*\.experts\.)(\d+)(\..+)")


def _check_expert_tensors(model_dir: Path, files: list[Path]) -> None:
    """Every layer's per-expert tensors, read from the safetensors headers alone: each of the
    config.json's experts 0..E-1 holds each of them, all of one shape. transformers' stacking of
    them failed after its load report, with a RuntimeError that names no tensor (exit 70), where
    an expert's tensor lacked, was one too many, or had its own shape."""
    from packbench.core.moe import config_experts

    experts = config_experts(read_config(model_dir))
    groups: dict[tuple[str, str], dict[int, tuple]] = {}  # (before the id, after it) -> {expert id: shape}
    for file in files:
        for name, meta in safetensors_header(file)[1].items():
            m = EXPERT_TENSOR.fullmatch(name)
            if m:
                groups.setdefault((m[1], m[3]), {})[int(m[2])] = tuple(meta["shape"])
    for (before, after), shapes in sorted(groups.items()):
        beyond = sorted(i for i in shapes if i >= experts)
        if beyond:
            raise CheckpointError(f"{model_dir}: the checkpoint holds {before}{beyond[0]}{after}, but config.json gives "
                                  f"{experts} experts (0..{experts - 1}); fix config.json or regenerate the checkpoint")
        lacking = [i for i in range(experts) if i not in shapes]
        if lacking:
            raise CheckpointError(f"{model_dir}: the checkpoint lacks {before}{lacking[0]}{after} ({len(lacking)} of the "
                                  f"{experts} experts config.json gives hold no {after[1:]} there); copy the whole "
                                  f"checkpoint again or fix config.json")
        odd = next((i for i in sorted(shapes) if shapes[i] != shapes[0]), None)
        if odd is not None:
            raise CheckpointError(f"{model_dir}: tensor {before}{odd}{after} has shape {list(shapes[odd])}, expert 0's "
                                  f"{list(shapes[0])}; a layer's experts share one shape: regenerate the checkpoint")


def _finite(config: dict, path: Path) -> None:
    """No NaN or Infinity anywhere in config.json (JSON has neither; Python's reader takes both): an
    rms_norm_eps or rope_theta of NaN ran a whole screen to non-finite logits and failed its
    faithfulness gate at the end. Walked without recursion (config.json may nest as deep as the
    JSON reader allows)."""
    stack = [("", config)]
    while stack:
        key, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            raise CheckpointError(f"{path}: {key} is {value}, not a finite number (JSON has no NaN or Infinity); "
                                  f"fix config.json")
        if isinstance(value, dict):
            stack += [(f"{key}.{k}" if key else k, v) for k, v in reversed(value.items())]
        elif isinstance(value, list):
            stack += [(f"{key}[{i}]", v) for i, v in reversed(list(enumerate(value)))]


def _json(path: Path) -> dict:
    """config.json as a mapping, or a one-line CheckpointError naming the file."""
    from packbench.core.files import NOT_AN_OBJECT, NotReadable, read_json_object
    from packbench.core.moe import FAMILIES

    kinds = f"OPT or MoE ({', '.join(FAMILIES)})"

    try:
        return read_json_object(path, limit=MAX_CONFIG_BYTES)
    except OSError as e:
        raise CheckpointError(f"cannot read {path} ({e.strerror}); check its permissions") from None
    except NotReadable as e:
        raise CheckpointError(f"{path} {e}, not a checkpoint's config.json; point model.path at a Hugging "
                              f"Face {kinds} directory") from None
    except ValueError as e:
        what = NOT_AN_OBJECT if str(e) == NOT_AN_OBJECT else f"is not JSON ({e})"
        raise CheckpointError(f"{path} {what}; the checkpoint's config.json must be the JSON object a "
                              f"Hugging Face {kinds} checkpoint has") from None


# Bytes per element of safetensors' dtypes: an entry whose shape and dtype do not make its byte
# length is refused here (the safetensors reader raised its own SafetensorError, exit 70).
SAFETENSORS_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2,
                        "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


MAX_HEADER_BYTES = 100_000_000  # the safetensors reader's own bound on a header


def not_safetensors(path: Path, why: str) -> CheckpointError:
    return CheckpointError(f"{path} is not a readable safetensors file ({why}); copy or regenerate the "
                           f"checkpoint (`packbench model synth` for a synthetic one)")


def safetensors_header(path: Path) -> tuple[int, dict]:
    """(data start, tensor entries) of a safetensors file; CheckpointError naming the file when it
    is not one (truncated, or another format), before any byte of it is placed."""
    def broken(why: str) -> CheckpointError:
        return not_safetensors(path, why)

    try:
        st = path.stat()
    except OSError as e:  # a dangling link
        raise broken(f"it cannot be read: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):  # a FIFO named *.safetensors: open() would wait for a writer
        raise broken("it is not a regular file")
    size = st.st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise broken(f"{size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise broken(f"the header claims {n} bytes, the file holds {size - 8} after its length")
        if n > MAX_HEADER_BYTES:
            raise broken(f"the header claims {n} bytes, over safetensors' own bound of {MAX_HEADER_BYTES}")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise broken(f"its header is not JSON: {one_line(str(e))[:200]}") from None
    if not isinstance(header, dict):
        raise broken("its header is not a JSON object")
    header.pop("__metadata__", None)
    for key, meta in header.items():
        offsets = meta.get("data_offsets") if isinstance(meta, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
                and 0 <= offsets[0] <= offsets[1] and "dtype" in meta and "shape" in meta):
            raise broken(f"tensor {show(key)} has no valid dtype, shape and data_offsets")
        if offsets[1] > size - 8 - n:
            raise broken(f"tensor {show(key)} ends {offsets[1] - (size - 8 - n)} bytes past the end of the file: truncated")
        shape, kind = meta["shape"], meta["dtype"]
        if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                for d in shape) and isinstance(kind, str)):
            raise broken(f"tensor {show(key)} has shape {show(shape)} and dtype {show(kind)}; a shape lists sizes >= 0")
        if kind in SAFETENSORS_ITEMSIZE and math.prod(shape) * SAFETENSORS_ITEMSIZE[kind] != offsets[1] - offsets[0]:
            raise broken(f"tensor {show(key)} of shape {show(shape)} and dtype {kind} is not the "
                         f"{offsets[1] - offsets[0]} bytes its data_offsets span")
    return 8 + n, header
