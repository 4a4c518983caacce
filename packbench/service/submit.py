"""Submitting: freeze a protocol, check its model and prompts, store it and queue a screen.

No torch and no Ray here: `packbench submit` starts in well under a second (docs/architecture.md).
"""

from __future__ import annotations

import getpass
from collections.abc import Mapping
from pathlib import Path

from packbench.core.errors import PackbenchError, ProtocolError
from packbench.core.plan import prompts
from packbench.core.protocol import FrozenProtocol, Protocol, load

# Screens one submit may queue: they go in one transaction (all or none), and a typo such as
# `--replicas 100000000` must not queue work for months (unbounded, one queued 47,473 screens in 60 s).
MAX_REPLICAS = 1000


def vocab_size(frozen: FrozenProtocol) -> int:
    """The model's vocabulary, read from config.json (or the synthetic shape) without torch."""
    model_dir = frozen.model_dir()
    if model_dir is None:
        from packbench.core.moe import MOE_SHAPES
        from packbench.core.registry import SHAPES

        shape = frozen.protocol.model.synth.shape
        return (MOE_SHAPES if frozen.protocol.model.synth.is_moe else SHAPES)[shape]["vocab"]
    from packbench.engine.config import read_config

    return read_config(model_dir)["vocab_size"]


def screen_prompts(protocol: Protocol, *, vocab: int, model_dir: Path | None,
                   prompt_file: Path | None) -> list[list[int]]:
    """The screen's prompt token ids; text prompts go through the checkpoint's own tokenizer."""
    tokenize = None
    if protocol.prompts.source == "text_file":
        from packbench.engine.prompts import tokenizer_for  # transformers: only text prompts pay for it

        tokenize = tokenizer_for(Path(model_dir))
    return prompts(protocol, vocab=vocab, prompt_file=prompt_file, tokenize=tokenize)


def check_flexgen(i: int, c, p: Protocol, config: dict) -> None:
    """A flexgen condition FlexGen cannot run is refused before anything is queued, in one line: a
    dtype other than float16, an MLP other than 4 x hidden, a placement the allowance cannot hold
    even before the CUDA context (core/conditions/flexgen.py choose_policy, which the worker runs
    again with the context it measures)."""
    from packbench.core.conditions.flexgen import PolicyRefused, check_shape, choose_policy

    if p.dtype != "float16":
        raise ProtocolError(f"protocol field `dtype`: condition {c.name} (flexgen) runs in float16 only "
                            f"(FlexGen's OptConfig.dtype), the protocol says {p.dtype}: use dtype float16")
    bad = check_shape(config)
    if bad:
        raise ProtocolError(f"protocol field `conditions[{i}].policy`: {bad}")
    try:
        choose_policy(config, c.resolved_params, allowance=p.allowance_bytes, context=0, held=0, batch=p.batch,
                      prompt=p.prefix_tokens + p.continuation_tokens, gen=0, cuda=True)
    except PolicyRefused as e:
        field = f"conditions[{i}].params.w_gpu_percent" if c.resolved_params.get("w_gpu_percent") is not None \
            else "allowance_mib"
        raise ProtocolError(f"protocol field `{field}`: {e}") from None


def check_libraries(protocol: Protocol) -> None:
    """A competitor whose library is not installed here is refused before anything is queued
    (found without importing it): one line naming the condition and the extra that brings it."""
    from packbench.core.registry import COMPETITOR_PARAMS, competitor_library, library_fix, missing_library

    for i, c in enumerate(protocol.conditions):
        if c.policy in COMPETITOR_PARAMS:
            # a quantized method, or the library the kind runs on (accelerate, deepspeed)
            what = c.params["method"] if "method" in c.params else competitor_library(c.policy, c.params)
            missing = missing_library(what)
            if missing is not None:
                field = "params.method" if "method" in c.params else "policy"
                raise ProtocolError(f"protocol field `conditions[{i}].{field}`: {what} "
                                    f"(condition {c.name}) requires {missing}, which is not installed: {library_fix(c.policy)}")


def submit(store, path: Path, *, priority: int = 0, max_attempts: int = 3, gpu_type: str | None = None,
           replicas: int = 1, spread: bool = False, name: str | None = None, note: str | None = None,
           tags: Mapping[str, str] | None = None) -> list[int]:
    """Validate and freeze `path`, store the protocol (idempotent) and queue its screen(s)
    (`submit_frozen`)."""
    return submit_frozen(store, load(path), priority=priority, max_attempts=max_attempts, gpu_type=gpu_type,
                         replicas=replicas, spread=spread, name=name, note=note, tags=tags)


def submit_frozen(store, frozen: FrozenProtocol, *, priority: int = 0, max_attempts: int = 3,
                  gpu_type: str | None = None, replicas: int = 1, spread: bool = False, name: str | None = None,
                  note: str | None = None, tags: Mapping[str, str] | None = None) -> list[int]:
    """Store a frozen protocol (idempotent) and queue its screen(s), labelled with `name`,
    `note` and `tags` (db/labels.py) when given.

    Everything that can be checked before a worker is asked for is checked here: the model
    directory exists and is an OPT checkpoint (a synthetic model is generated on the worker),
    the prompt file matches its frozen hash, prompt ids lie inside the vocabulary. Placement
    comes from the protocol's `placement`, `gpu_type` overriding its accelerator_type;
    `spread` puts the `replicas` on distinct nodes. Returns the screen ids.
    """
    check_replicas(replicas)
    check_queue_options(priority=priority, max_attempts=max_attempts, gpu_type=gpu_type)
    store.check_labels(name=name, note=note, tags=tags or {})  # a bad tag queues nothing
    check_frozen(frozen)
    protocol_id = store.put_protocol(sha256=frozen.sha256, name=frozen.name, canonical_json=frozen.canonical.decode())
    screen = screen_columns(frozen, priority=priority, max_attempts=max_attempts, gpu_type=gpu_type)
    # One transaction, labels included: an interrupted submit queues none of its screens.
    return store.create_screens(replicas, spread=spread, name=name, note=note, tags=tags, protocol_id=protocol_id,
                                **screen)


def screen_columns(frozen: FrozenProtocol, *, priority: int, max_attempts: int, gpu_type: str | None) -> dict:
    """A queued screen's columns for `frozen` (all but its protocol id): where its model and
    prompt file are, who queued it, its queue options and its placement."""
    protocol = frozen.protocol
    model_dir = frozen.model_dir()
    prompt_file = frozen.prompt_file()
    return dict(submitter=submitter(), model_dir=None if model_dir is None else str(model_dir),
                prompt_file=None if prompt_file is None else str(prompt_file),
                priority=priority, max_attempts=max_attempts,
                gpu_type=gpu_type or protocol.placement.accelerator_type,
                placement_node=protocol.placement.node, exclusive_node=protocol.placement.exclusive_node,
                resources=protocol.placement.resources_dict or None)


DB_INT = 2**31 - 1  # priority and max_attempts are `integer` columns: 32-bit on PostgreSQL
MAX_GPU_TYPE = 100  # a Ray accelerator type (H200, A100-80G): short, one line


def check_queue_options(*, priority: int, max_attempts: int, gpu_type: str | None) -> None:
    """Refuse what the screens table cannot hold, before anything is stored (the command line
    bounds these itself; the API, packbench.connect().submit, comes through here)."""
    if type(priority) is not int or not -DB_INT - 1 <= priority <= DB_INT:
        raise PackbenchError(f"--priority {str(priority)[:30]}: give an integer from {-DB_INT - 1} to {DB_INT}")
    if type(max_attempts) is not int or not 1 <= max_attempts <= DB_INT:
        raise PackbenchError(f"--max-attempts {str(max_attempts)[:30]}: give an integer from 1 to {DB_INT}")
    if gpu_type is not None and not (isinstance(gpu_type, str) and 0 < len(gpu_type) <= MAX_GPU_TYPE
                                     and gpu_type.isprintable() and gpu_type.strip()):
        raise PackbenchError(f"--gpu-type {str(gpu_type)[:40]!r}: give a GPU type of 1-{MAX_GPU_TYPE} printable "
                             f"characters, e.g. H200 (Ray's accelerator_type)")


def check_replicas(replicas: int) -> None:
    """Refuse a replica count outside 1..MAX_REPLICAS before anything is stored."""
    if type(replicas) is not int or not 1 <= replicas <= MAX_REPLICAS:
        raise PackbenchError(f"--replicas {replicas}: give 1 to {MAX_REPLICAS} screens per submit (for more, "
                             f"submit again: each submit queues its screens all at once or not at all)")


def check_frozen(frozen: FrozenProtocol) -> None:
    """Everything about a frozen protocol that can be checked before a worker is asked for: its
    competitors' libraries, its model's config, its prompts against the vocabulary."""
    protocol = frozen.protocol
    check_libraries(protocol)
    vocab = vocab_size(frozen)  # a broken config.json is the checkpoint's error (CheckpointError), not the prompts'
    check_positions(frozen)
    check_family(frozen)
    check_weights(frozen)
    try:
        screen_prompts(protocol, vocab=vocab, model_dir=frozen.model_dir(), prompt_file=frozen.prompt_file())
    except ValueError as e:
        raise ProtocolError(f"protocol field `prompts`: {e}") from None


def check_positions(frozen: FrozenProtocol) -> None:
    """A model.path checkpoint's positions (config.json's max_position_embeddings) hold an
    episode's prompt and continuation; a synthetic shape's are checked by validation."""
    model_dir = frozen.model_dir()
    if model_dir is None:
        return
    from packbench.core.protocol.schema import positions_refusal
    from packbench.engine.config import read_config

    positions = read_config(model_dir).get("max_position_embeddings")
    if isinstance(positions, int) and not isinstance(positions, bool):
        p = frozen.protocol
        refusal = positions_refusal(p.prefix_tokens, p.continuation_tokens, positions=positions,
                                    model=f"checkpoint {model_dir} (config.json max_position_embeddings)")
        if refusal:
            raise ProtocolError(f"protocol field `prefix_tokens`: {refusal}")


def unjudged_warning(frozen: FrozenProtocol) -> str | None:
    """One line naming the approximate conditions no fidelity gate judges (their fidelity figures
    are recorded, but the verdicts say nothing of them); None when every one is judged."""
    p = frozen.protocol
    judged = {f.condition for f in p.gates.fidelity}
    names = [c.name for c in p.conditions if c.tier == "approximate" and c.name not in judged]
    if not names:
        return None
    return (f"{', '.join(names)} {'is' if len(names) == 1 else 'are'} approximate and no fidelity gate judges "
            f"{'it' if len(names) == 1 else 'them'}: the fidelity figures are recorded, but no verdict says "
            f"whether they are good enough; add gates.fidelity (docs/protocol.md) to judge {'it' if len(names) == 1 else 'them'}")


def warnings_of(frozen: FrozenProtocol) -> list[str]:
    """What `submit` says on stderr about a valid protocol: an archive over the audit's bound,
    approximate conditions no gate judges, packbench's loaders and the batch's KV cache leaving no
    room for a CUDA context."""
    return [w for w in (archive_warning_of(frozen), unjudged_warning(frozen), loader_device_warning_of(frozen))
            if w is not None]


def loader_device_warning_of(frozen: FrozenProtocol) -> str | None:
    """One line when packbench's OPT loaders and the KV cache at the batch leave less of the allowance
    than a CUDA context takes (core/estimate.py loader_device), as `protocol plan` warns; None
    otherwise, for an MoE model, or where config.json cannot say the shape (the worker then
    refuses the checkpoint in its own words)."""
    from packbench.core.estimate import ModelShape, loader_device, loader_device_warning

    synth = frozen.protocol.model.synth
    try:
        if synth is not None:
            if synth.is_moe:
                return None
            shape = ModelShape.of(synth.shape)
        else:
            from packbench.engine.config import read_config

            c = read_config(frozen.model_dir())
            if c.get("model_type", "opt") != "opt":
                return None
            shape = ModelShape(hidden=c["hidden_size"], ffn=c["ffn_dim"], layers=c["num_hidden_layers"],
                               vocab=c.get("vocab_size", 50272), max_positions=c.get("max_position_embeddings", 2048))
        return loader_device_warning(loader_device(frozen.protocol, shape=shape), batch=frozen.protocol.batch)
    except (PackbenchError, OSError, ValueError, KeyError, TypeError, AttributeError, OverflowError):
        return None


def archive_warning_of(frozen: FrozenProtocol) -> str | None:
    """One line when the screen's archive, estimated from its plan (core/estimate.py
    archive_bytes), will be over the audit's bound; None within it. The vocabulary is the
    synthetic shape's or the checkpoint's config.json's (OPT's 50272 when it names none)."""
    from packbench.core.estimate import archive_bytes, archive_warning

    if frozen.protocol.model.synth is not None:  # a synthetic OPT or MoE shape's own vocabulary
        vocab = vocab_size(frozen)
    else:
        from packbench.engine.config import read_config

        vocab = read_config(frozen.model_dir()).get("vocab_size", 50272)
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        return None  # a config.json without a usable vocabulary: the worker refuses it with its own words
    return archive_warning(archive_bytes(frozen.protocol, vocab=vocab))


def check_family(frozen: FrozenProtocol) -> None:
    """A model.path MoE checkpoint runs only the kinds that fit an MoE model, within an allowance that
    holds its device part and one layer's routed experts (core/moe.py moe_refusal); an OPT checkpoint
    refuses a kind for MoE models alone (family_refusal). The offloading peers' refusals
    (check_offload) hold for a synthetic OPT shape too, whose config is its preset's."""
    model_dir = frozen.model_dir()
    p = frozen.protocol
    if model_dir is None:
        if not p.model.synth.is_moe:  # the schema checked its family and gathers; the peers need its shape
            from packbench.core.registry import shape_config

            check_offload(p, shape_config(p.model.synth.shape))
        else:
            from packbench.core.moe import moe_config

            check_llama_cpp(p, moe_config(p.model.synth.shape, layers=p.model.synth.layers, dtype=p.dtype))
        return
    from packbench.core.moe import FAMILIES, family_refusal, moe_refusal
    from packbench.engine.config import read_config

    config = read_config(model_dir)
    if config.get("model_type") not in FAMILIES:
        refusal = family_refusal([(c.name, c.policy, dict(c.resolved_params)) for c in p.conditions], family="opt",
                                 model=f"checkpoint {model_dir}")
        if refusal:
            raise ProtocolError(f"protocol field `{refusal[0]}`: {refusal[1]}")
        if "hidden_size" in config:
            check_offload(p, config)
        for i, c in enumerate(p.conditions):
            if c.resolved_params.get("gather") == "mapped":
                raise ProtocolError(f"protocol field `conditions[{i}].params.gather`: mapped gathers an MoE model's "
                                    f"experts; checkpoint {model_dir} is OPT, whose device gather already reads mapped "
                                    f"host memory: use gather device")
        return
    refusal = moe_refusal(config, dtype=p.dtype, allowance_bytes=p.allowance_bytes, model=f"checkpoint {model_dir}",
                          conditions=[(c.name, c.policy, dict(c.resolved_params)) for c in p.conditions])
    if refusal:
        raise ProtocolError(f"protocol field `{refusal[0]}`: {refusal[1]}")
    check_llama_cpp(p, config)


def check_llama_cpp(p: Protocol, config: dict) -> None:
    """A llama-cpp condition whose placement the allowance cannot hold even before the CUDA context
    (core/conditions/llama_cpp.py choose_placement, which the worker runs again with the context it
    measures), or whose n_cpu_moe is more than the model's layers, is refused in one line."""
    from packbench.core.conditions.llama_cpp import PlacementRefused, choose_placement

    for i, c in enumerate(p.conditions):
        if c.policy != "llama-cpp":
            continue
        try:
            choose_placement(config, c.resolved_params, dtype=p.dtype, allowance=p.allowance_bytes, context=0,
                             batch=p.batch, capacity=p.prefix_tokens + p.continuation_tokens)
        except PlacementRefused as e:
            field = f"conditions[{i}].params.n_cpu_moe" if c.resolved_params.get("n_cpu_moe") is not None \
                else "allowance_mib"
            raise ProtocolError(f"protocol field `{field}`: {e}") from None


def check_weights(frozen: FrozenProtocol) -> None:
    """A model.path checkpoint holds the weight files its worker opens (engine/config.py
    check_weight_files): refused here, before a screen is queued to fail on them. (`protocol
    validate` checks a protocol against config.json alone, so it does not call this.)"""
    model_dir = frozen.model_dir()
    if model_dir is None:
        return
    from packbench.core.moe import FAMILIES
    from packbench.engine.config import check_weight_files, read_config

    check_weight_files(model_dir, moe=read_config(model_dir).get("model_type") in FAMILIES)


def check_offload(p: Protocol, config: dict) -> None:
    """The offloading peers' refusals on an OPT `config` (config.json's fields): a zero-inference
    allowance below DeepSpeed's minimum, what FlexGen cannot run (check_flexgen)."""
    from packbench.core.conditions.zero_inference import allowance_refusal

    for i, c in enumerate(p.conditions):
        if c.policy == "zero-inference":
            refusal = allowance_refusal(config, dtype=p.dtype, capacity=p.prefix_tokens + p.continuation_tokens,
                                        batch=p.batch, allowance_bytes=p.allowance_bytes)
            if refusal:
                raise ProtocolError(f"protocol field `allowance_mib`: {refusal}")
        if c.policy == "flexgen":
            check_flexgen(i, c, p, config)


def submitter() -> str:
    """Who queued the screen, as the operating system names them."""
    try:
        return getpass.getuser()
    except Exception:  # no user name in some containers
        return "unknown"
