"""A target and its draft loaded into a ready Engine: the one way the CLI, the app and the server
load models. Loads the target (leaving room on the GPU for a named draft), then the draft the
spec names or, for "auto", the one engine.decoding.draft_choice picks; checks that a draft model
shares the target's tokenizer, and gives the Engine the files its KV caches are saved to. The
choice, with its reason, is recorded on the engine as `engine.draft_choice` (a DraftChoice).

Draft specs (`parse_draft_spec`): None or "none" = draft-free; "auto" = the engine picks; "mtp" =
the MTP / NextN layers the target's checkpoint carries (engine.model.heads); "self"
or "self:BITS" (BITS 2, 3, 4) = a self-draft of the target (engine.loading.self_draft; "self"
sizes the bits to the memory left); a folder holding a Gemma 4 assistant (model_type
gemma4_assistant) = that assistant drafting for its Gemma 4 target (engine.model.assistant); a
folder holding an EAGLE-3 head = that head (engine.model.eagle); anything else = a draft model (catalog id, folder, .gguf).

What this module does not do: decode (generation.py), read weight files (engine.loading) or
price drafts (draft_choice.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from engine import paths
from engine.decoding.draft_choice import (
    NONE_LABEL,
    CatalogOption,
    DraftChoice,
    DraftOptions,
    HeadOption,
    SelfOption,
    choose_draft,
    manual_choice,
)
from engine.decoding.generation import Engine
from engine.decoding.draft_rates import measured_curves, rates_for
from engine.decoding.learned import learned_file
from engine.errors import Cancelled, EngineError, InvalidRequest, UnsupportedModel, UsageError
from engine.loading.load import LoadedModel, check_pair, load_model, resolve_device, resolve_path
from engine.loading.layer_plan import STREAM_FROM_TOKENS, MaterialiseSettings, cache_experts, stream_experts
from engine.loading.materialise import resident_bytes
from engine.loading import self_draft
from engine.model import heads as head_drafts
from engine.model.assistant import load_assistant
from engine.model.assistant_spec import is_assistant_folder
from engine.model.eagle import load_eagle
from engine.model.eagle_spec import is_eagle_folder
from engine.model.cache_files import CacheFiles, install_key
from engine.model.causal_lm import CausalLM
from engine.model.head_draft import HeadDraft
from engine.types import CacheSettings, LoadProgress, LoadSettings, LoadStage
from engine.units import GIB

log = logging.getLogger(__name__)

SpecKind = Literal["auto", "none", "mtp", "self", "model"]
SELF_BITS_ALLOWED = (2, 3, 4)


def parse_draft_spec(spec: str | Path | None) -> tuple[SpecKind, int | None, str | None]:
    """A draft spec -> (kind, bits of a self-draft or None, the model spec of a draft model or
    None). InvalidRequest for "self:" with other bits."""
    if spec is None or str(spec) in ("", "none"):
        return "none", None, None
    text = str(spec)
    if text == "auto":
        return "auto", None, None
    if text == "self":
        return "self", None, None
    if text == "mtp":
        return "mtp", None, None
    if text.startswith("self:"):
        bits = text[5:]
        if bits not in tuple(map(str, SELF_BITS_ALLOWED)):
            raise InvalidRequest(f"'{text}': a self-draft takes 2, 3 or 4 bits (self:2, self:3, self:4), "
                                 "or 'self' to size them to the memory left.")
        return "self", int(bits), None
    return "model", None, text


def load_engine(
    target: str | Path,
    draft: str | Path | None = None,
    settings: LoadSettings = LoadSettings(),
    progress: Callable[[LoadProgress], None] | None = None,
    cancel: threading.Event | None = None,
) -> Engine:
    """Load a target and the draft `draft` names (module docstring) and return a ready Engine:
    the one entry point the CLI and the app share. `progress` is called from the calling
    thread; `cancel` is checked between loading steps and raises Cancelled."""

    def report(stage: LoadStage, fraction: float, message: str) -> None:
        if cancel is not None and cancel.is_set():
            raise Cancelled("Loading was cancelled.")
        if progress is not None:
            progress(LoadProgress(stage, fraction, message))

    kind, bits, model_spec = parse_draft_spec(draft)
    device, dtype = resolve_device(settings.device)
    report("target", 0.0, f"loading {target} on {device}")
    # a named draft model is loaded after the target, fully on the GPU: the target's placement leaves room
    if model_spec is not None and not Path(model_spec).expanduser().exists():  # a catalog id: a head's is a folder
        try:
            model_spec = str(resolve_path(model_spec))
        except EngineError:
            pass  # not downloaded: load_model below says so, for a draft model and a head alike
    assistant = model_spec is not None and is_assistant_folder(Path(model_spec))
    eagle = model_spec is not None and is_eagle_folder(Path(model_spec))
    if assistant or eagle:  # its weights as stored (it runs in the target's dtype, usually the same)
        reserve = sum(f.stat().st_size for f in Path(str(model_spec)).glob("*.safetensors")) if device == "cuda" else 0
    else:
        reserve = resident_bytes(resolve_path(model_spec), dtype) if model_spec is not None and device == "cuda" else 0
    loaded_target = load_model(
        target, device=device, dtype=dtype, quant=settings.quant, offload=settings.offload,
        ram_limit_bytes=settings.ram_limit_bytes, context_length=settings.context_length, experts=settings.experts,
        reserve_bytes=reserve, report=lambda f, m: report("target", 0.8 * f, m))
    tmodel = loaded_target.model
    choice: DraftChoice
    if kind == "auto":
        options, loaders = draft_options(loaded_target, target, settings)
        choice = choose_draft(options, _profile())
        log.info("draft: %s (%s)", choice.label, choice.reason)
        draft_model, choice = _load_chosen(choice, loaders, report)
    elif kind == "self":
        draft_model = _self_draft(tmodel, bits, settings, report, loaded_target.tokenizer)
        info = getattr(draft_model, "self_draft", None)
        label = info.label if info is not None else f"self-draft, {bits}-bit"
        choice = manual_choice("self", label, "chosen by hand (--draft self)", getattr(info, "bits", bits))
    elif kind == "mtp":
        spec = checkpoint_head(loaded_target.path, tmodel.config)
        report("draft", 0.8, f"loading the draft head {spec.label}")
        draft_model = head_drafts.load_head(loaded_target.path, tmodel, spec)
        choice = manual_choice("mtp", spec.label, "chosen by hand (--draft mtp)")
    elif kind == "model" and (eagle or assistant):  # a head in a folder of its own
        assert model_spec is not None
        what = "an EAGLE-3 head" if eagle else "an assistant folder"
        report("draft", 0.8, f"loading {what} {model_spec}")
        head: HeadDraft = (load_eagle if eagle else load_assistant)(Path(model_spec), tmodel)
        draft_model = head
        choice = manual_choice("assistant", head.label, f"chosen by hand (--draft to {what})")
    elif kind == "model":
        assert model_spec is not None
        report("draft", 0.8, f"loading draft {model_spec}")
        loaded_draft = load_model(model_spec, device=device, dtype=dtype)
        check_pair(loaded_target, loaded_draft)
        draft_model = loaded_draft.model
        choice = manual_choice("catalog", Path(model_spec).name, "chosen by hand (a draft model)")
    else:
        draft_model = None
        choice = manual_choice("none", NONE_LABEL, "chosen by hand: draft-free")
    if tmodel.placement is not None and tmodel.placement.resident_form == "experts-cpu":
        placed = MaterialiseSettings(device=device, dtype=dtype, context_length=settings.context_length,
                                     expert_cache=settings.expert_cache)
        if settings.experts == "stream":  # every pass's experts copied to the GPU (a benchmark's point): no cache
            stream_experts(tmodel, placed, 1)
        else:
            report("draft", 0.95, "caching the most used experts in the GPU memory left")
            cache_experts(tmodel, placed)
        if settings.experts == "auto":  # "cpu" keeps every expert on the CPU (a benchmark's point)
            stream_experts(tmodel, placed, stream_from(tmodel))
    report("ready", 1.0, "ready")
    engine = Engine(tmodel, loaded_target.tokenizer, draft_model, settings.cache,
                    cache_files(settings.cache, tmodel, draft_model), learned=learned_file(tmodel, draft_model),
                    rates=rates_for(tmodel, choice.kind) if draft_model is not None else None)
    engine.draft_choice = choice  # type: ignore[attr-defined]  # read by the CLI, the app and the server
    return engine


def draft_choice_of(engine: Any) -> DraftChoice | None:
    """The DraftChoice load_engine recorded on `engine` (None for an engine built otherwise)."""
    choice = getattr(engine, "draft_choice", None)
    return choice if isinstance(choice, DraftChoice) else None


# ---- "auto": what could draft for a loaded target ---------------------------------------------
Loader = Callable[[Callable[[LoadStage, float, str], None]], CausalLM]


def draft_options(loaded: LoadedModel, target_spec: str | Path,
                  settings: LoadSettings) -> tuple[DraftOptions, dict[str, Loader]]:
    """The candidates for a loaded target (plain data for draft_choice) and, by kind, how to
    load each one that can run."""
    target = loaded.model
    loaders: dict[str, Loader] = {}
    heads: list[HeadOption] = []
    for spec in find_heads(loaded.path, target.config):
        kind: Literal["mtp", "assistant"] = "mtp" if str(getattr(spec, "kind", "mtp")) in ("mtp", "nextn") \
            else "assistant"
        head = HeadOption(kind, str(getattr(spec, "label", "") or f"{kind} head"), int(getattr(spec, "layers", 1) or 1),
                          str(getattr(spec, "problem", "") or ""))
        if head.kind in loaders or any(h.kind == head.kind and not h.refusal for h in heads):
            continue  # the first loadable one of each kind
        heads.append(head)
        if not head.refusal:
            loaders[head.kind] = _head_loader(loaded.path, target, spec)
    self_option = _self_option(target, settings)
    if self_option is not None and self_option.bits is not None and not self_option.refusal:
        bits = self_option.bits

        def load_self(r: Callable[[LoadStage, float, str], None]) -> CausalLM:
            return _self_draft(target, bits, settings, r, loaded.tokenizer)
        loaders["self"] = load_self
    catalog, catalog_path = _catalog_draft(target_spec, loaded.path)
    if catalog is not None and catalog_path is not None:
        if target.device.type == "cuda" and resident_bytes(catalog_path, target.dtype) > target.free_memory():
            catalog = None  # it would not fit beside the target's resident layers
        else:
            def load_catalog_draft(r: Callable[[LoadStage, float, str], None], p: Path = catalog_path) -> CausalLM:
                r("draft", 0.8, f"loading draft {p.name}")
                loaded_draft = load_model(p, device=target.device.type, dtype=target.dtype)
                check_pair(loaded, loaded_draft)
                return loaded_draft.model
            loaders["catalog"] = load_catalog_draft
    return DraftOptions(target.shape, target.placement, tuple(heads), self_option, catalog, _measured(target)), loaders


def _load_chosen(choice: DraftChoice, loaders: dict[str, Loader],
                 report: Callable[[LoadStage, float, str], None]) -> tuple[CausalLM | None, DraftChoice]:
    """Load the chosen draft; one that fails to load leaves the engine draft-free, saying why."""
    if choice.kind == "none":
        return None, choice
    try:
        model = loaders[choice.kind](report)
    except (EngineError, ImportError, OSError, RuntimeError) as exc:
        why = getattr(exc, "user_message", None) or str(exc) or type(exc).__name__
        log.warning("the chosen draft (%s) did not load: %s", choice.label, why)
        return None, replace(choice, kind="none", label=NONE_LABEL, tokens_per_second=None,
                             reason=f"{choice.label} was chosen but did not load ({why}): draft-free")
    info = getattr(model, "self_draft", None)
    if info is not None:
        choice = replace(choice, label=info.label, bits=info.bits)
    return model, choice


def _self_option(target: CausalLM, settings: LoadSettings) -> SelfOption | None:
    """The self-draft that fits beside the loaded target, or why none can be built."""
    offloaded = len(self_draft.offloaded_layers(target))
    resident = target.placement.num_layers - offloaded
    if not offloaded:
        return SelfOption(None, 0, resident)  # draft_choice says why (nothing offloaded)
    if target.device.type != "cuda":
        return SelfOption(None, offloaded, resident)  # draft_choice says why (a CPU)
    return SelfOption(self_draft.fitting_bits(target, _free_for_draft(target, settings)), offloaded, resident)


def _free_for_draft(target: CausalLM, settings: LoadSettings) -> int:
    """Device memory a draft may take: what is free less the caches of the planned context and
    a tree pass (a GiB for the activations)."""
    context = settings.context_length or 4096
    kv = target.shape.kv_bytes(context, 512, target.dtype.itemsize)
    return max(0, target.free_memory() - kv - GIB)


def _self_draft(target: CausalLM, bits: int | None, settings: LoadSettings,
                report: Callable[[LoadStage, float, str], None], tokenizer: Any = None) -> CausalLM:
    """The self-draft, its weights scaled by their inputs on a built-in text through `tokenizer`."""
    if bits is None:
        bits = self_draft.fitting_bits(target, _free_for_draft(target, settings))
        if bits is None:
            raise UsageError("A self-draft does not fit in the memory the target leaves, even at 2 bits: pass "
                             "--draft none, or keep fewer target layers resident (--offload all).")
    report("draft", 0.8, f"building the {bits}-bit self-draft")
    return self_draft.build_self_draft(target, bits, paths.cache_dir() / "self-draft",
                                       lambda f, m: report("draft", 0.8 + 0.2 * f, m), tokenizer=tokenizer)


def find_heads(folder: Path, config: Any) -> list[Any]:
    """Heads the checkpoint carries or ships beside it (engine.model.heads.find_heads)."""
    try:
        return list(head_drafts.find_heads(folder, config))
    except (EngineError, OSError, ValueError) as exc:
        log.warning("looking for draft heads in %s failed: %s", folder, exc)
        return []


def checkpoint_head(folder: Path, config: Any) -> Any:
    """The MTP / NextN head stored in the target's checkpoint (engine.model.heads.HeadSpec).
    UsageError when it carries none; UnsupportedModel when it does and the head cannot run."""
    found = [s for s in find_heads(folder, config) if str(getattr(s, "kind", "")) == "mtp"]
    if not found:
        raise UsageError(f"'{folder.name}' carries no MTP or NextN draft layers (only some Qwen3.5/3.6, GLM-4.5 and "
                         "DeepSeek-V3 checkpoints do, and a GGUF file never keeps them): choose another draft "
                         "(--draft auto lets the engine pick).")
    if found[0].problem:
        raise UnsupportedModel(f"The model's draft head cannot be used: {found[0].problem}. Choose another draft "
                               "(--draft auto lets the engine pick).")
    return found[0]


def _head_loader(folder: Path, target: CausalLM, spec: Any) -> Loader:
    def load(report: Callable[[LoadStage, float, str], None]) -> CausalLM:
        report("draft", 0.8, f"loading the draft head {getattr(spec, 'label', '')}".rstrip())
        model: CausalLM = head_drafts.load_head(folder, target, spec)
        return model
    return load


def _catalog_draft(target_spec: str | Path, path: Path) -> tuple[CatalogOption | None, Path | None]:
    """The catalog's draft for this target, when the target is a catalog model and its draft is
    present locally: (its shape for the planner, its path)."""
    try:
        from engine.store import resolve_model, usable_catalog  # noqa: PLC0415

        catalog = usable_catalog()
        entry = catalog.find(str(target_spec)) or next(
            (m for m in catalog.models if path.name in (m.id, m.repo_id.split("/")[-1], m.gguf_file)), None)
        if entry is None:
            return None, None
        pair = catalog.draft_pair(entry.id)  # a draft model's pair, never a head's (loaded as a head, beside)
        draft = catalog.find(pair.draft) if pair is not None else None
        local = resolve_model(draft.id) if draft is not None else None
    except (EngineError, OSError) as exc:
        log.info("no catalog draft: %s", exc)
        return None, None
    if draft is None or local is None:
        return None, None
    return CatalogOption(draft.id, draft.shape()), local


def stream_from(target: CausalLM) -> int | None:
    """From how many tokens a pass streams an MoE's experts to the GPU: the planner's price on the
    saved hardware profile (None: never pays), layer_plan.STREAM_FROM_TOKENS without one."""
    profile = _profile()
    if profile is None or profile.gpu is None:
        return STREAM_FROM_TOKENS
    from engine.planning import planner  # noqa: PLC0415

    return planner.stream_pays_from(profile, target.shape)


def _profile() -> Any:
    from engine.planning.profile import load_profile  # noqa: PLC0415

    try:
        return load_profile()
    except Exception:  # noqa: BLE001 -- a plan is an optimisation; without one the fallback rules run
        log.warning("reading the hardware profile failed", exc_info=True)
        return None


def _measured(target: CausalLM) -> dict[str, Any]:
    """Measured acceptance by kind: what each kind's trees did with this target in earlier
    answers (draft_rates.py), else for the catalog draft the wizard's saved calibration, which
    measures the catalog pair the user chose."""
    from engine.planning.calibration import saved_curve  # noqa: PLC0415

    curve = saved_curve()
    wizard = {"catalog": curve} if curve.measured else {}
    return {**wizard, **measured_curves(target)}


def cache_files(settings: CacheSettings, target: CausalLM, draft: CausalLM | None) -> CacheFiles | None:
    """Where this pair's KV caches are saved (None when saving is off or a model has no
    fingerprint)."""
    if settings.disk_budget_bytes <= 0 or not target.fingerprint or (draft is not None and not draft.fingerprint):
        return None
    pair = f"{target.fingerprint}+{draft.fingerprint if draft is not None else 'none'}"
    root = Path(settings.disk_dir) if settings.disk_dir else paths.cache_dir() / "kv"
    return CacheFiles(root, pair, install_key(paths.data_dir() / "kv-cache.key"), settings.disk_budget_bytes)
