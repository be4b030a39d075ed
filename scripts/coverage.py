"""Coverage report: every decoder-only model type of the installed transformers, trained one step at tp=2, tp=2 with
sequence parallel and dp_shard=2 on 2 gloo processes, against a single process (see
lightning_automodel/testing/coverage_report/check.py).

    .venv/bin/python scripts/coverage.py                                  # what docs/coverage.json lacks, then the page
    .venv/bin/python scripts/coverage.py --fresh                          # measure everything again
    .venv/bin/python scripts/coverage.py --types llama,gpt2 --layouts tp2 # a subset (results merge into the file)
    .venv/bin/python scripts/coverage.py --types xmod --again             # a subset measured again
    .venv/bin/python scripts/coverage.py --page-only                      # rewrite docs/coverage.md from the results
    .venv/bin/python scripts/coverage.py --registry image-text-to-text    # vision-language models, batches with
                                                                          # images (docs/coverage_vision.md)

Results go to a JSON file after every check, so an interrupted sweep resumes where it stopped; results of other
torch or transformers versions are measured again. Checks run in launches of two processes that take one check
after another; a check that hangs, crashes one rank, or leaves the process group unusable ends its launch, and the
next launch starts at the following check.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_automodel.testing.coverage_report.check import COLLECTIVE_TIMEOUT, LAYOUTS, coverage_check
from lightning_automodel.testing.coverage_report.kinds import IMAGE_TEXT, TEXT
from lightning_automodel.testing.coverage_report.launch import Job, measure
from lightning_automodel.testing.coverage_report.model_types import (
    IMAGE_SKIP_REASONS,
    SKIP_REASONS,
    causal_lm_types,
    coverage_types,
    image_text_types,
    library_revision,
)
from lightning_automodel.testing.coverage_report.verdicts import NO_IMAGE_INPUTS, PASS, REFUSAL, VERDICTS, WRONG

ROOT = Path(__file__).resolve().parent.parent
SKIPPED = "skipped"
LAYOUT_TITLES = {"tp2": "tp=2", "tp2_sp": "tp=2 + sp", "dp_shard2": "dp_shard=2"}


@dataclass(frozen=True)
class Registry:
    """A registry of transformers the report covers: its types (and rows beyond them), those it counts and skips,
    where its results and page go, and the page's title and method."""

    kind: str
    types: Callable[[], dict[str, str]]  # every row, by name, with the class it builds
    counted: Callable[[], dict[str, str]]  # the model types the counts are of
    skips: dict[str, str]
    results: Path
    page: Path
    title: str
    method: str
    verdicts: tuple[str, ...] = VERDICTS


def main() -> None:
    args = parse_args()
    registry = REGISTRIES[args.registry]
    store = ResultStore(args.results or registry.results, fresh=args.fresh)
    if not args.page_only:
        jobs = [(t, layout) for t in select_types(args.types, registry) for layout in args.layouts]
        for job in jobs if args.again else []:
            store.results.pop(key(job), None)
        command = " ".join(["scripts/coverage.py", *sys.argv[1:]])
        sweep(jobs, store, registry=registry, job_timeout=args.job_timeout, command=command)
    page = args.page or registry.page
    page.write_text(render_page(store, registry))
    print(f"wrote {page} ({len(store.results)} results in {store.path})")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--types", help="comma-separated model types or extra tiny configs (default: every causal-LM type and those)"
    )
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--registry", choices=list(REGISTRIES), default=TEXT.name, help="which models (default: text)")
    parser.add_argument("--results", type=Path, help="default: docs/coverage.json, docs/coverage_vision.json")
    parser.add_argument("--page", type=Path, help="default: docs/coverage.md, docs/coverage_vision.md")
    parser.add_argument("--fresh", action="store_true", help="forget the stored results and measure everything")
    parser.add_argument("--again", action="store_true", help="measure the selected types again, keeping the others")
    parser.add_argument("--page-only", action="store_true", help="only rewrite the page from the stored results")
    parser.add_argument("--job-timeout", type=float, default=4 * COLLECTIVE_TIMEOUT.total_seconds())
    args = parser.parse_args()
    args.layouts = args.layouts.split(",")
    unknown = set(args.layouts) - set(LAYOUTS)
    if unknown:
        parser.error(f"unknown layouts {sorted(unknown)}; choose from {list(LAYOUTS)}")
    return args


def select_types(types: str | None, registry: Registry) -> list[str]:
    known = registry.types()
    chosen = types.split(",") if types else list(known)
    unknown = [t for t in chosen if t not in known]
    if unknown:
        raise SystemExit(f"not in the {registry.kind} registry (of transformers, or an extra tiny config): {unknown}")
    return chosen


class ResultStore:
    """Verdicts by "type/layout", kept in a JSON file that every new verdict rewrites (an interrupted sweep keeps
    what it measured). Results measured with other torch or transformers versions are dropped."""

    def __init__(self, path: Path, *, fresh: bool) -> None:
        self.path = path
        self.versions = versions()
        stored = json.loads(path.read_text()) if path.exists() and not fresh else {}
        same = stored.get("versions") == self.versions
        self.results: dict[str, dict[str, Any]] = stored.get("results", {}) if same else {}
        self.runs: list[dict[str, Any]] = stored.get("runs", []) if same else []

    def __contains__(self, job: Job) -> bool:
        return key(job) in self.results

    def record(self, job: Job, verdict: dict[str, Any]) -> None:
        self.results[key(job)] = verdict
        self.save()

    def save(self) -> None:
        data = {"versions": self.versions, "runs": self.runs, "results": dict(sorted(self.results.items()))}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        staging = self.path.with_suffix(".tmp")
        staging.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        os.replace(staging, self.path)


def key(job: Job) -> str:
    return "/".join(job)


def versions() -> dict[str, str]:
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


def sweep(jobs: Sequence[Job], store: ResultStore, *, registry: Registry, job_timeout: float, command: str) -> None:
    """Measure every job the store lacks, and note the run's wall time and launches in the store."""
    pending = [job for job in jobs if job not in store]
    for job in [job for job in pending if job[0] in registry.skips]:
        store.record(job, {"verdict": SKIPPED, "detail": registry.skips[job[0]]})
    pending = [job for job in pending if job[0] not in registry.skips]
    if not pending:
        return
    started, launches = time.monotonic(), 0
    check = coverage_check if registry.kind == TEXT.name else functools.partial(coverage_check, kind=registry.kind)
    for launches, job, verdict in measure(pending, job_timeout=job_timeout, check=check):
        store.record(job, verdict)
        print(f"launch {launches}  {key(job):40s} {verdict['verdict']:14s} {verdict['detail'][:100]}", flush=True)
    run = {"date": datetime.date.today().isoformat(), "command": command, "checks": len(pending)}
    run["lightning_automodel"] = library_revision()
    store.runs.append({**run, "launches": launches, "seconds": round(time.monotonic() - started)})
    store.save()


def render_page(store: ResultStore, registry: Registry) -> str:
    """The registry's page: how it was measured, counts per layout and verdict, one row per model type."""
    types = registry.types()
    layouts = [layout for layout in LAYOUTS if any(key((t, layout)) in store.results for t in types)]
    lines = [
        f"# {registry.title}",
        "",
        "Generated by `scripts/coverage.py`: do not edit. " + _provenance(store),
        "",
        registry.method,
        "",
        "## Counts",
        "",
        *_counts_table(store, registry, layouts),
        "",
        "## Every model type",
        "",
        "| type | class | " + " | ".join(LAYOUT_TITLES[layout] for layout in layouts) + " |",
        "|---|---|" + "---|" * len(layouts),
    ]
    for model_type, class_name in types.items():
        cells = [_cell(store.results.get(key((model_type, layout))), layout) for layout in layouts]
        if any(cell != "not measured" for cell in cells):
            lines.append(f"| {model_type} | {class_name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


METHOD = """\
Every model type of the installed transformers' `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` is built from a tiny config
derived from its own config class (`lightning_automodel/hf/shrink.py`: hidden size 64, 4 heads, vocabulary 128, one
layer of each kind, dropout off) and trained one step on 2 gloo processes, as `AutoModelParallelStrategy` does it:
built on the meta device, `parallelize(model, mesh, sp=...)` with the strategy's defaults, `materialize_hf_model`,
then the single-process model's weights loaded shard by shard. Loss, logits and every gradient (full tensors) are
compared with the single-process run of the same batch (4 rows of 16 tokens, padded), within the tests' fp32 tolerance
(2e-5 relative to each tensor's largest value; for a gradient whose single-process fp32 value rounds by more than
5e-6, as those through cancelling sums (DiffLlama's lambda vectors) or recurrences (Qwen3-Next's decays), four times
that, up to 1e-3: the rounding measured as the distance from an fp64 run, and as the change when every weight moves by
half an fp32 unit, which also reaches kernels that compute in fp32 whatever their inputs).

- **pass**: within tolerance. The percentage is the share of the decoder blocks' weight elements (those a
  text-only step trains) that tensor parallelism splits over the two ranks; `E`/`H` mark a vocabulary-sharded
  embedding / lm_head, then where the plan came from. A pass at 0% runs, with every block whole on every rank.
- **wrong**: it runs, and some number differs (the largest relative errors; the worst gradient is named).
- **refusal**: a ValueError, TypeError or NotImplementedError raised by lightning_automodel itself, with the same
  message on every rank; **late** when a collective had run before it (a refusal should come before any, so that
  no rank can be left waiting in one).
- **crash**: any other exception, or one raised on some ranks only.
- **hang**: no result within the time limit, or every rank timed out in a collective.
- **no tiny config**: the type's config or model cannot be built, or a single-process step fails, in transformers
  itself: not our failure, and not measured.
- **skipped**: not a decoder-only text model (the reason is given).

Rows named `type:what` check a tiny config of their own beside the type's (`EXTRA_TINY_CONFIGS` in
`lightning_automodel/testing/coverage_report/model_types.py`): configs found failing where the type's own passed. The
counts are of the model types alone.

A **note** says that a buffer of the meta-device build, after `materialize_hf_model`, differs from what
transformers computes (the numbers above are taken with the reference's buffers copied in): a model built on the
meta device would train with those values. **built with real weights**: the strategy refuses the meta-device build
of this type (its constructor makes real tensors under the meta device) and names building it with real weights as
the fix; the check took that fix."""


IMAGE_METHOD = """\
Every model type of the installed transformers' `MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES` is built as
`AutoModelForImageTextToText` from a tiny config derived from its own config class
(`lightning_automodel/hf/vision/tiny.py`: the text and vision sub-configs shrunk as text models are, a tower of two
layers, images of 16 x 16 pixels in patches of 4, projections sized to the text width, M-RoPE sections fitted to the
tiny head, special tokens moved into the vocabulary of 128) and trained one step on 2 gloo processes as the text
models are ([coverage.md](coverage.md): built on the meta device, `parallelize`, `materialize_hf_model`, the
single-process weights loaded shard by shard, the same fp32 tolerances), on a batch of 4 rows each holding one image
in the model's own image inputs, built from its config (`lightning_automodel/hf/vision/image_inputs.py`): pixel
values per image, or flattened patches and `image_grid_thw` for Qwen-style towers with M-RoPE; `image_sizes` where
the tower takes them (Pixtral); a tile beside the base image and its size where the config tiles images (LLaVA-NeXT,
OneVision); one real tile of the config's `max_num_tiles`, its `aspect_ratio_ids` and, for a model reading images by
cross-attention, one token an image and the `cross_attention_mask` of the tokens after it (Mllama); a list of one
image per row and `pixel_attention_mask`, of pixels, or of tiles where the tower takes no patch mask (Idefics2,
SmolVLM; Granite Docling); a second tower's `<name>_pixel_values` for a `<name>_vision_config` (DeepSeek-VL-Hybrid);
unflattened patches for a 2-D patch embedding (PaddleOCR-VL), each token's patches as one block of pixels where the
tower takes grids in tokens (Inkling2), `image_merge_sizes` where the forward takes them (VideoLLaMA3); the token
that opens an image before its placeholders where the rope index finds images by it (the Qwen omni thinkers'
`vision_start_token_id`); each row's own `position_ids` where the rope index numbers images across the batch
(HunYuan-VL); token types where the forward takes them. Beside those
(`lightning_automodel/hf/vision/beside_pixels.py`, `patch_sequences.py`): the Q-Former's queries at a placeholder
the tiny config sets (BLIP-2; InstructBLIP's instruction too; InstructBLIP-Video's image a one-frame video);
placeholders a mask marks (Kosmos-2); no placeholders, the image read beside the text (BLIP, Idefics with its
`image_attention_mask`) or before it (GIT, whose logits for the image are left out); sequences of flattened patches
with their grid (NaFlex: LFM2-VL), their positions (Gemma 4) or row and column ids (Kosmos-2.5), or without a tower
(Fuyu). A row is a text token, the image's placeholders (as many as the model makes features of one image: measured
by its `get_image_features`, else as its config says), then 16 tokens of text, the last two padding; the
placeholders are never predicted. Each half of the batch must give, run alone in one process, the logits it gives in
the whole batch (what a data-parallel rank's rows must do), and other pixels must give other logits (a model blind
to the images built is not measured). Loss, logits and every gradient, the vision tower's and the projector's
included, are compared with one process. A model that fails on its image inputs and on text alone too is
transformers' failure (**no tiny config**, the text-alone error named); one whose `get_image_features` requires
arguments the builder does not make names them.

- **pass**: within tolerance. The percentage is the share of the trained weight elements of all blocks, the
  language model's and the vision tower's, that tensor parallelism splits; `(tower N%)` is that share of the
  tower's blocks alone, and **tower whole** marks a tower (and projector) held whole on every tp rank, with the
  reason the plan report gives (its FSDP2 shards and gradient reduction are checked all the same). `E`/`H` mark a
  vocabulary-sharded embedding / lm_head, then where the language model's plan came from.
- **no image inputs**: the input builder knows no image inputs for this model (its config gives no placeholder or
  image size it reads), or the model fails on those it builds, or its rows do not stand apart (named): our limit,
  stated, not measured.
"""
IMAGE_METHOD += METHOD[METHOD.index("- **wrong**") : METHOD.index("- **skipped**")]
IMAGE_METHOD += "- **skipped**: not a decoder of images and text to text (the reason is given).\n\n"
IMAGE_METHOD += METHOD[METHOD.index("A **note**") :]


TOWER_WHOLE = "of which tower whole"
REGISTRIES = {
    TEXT.name: Registry(
        kind=TEXT.name,
        types=coverage_types,
        counted=causal_lm_types,
        skips=SKIP_REASONS,
        results=ROOT / "docs" / "coverage.json",
        page=ROOT / "docs" / "coverage.md",
        title="Coverage of Hugging Face causal LMs",
        method=METHOD
        + "\n\nImage-text-to-text models, with images in their batches: [coverage_vision.md](coverage_vision.md).",
    ),
    IMAGE_TEXT.name: Registry(
        kind=IMAGE_TEXT.name,
        types=image_text_types,
        counted=image_text_types,
        skips=IMAGE_SKIP_REASONS,
        results=ROOT / "docs" / "coverage_vision.json",
        page=ROOT / "docs" / "coverage_vision.md",
        title="Coverage of Hugging Face image-text-to-text models",
        method=IMAGE_METHOD,
        verdicts=(*VERDICTS, NO_IMAGE_INPUTS),
    ),
}


def _provenance(store: ResultStore) -> str:
    versions = ", ".join(f"{name} {version}" for name, version in store.versions.items())
    runs = "; ".join(
        f"{run['date']}, lightning_automodel at {run['lightning_automodel']}: `{run['command']}`, {run['checks']}"
        f" checks in {run['seconds']} s wall time on 2 CPU cores ({run['launches']} launches)"
        for run in store.runs
    )
    return f"Measured with {versions}. Runs: {runs or 'none'}."


def _counts_table(store: ResultStore, registry: Registry, layouts: Sequence[str]) -> list[str]:
    tower = [TOWER_WHOLE] if registry.kind == IMAGE_TEXT.name else []
    columns = [PASS, "of which 0% sharded", *tower, WRONG, REFUSAL, "of which late", *registry.verdicts[3:], SKIPPED]
    columns.append("buffer notes")
    lines = ["| layout | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    for layout in layouts:
        results = [r for r in (store.results.get(key((t, layout))) for t in registry.counted()) if r is not None]
        counts = Counter(r["verdict"] for r in results)
        tp = LAYOUTS[layout]["tp"] > 1
        whole = sum(r["verdict"] == PASS and r.get("sharded") == 0 for r in results)
        counts["of which 0% sharded"] = whole if tp else "-"
        counts[TOWER_WHOLE] = sum(r["verdict"] == PASS and not r.get("tower_sharded") for r in results) if tp else "-"
        counts["of which late"] = sum(r["verdict"] == REFUSAL and r["after_collectives"] for r in results)
        counts["buffer notes"] = sum("note" in r for r in results)
        lines.append(f"| {LAYOUT_TITLES[layout]} | " + " | ".join(str(counts[c]) for c in columns) + " |")
    return lines


def _cell(result: dict[str, Any] | None, layout: str) -> str:
    if result is None:
        return "not measured"
    note = f"; note: {_short(result['note'], 80)}" if "note" in result else ""
    note += f"; built {_short(result['build'], 40)}" if "build" in result else ""
    if result["verdict"] != PASS:
        late = " (late)" if result.get("after_collectives") else ""
        return f"**{result['verdict']}**{late}: {_short(result['detail'])}{note}"
    if LAYOUTS[layout]["tp"] == 1:
        return f"pass{note}"
    marks = "".join(mark for mark, flag in (("E", "embedding_sharded"), ("H", "lm_head_sharded")) if result[flag])
    share = f"{result['sharded']:.0%}" if result.get("sharded") is not None else "no blocks"
    if "tower_sharded" in result:
        why = next(iter((result.get("kept_whole") or {}).values()), "")
        whole = f" (tower whole: {_short(why, 100)})" if why else " (tower whole)"
        share += f" (tower {result['tower_sharded']:.0%})" if result["tower_sharded"] else whole
    plan = (result.get("plan") or "").split(" of ")[0].split(" for ")[0]  # "Hugging Face plan", "family plan", ...
    return f"pass {share} {marks}".rstrip() + f" ({plan}){note}"


def _short(text: str, limit: int = 140) -> str:
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"


if __name__ == "__main__":
    main()
