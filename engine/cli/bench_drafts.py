"""`specchat bench drafts`: the planner's projection of which draft would run for a catalog
target on a profile (a saved one or a reference GPU from datasheet figures), every candidate
with its predicted tok/s and reason (engine.decoding.draft_choice), and the self-draft at each
bit width as a what-if beside it: priced as if its substitutes fit, with the de-quantisation
the engine pays today and with a fused low-bit kernel. Projections, printed as such: nothing
is measured here.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from typing import Any

from engine.decoding.draft_choice import (
    SELF_BITS,
    CatalogOption,
    DraftOptions,
    HeadOption,
    choose_draft,
    device_left,
    prior_curve,
    project_self_placements,
    projected_self_option,
    self_label,
    self_pass,
    substitute_bytes_estimate,
)
from engine.errors import InvalidRequest
from engine.planning import planner
from engine.planning.reference import REFERENCE_GPUS, reference_profile
from engine.planning.profile import HardwareProfile
from engine.shapes import ModelShape, Placement
from engine.store.catalog import load_catalog
from engine.units import GB

# checkpoints of these model types carry MTP / NextN layers (issue 32: Qwen3.5/3.6, GLM-4.5, DeepSeek-V3)
MTP_MODEL_TYPES = frozenset({"qwen3_5", "qwen3_5_moe", "qwen3_next", "glm4_moe", "deepseek_v3"})


def add_parser(kinds: argparse._SubParsersAction, handler: str) -> None:
    drafts = kinds.add_parser("drafts", help="projected draft choice for a catalog target on a profile",
                              description="The planner's projection (not a measurement) of each draft candidate "
                              "for a catalog target: MTP head, assistant head, self-draft, catalog draft, "
                              "draft-free; which one the engine would pick and why.")
    drafts.add_argument("--target", required=True, metavar="ID", help="catalog id, e.g. llama-3.3-70b-instruct")
    where = drafts.add_mutually_exclusive_group()
    where.add_argument("--profile", metavar="FILE", help="a saved profile (default: this machine's)")
    where.add_argument("--gpu", choices=sorted(REFERENCE_GPUS), help="a reference GPU instead of a profile")
    drafts.add_argument("--quant", choices=("none", "nf4"), default="nf4", help="the target's layers (default: nf4)")
    drafts.add_argument("--assistant", action="store_true", help="also price a shipped assistant/EAGLE head")
    drafts.add_argument("--versus", type=float, default=None, metavar="TOK_S",
                        help="a measured figure to compare with (e.g. 8.6: UMbreLLa, Llama-3.1-70B 4-bit, RTX 4090)")
    drafts.add_argument("--json", action="store_true", help="print the projection as JSON")
    drafts.set_defaults(**{handler: "engine.cli.bench_drafts:run_bench_drafts"})


def run_bench_drafts(args: argparse.Namespace) -> int:
    from engine.cli.bench import named_profile  # noqa: PLC0415 - bench imports torch-heavy modules
    from engine.planning.profile import load_profile  # noqa: PLC0415

    catalog = load_catalog()
    target = catalog.find(args.target)
    if target is None:
        raise InvalidRequest(f"'{args.target}' is not in the catalog; `specchat models list` shows the ids.")
    if args.gpu:
        profile = reference_profile(args.gpu)
        where = f"{args.gpu} (datasheet roofline, 25 GB/s host->GPU, 128 GB RAM)"
    else:
        from pathlib import Path  # noqa: PLC0415

        loaded = named_profile(Path(args.profile)) if args.profile else load_profile()
        if loaded is None:
            raise InvalidRequest("No hardware profile: run `specchat bench hardware` first, or pass --gpu NAME.")
        profile, where = loaded, f"profile {args.profile or 'of this machine'}"
    shape = target.shape()
    placement = planner.estimate_placement(profile, shape, args.quant)
    heads: list[HeadOption] = []
    if target.model_type in MTP_MODEL_TYPES:
        heads.append(HeadOption("mtp", "MTP head (1 layer)"))
    if args.assistant:
        heads.append(HeadOption("assistant", "assistant/EAGLE head (1 layer)"))
    pair = catalog.draft_pair(target.id)  # a draft model: a catalog EAGLE-3 head is --assistant's kind
    draft_model = catalog.find(pair.draft) if pair is not None else None
    cat = CatalogOption(draft_model.id, draft_model.shape()) if draft_model is not None else None
    fits = projected_self_option(profile, shape, placement)
    choice = choose_draft(DraftOptions(shape, placement, tuple(heads), fits, cat), profile)
    # a self-draft beside fewer resident target layers, when it does not fit beside the loader's
    for trial, option in project_self_placements(profile, shape, placement) if fits.bits is None else []:
        alt = choose_draft(DraftOptions(shape, trial, (), option, None), profile)
        if alt.kind == "self" and (alt.tokens_per_second or 0) > (choice.tokens_per_second or 0):
            choice = replace(alt, reason=f"{alt.reason}; with {trial.describe()}", rejected=choice.rejected)
            break
    ar = planner.autoregressive_tokens_per_second(profile, shape, placement)
    what_ifs = _self_what_ifs(profile, shape, placement)
    rows: list[dict[str, Any]] = [{"kind": choice.kind, "label": choice.label, "tokens_per_second":
                                   choice.tokens_per_second, "chosen": True, "reason": choice.reason}]
    rows += [{"kind": c.kind, "label": c.label, "tokens_per_second": c.tokens_per_second, "chosen": False,
              "reason": c.reason} for c in choice.rejected]
    if args.json:
        print(json.dumps({"projection": True, "target": target.id, "where": where, "quant": args.quant,
                          "placement": placement.describe(), "autoregressive_tokens_per_second": ar,
                          "candidates": rows, "self_draft_what_if": what_ifs, "versus": args.versus}))
        return 0
    print(f"PROJECTION (planner, priors; not measured): {target.id} at {args.quant} on {where}")
    print(f"target: {placement.describe()}; autoregressive {ar:.2f} tok/s")
    print(f"{'candidate':<44}{'pred tok/s':>11}  why")
    for row in rows:
        tps = f"{row['tokens_per_second']:.2f}" if row["tokens_per_second"] is not None else "-"
        print(f"{('* ' if row['chosen'] else '  ') + row['label']:<44}{tps:>11}  {row['reason']}")
    print("self-draft what-if (as if its substitutes fit beside the loader's placement):")
    for w in what_ifs:
        print(f"  {w['bits']}-bit: needs {w['needs_gb']:.1f} GB ({w['left_gb']:.1f} GB left): "
              f"{w['tokens_per_second']:.2f} tok/s de-quantising each pass, "
              f"{w['fused_tokens_per_second']:.2f} tok/s with a fused low-bit kernel")
    if args.versus and choice.tokens_per_second:
        print(f"versus {args.versus:g} tok/s measured elsewhere: {choice.tokens_per_second / args.versus:.2f}x "
              "(projection)")
    return 0


def _self_what_ifs(profile: HardwareProfile, shape: ModelShape, placement: Placement) -> list[dict[str, Any]]:
    offloaded = placement.num_layers - placement.gpu_layers
    left = device_left(profile, shape, placement)
    out = []
    for bits in SELF_BITS:
        speeds = []
        for fused in (False, True):
            plan = planner.choose_budget(profile, shape, shape, placement, prior_curve("self", bits),
                                         draft_pass=self_pass(profile, shape, placement, bits, offloaded, fused))
            speeds.append(plan.tokens_per_second)
        out.append({"bits": bits, "label": self_label(bits, offloaded, placement.num_layers),
                    "needs_gb": substitute_bytes_estimate(shape, offloaded, bits) / GB, "left_gb": left / GB,
                    "tokens_per_second": speeds[0], "fused_tokens_per_second": speeds[1]})
    return out
